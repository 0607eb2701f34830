"""Exchange scheduling: one step's TransferTable -> a cycle-precise Timetable of send and listen intervals.

The machine model (ref ipu-hardware.md §1, §4; values from the chip file):

- A stream runs at `rate = min(send B/cycle, recv B/cycle)` bytes per cycle: the receivers take the sender's words as
  they come. A chunk of c bytes occupies its sender and its listeners for ceil(c / rate) cycles, so each transfer costs
  at least ceil(bytes / rate) cycles however it is split (a tile sends whole exchange words).
- A tile's send port carries one stream at a time. Multicast is free for the sender: every destination listens to the
  same interval.
- A tile's receive port (its incoming mux) listens to one sender at a time.
- Shared exchange bus (`tiles_per_shared_exchange_bus` = P, ref §4: "two neighbouring tiles share an exchange bus; a
  tile pair receiving the same data gets 2x effective receive bandwidth"). Assumed here: tiles t with equal t // P form
  a bus group whose P receive ports both see the group's bus, so a stream that goes to two or more tiles of one group is
  taken in through ONE port of that group (a port of one of those destination tiles) and written into every
  destination tile of the group. Data for a single tile of the group must come through that tile's own port. So a
  pair that receives the same data can listen to two different senders at once (one per port) = 2x the receive
  bandwidth of a single tile; a tile never takes more than one stream meant for it alone. P = 1 turns sharing off.
  Which port a shared stream uses is chosen before scheduling to balance the ports' loads (longest first).

Scheduling (documented trade-off: fast and near the lower bound on the patterns a planner makes, not optimal):

1. Transfers with the same resources (sender port + set of receive ports) form one *flow*; a flow is its transfers end
   to end. For unicast traffic a flow is an edge of the bipartite multigraph senders x receivers with weight = cycles.
   König's theorem: if flows may be split (preempted), a schedule as long as the maximum degree (the busiest port's
   cycles) exists. Multicast makes the graph a hypergraph, where that bound need not be reachable (three tiles each
   pair of which shares a multicast need 1.5x) - so the lower bound stays the busiest port's cycles, and the
   scheduler is judged against it.
2. Earliest fit (placement.py): flows are placed widest multicast first, then most-critical first (the load of the
   busiest port they use), then longest; ties broken by the ring distance receiver - sender, which makes an
   all-to-all a sequence of permutations. Each flow fills, from cycle 0, every window where its sender and all its ports are idle, split
   into pieces of at least `min_piece_cycles` (fewer pieces = less exchange code) until it is done.
   König: when that ends above the lower bound and the receive sides of the flows never partly overlap (unicast, or
   multicasts to disjoint tile sets - then each set acts as one receiver), the step is a bipartite multigraph senders
   x receiver sets and is scheduled exactly in max-degree time (konig.py, at most KONIG_MAX_FLOWS flows); the shorter
   of the two schedules is kept. Partly overlapping multicasts (e.g. matmul operand rows and columns) stay with
   earliest fit.
   Measured: at the bound on all-to-all, reduce-scatter, gather, K/V broadcasts, matmul operand grids and random
   unicast; within 1.2x on every step of bert-base and vit-base (c600, fp16); random wide multicasts can be ~1.9x of
   the bound, which is loose there (conflicting hyperedges, not port load, set their length).
3. Pieces map back to chunks of transfers (byte offset, bytes, start, end).

The chip's fixed exchange cost is added once: chunk times are from the start of the data movement, `makespan` =
exchange_fixed_cycles + the last chunk's end (0 when nothing moves, as cost.exchange_cycles).

Exchange code: the chunks are priced by the encoding model the memory plan reserves with (chip file [exchange_code],
ipu-stack-facts §1.2; target/overheads.chunk_code_bytes), so splitting a transfer or receiving out of address order
shows up as the code it costs (Timetable.exchange_code_bytes).

Repeated layers: a step's flows are computed once per traffic pattern up to tile names (patterns.py) and its
timetable once per pattern and order of placement; the result is the same as scheduling every step afresh.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from tremula.program import TransferTable
from tremula.sorting import positions_in_runs
from tremula.target.chip import Chip
from tremula.target.overheads import chunk_code_bytes
from tremula.timing.konig import KONIG_MAX_FLOWS, konig_schedule, receiver_classes
from tremula.timing.patterns import canonical_pattern
from tremula.timing.placement import greedy_pieces

I64 = np.int64


@dataclass
class Timetable:
    """A scheduled exchange, columnar. Chunk k moves bytes [offset[k], offset[k] + nbytes[k]) of transfer[k] (bytes of
    its rows x row_bytes pattern in row order) from its sender to all its destinations during cycles [start[k], end[k]).

    d_port[j] (aligned with the table's d_tile) is the tile whose receive port takes destination j's bytes: d_tile[j]
    itself, or a bus-group neighbour that is also a destination of the same transfer.

    send_code, recv_code and phase_code are the exchange code the chunks need per tile, priced when scheduled by the
    chip's encoding model (target/overheads.chunk_code_bytes); None while not priced (the cached timetables of renamed
    tables: each step's code is counted from its own table).
    """

    transfer: np.ndarray  # int64 [chunks]
    offset: np.ndarray  # int64 [chunks]
    nbytes: np.ndarray  # int64 [chunks]
    start: np.ndarray  # int64 [chunks] cycles from the start of data movement
    end: np.ndarray  # int64 [chunks]
    d_port: np.ndarray  # int32 [destinations of the table]
    makespan: int  # cycles including the fixed exchange cost
    lower_bound: int  # fixed cost + the busiest port's cycles (see stream_lower_bound)
    fixed_cycles: int
    send_code: np.ndarray | None = None  # int64 [tiles] bytes of the senders' code
    recv_code: np.ndarray | None = None  # int64 [tiles] bytes of the receivers' code
    phase_code: np.ndarray | None = None  # int64 [tiles] phase entry and return on each tile taking part

    def __len__(self) -> int:
        return len(self.transfer)

    @property
    def ratio(self) -> float:
        """makespan / lower_bound (1.0 for an empty exchange)."""
        return self.makespan / self.lower_bound if self.lower_bound else 1.0

    def exchange_code_bytes(self, chip: Chip) -> np.ndarray:
        """Bytes of exchange code per tile, by the encoding model the memory plan reserves with (chip file
        [exchange_code], ipu-stack-facts §1.2) applied to the chunks this timetable runs: per chunk, a send per
        contiguous run of its source (with continuations past send_words words) and a receive per destination (a
        pointer reset per further row of a strided destination and when it does not continue its tile's previous
        receive in time), plus a phase entry and return on every tile taking part (target/overheads.chunk_code_bytes).
        `chip` must be the chip the timetable was scheduled for: its table priced the code then."""
        del chip  # priced at scheduling time; kept in the signature for the callers
        return self.send_code + self.recv_code + self.phase_code


def stream_rate(chip: Chip) -> int:
    """Bytes per cycle of one stream: the slower of the sender's and the receiver's port."""
    return min(chip.exchange_send_bytes_per_cycle_per_tile, chip.exchange_recv_bytes_per_cycle_per_tile)


def transfer_cycles(table: TransferTable, chip: Chip) -> np.ndarray:
    """Cycles each transfer occupies its ports, at least: ceil(bytes / rate)."""
    rate = stream_rate(chip)
    return -(-(np.asarray(table.rows, I64) * np.asarray(table.row_bytes, I64)) // rate)


# ------------------------------------------------------------------------------------------------ ports


def assign_ports(table: TransferTable, chip: Chip) -> np.ndarray:
    """d_port for every destination entry: its own tile, or (shared bus) one port per (transfer, bus group) when the
    transfer goes to two or more tiles of that group, chosen to balance port loads (longest transfer first)."""
    d_tile = np.asarray(table.d_tile, I64)
    port = d_tile.copy()
    P = chip.tiles_per_shared_exchange_bus
    m = len(d_tile)
    if P <= 1 or m == 0:
        return port.astype(np.int32)
    cyc = transfer_cycles(table, chip)
    tr = np.repeat(np.arange(len(table), dtype=I64), np.diff(np.asarray(table.dst_start, I64)))
    group = d_tile // P
    order = np.lexsort((d_tile, group, tr))
    key_tr, key_g = tr[order], group[order]
    new = np.ones(m, bool)
    new[1:] = (key_tr[1:] != key_tr[:-1]) | (key_g[1:] != key_g[:-1])
    starts = np.flatnonzero(new)
    counts = np.diff(np.append(starts, m))
    tiles_sorted = d_tile[order]
    # A transfer may name one tile twice (two addresses): what matters is how many distinct tiles of the group it feeds.
    tile_new = new.copy()
    tile_new[1:] |= tiles_sorted[1:] != tiles_sorted[:-1]
    distinct = np.add.reduceat(tile_new.astype(I64), starts)
    # Load of each port from streams only it can take (one destination tile in the group).
    alone = np.flatnonzero(distinct == 1)
    load = np.bincount(tiles_sorted[starts[alone]], weights=cyc[key_tr[starts[alone]]], minlength=chip.tiles)
    load = load.astype(I64)
    shared = np.flatnonzero(distinct >= 2)
    if len(shared) == 0:
        return port.astype(np.int32)
    if P == 2:
        # Pairs: water-fill. The pair's shared streams (longest first) fill the less-loaded port up to the level where
        # both ports carry the same load; each stream goes to the port its midpoint falls in.
        sc = cyc[key_tr[starts[shared]]]
        g = key_g[starts[shared]]
        o = np.lexsort((key_tr[starts[shared]], -sc, g))
        shared, sc, g = shared[o], sc[o], g[o]
        a, b = load[2 * g], load[np.minimum(2 * g + 1, chip.tiles - 1)]
        first_in_g = np.r_[True, g[1:] != g[:-1]]
        csum = np.cumsum(sc)
        before = csum - sc - np.maximum.accumulate(np.where(first_in_g, csum - sc, 0))
        total = np.bincount(g, weights=sc, minlength=int(g.max()) + 1)[g]
        cap_a = np.clip((a + b + total) / 2.0 - a, 0, None)  # shared load the even port takes
        to_even = before + sc / 2.0 < cap_a
        choice = np.where(to_even, 2 * g, 2 * g + 1)
        cnt = counts[shared]
        within = positions_in_runs(cnt)
        port[order[np.repeat(starts[shared], cnt) + within]] = np.repeat(choice, cnt)
        return port.astype(np.int32)
    # Wider buses: longest shared stream first to the least-loaded of its destination ports.
    sc = cyc[key_tr[starts[shared]]]
    shared = shared[np.lexsort((key_tr[starts[shared]], -sc))]
    for k in shared.tolist():
        a, b = int(starts[k]), int(starts[k] + counts[k])
        cand = np.unique(tiles_sorted[a:b])
        best = int(cand[np.argmin(load[cand])])
        load[best] += cyc[key_tr[a]]
        port[order[a:b]] = best
    return port.astype(np.int32)


def port_loads(table: TransferTable, chip: Chip, d_port: np.ndarray, pairs=None) -> tuple[np.ndarray, np.ndarray]:
    """Cycles on each tile's send port and receive port (one listen per distinct port of a transfer)."""
    cyc = transfer_cycles(table, chip)
    send = np.bincount(np.asarray(table.src_tile, I64), weights=cyc, minlength=chip.tiles).astype(I64)
    tr, pt = unique_ports(table, d_port) if pairs is None else pairs
    recv = np.bincount(pt, weights=cyc[tr], minlength=chip.tiles).astype(I64)
    return send, recv


def unique_ports(table: TransferTable, d_port: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(transfer, port) pairs, each once: the receive ports that listen to each transfer."""
    tr = np.repeat(np.arange(len(table), dtype=I64), np.diff(np.asarray(table.dst_start, I64)))
    if len(tr) == 0:
        return tr, tr
    T = int(np.max(d_port)) + 1
    key = _unique(tr * T + np.asarray(d_port, I64))
    return key // T, key % T


def _unique(key: np.ndarray, return_counts: bool = False):
    """np.unique of int keys, without its sort when the keys are already in order (most tables list each transfer's
    destinations by tile)."""
    if len(key) == 0 or not np.all(key[1:] >= key[:-1]):
        return np.unique(key, return_counts=return_counts)
    first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    if not return_counts:
        return key[first]
    return key[first], np.diff(np.append(first, len(key)))


def stream_lower_bound(table: TransferTable, chip: Chip) -> int:
    """Cycles no schedule under this model can beat: max over the busiest send port, the busiest port's own traffic,
    and each bus group's total receive traffic / P (the group's P ports together). Independent of port choice."""
    n = len(table)
    if n == 0:
        return 0
    cyc = transfer_cycles(table, chip)
    send = np.bincount(np.asarray(table.src_tile, I64), weights=cyc, minlength=chip.tiles)
    P = max(1, chip.tiles_per_shared_exchange_bus)
    d_tile = np.asarray(table.d_tile, I64)
    tr = np.repeat(np.arange(n, dtype=I64), np.diff(np.asarray(table.dst_start, I64)))
    uk = _unique(tr * chip.tiles + d_tile)  # a tile named twice by one transfer receives it once
    tr, d_tile = uk // chip.tiles, uk % chip.tiles
    G = chip.tiles // P + 1
    ukey, counts = _unique(tr * G + d_tile // P, return_counts=True)
    if len(ukey) == 0:
        return int(send.max())
    pairs = np.stack([ukey // G, ukey % G], axis=1)
    # Entries alone in their group load their own port; every (transfer, group) loads the group once.
    grp_load = np.bincount(pairs[:, 1], weights=cyc[pairs[:, 0]])
    if P > 1:
        key = tr * G + d_tile // P
        alone = counts[np.searchsorted(ukey, key)] == 1
    else:
        alone = np.ones(len(d_tile), bool)
    own = np.bincount(d_tile[alone], weights=cyc[tr[alone]], minlength=chip.tiles)
    group_bound = np.ceil(grp_load / P - 1e-9).max() if len(grp_load) else 0
    return int(max(send.max(), own.max() if len(own) else 0, group_bound))


# ------------------------------------------------------------------------------------------------ schedule


# Two caches: a step's flows by its traffic pattern up to tile names (patterns.py), and its timetable by that pattern
# and the order its flows are placed in - the order breaks ties by the step's own tile numbers, so steps of one pattern
# whose tiles lie in another order get their own timetable, exactly the one scheduling them afresh gives.
_FLOWS: OrderedDict[tuple, _Flows | None] = OrderedDict()
_FLOWS_SIZE = 128  # a base model has ~100 patterns; the largest hold ~6e4 flows (a few MB as Python lists)
_CACHE: OrderedDict[tuple, Timetable] = OrderedDict()
_CACHE_SIZE = 256


def _lru(cache: OrderedDict, key: tuple, size: int, make):
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = make()
    if len(cache) > size:
        cache.popitem(last=False)
    return value


def schedule_exchange(table: TransferTable, chip: Chip, min_piece_cycles: int = 16) -> Timetable:
    """A cycle-precise timetable for one step's exchange (see the module docstring for the model and the method).

    Steps of identical layers move the same traffic between other tiles and addresses. They are scheduled on the
    table with its tiles renamed by rank (patterns.py), whose schedule is the step's own with the tiles renamed, so a
    pattern's flows and, for each order of its flows, its timetable are computed once; the result names the step's
    own tiles and counts exchange code from the step's own rows. Same result as without the caches (_schedule)."""
    pat = canonical_pattern(table, chip, min_piece_cycles)
    fl = _lru(_FLOWS, pat.key, _FLOWS_SIZE, lambda: _step_flows(pat.table, chip))
    if fl is None:  # nothing moves
        canon = _empty_timetable(pat.table, chip)
    else:
        order = _order(fl, chip.tiles, pat.send_name, pat.recv_name)
        key = (pat.key, hashlib.blake2b(order.tobytes(), digest_size=20).digest())
        canon = _lru(_CACHE, key, _CACHE_SIZE, lambda: _timetable(fl, order, chip, min_piece_cycles))
    return dataclasses.replace(canon, transfer=canon.transfer.copy(), offset=canon.offset.copy(),
                               nbytes=canon.nbytes.copy(), start=canon.start.copy(), end=canon.end.copy(),
                               d_port=pat.recv_name[canon.d_port].astype(np.int32), **_code(table, canon, chip))


def clear_cache() -> None:
    """Forget every cached flow set and schedule (tests compare cached with fresh schedules)."""
    _FLOWS.clear()
    _CACHE.clear()


def _schedule(table: TransferTable, chip: Chip, min_piece_cycles: int) -> Timetable:
    """schedule_exchange without the caches and the renaming: the reference it must equal."""
    fl = _step_flows(table, chip)
    tt = _empty_timetable(table, chip) if fl is None else _timetable(fl, _order(fl, chip.tiles), chip,
                                                                      min_piece_cycles)
    return dataclasses.replace(tt, **_code(table, tt, chip))


@dataclass
class _Flows:
    """Transfers with the same sender and the same set of receive ports form a flow; a flow is its transfers end to
    end. Everything the placement needs but the tie-break by tile numbers (see _order)."""

    d_port: np.ndarray  # assign_ports
    cyc: np.ndarray  # transfer_cycles
    nb: np.ndarray  # bytes per transfer
    flow_id: np.ndarray  # flow of each transfer, -1 when it moves no bytes
    flow_res: list[list[int]]  # ports of each flow: its sender's send port, then T + each receive port
    flow_dur: np.ndarray
    crit: np.ndarray  # load of the busiest port the flow uses
    n_ports: np.ndarray
    flow_src: np.ndarray
    first_port: np.ndarray  # the flow's lowest receive port (-1 when it has none)
    lower_bound: int  # stream_lower_bound


def _empty_timetable(table: TransferTable, chip: Chip) -> Timetable:
    zeros = np.zeros(0, I64)
    return Timetable(zeros, zeros, zeros, zeros, zeros, assign_ports(table, chip), 0, 0, chip.exchange_fixed_cycles)


def _step_flows(table: TransferTable, chip: Chip) -> _Flows | None:
    """The flows of one step and their ordering keys; None when the step moves no bytes."""
    T = chip.tiles
    n = len(table)
    nb = np.asarray(table.rows, I64) * np.asarray(table.row_bytes, I64)
    if n == 0 or int(nb.sum()) == 0:
        return None
    d_port = assign_ports(table, chip)
    cyc = transfer_cycles(table, chip)
    src = np.asarray(table.src_tile, I64)
    utr, upt = unique_ports(table, d_port)
    bounds = np.searchsorted(utr, np.arange(n + 1))
    flow_id, rep = _flows(src, nb, upt, bounds, T)
    nf = len(rep)
    upt_l, bounds_l = upt.tolist(), bounds.tolist()
    flow_res = [[s] + [T + p for p in upt_l[bounds_l[r]: bounds_l[r + 1]]] for s, r in zip(src[rep].tolist(),
                                                                                           rep.tolist())]
    live = flow_id >= 0
    flow_dur = np.bincount(flow_id[live], weights=cyc[live], minlength=nf).astype(I64)

    # Criticality: the load of the busiest port each flow uses.
    send_load, recv_load = port_loads(table, chip, d_port, (utr, upt))
    flow_src = src[rep]
    n_recv = np.diff(bounds)
    busiest_recv = np.zeros(n, I64)
    some = n_recv > 0  # reduceat over the non-empty transfers' starts: each segment is exactly one transfer's ports
    if some.any():
        busiest_recv[some] = np.maximum.reduceat(recv_load[upt], bounds[:-1][some])
    crit = np.maximum(send_load[flow_src], busiest_recv[rep])
    first_port = np.full(nf, -1, I64)
    has = np.flatnonzero(n_recv[rep] > 0)
    first_port[has] = upt[bounds[rep[has]]]
    return _Flows(d_port, cyc, nb, flow_id, flow_res, flow_dur, crit, 1 + n_recv[rep], flow_src, first_port,
                  stream_lower_bound(table, chip))


def _order(fl: _Flows, T: int, send_name: np.ndarray | None = None,
           recv_name: np.ndarray | None = None) -> np.ndarray:
    """The order flows are placed in. Widest multicasts first (they need many ports idle at once and are hardest to
    fit into gaps), then by criticality; measured on random mixes this beats criticality-first by ~15 % and equals it
    on unicast. Ties: longest first, then by the ring distance receiver - sender (an all-to-all becomes a sequence of
    permutations), then by sender. Distances and senders are the step's own tile numbers: `send_name` and
    `recv_name` map the renamed table's tiles back to them (None: the table's tiles are the step's own)."""
    src = fl.flow_src if send_name is None else send_name[fl.flow_src]
    has = fl.first_port >= 0
    port = np.where(has, fl.first_port, 0)
    if recv_name is not None:
        port = recv_name[port]
    ring = np.where(has, (port - src) % T, 0)  # a flow without receivers: sender - sender = 0
    return np.lexsort((np.arange(len(src)), src, ring, -fl.flow_dur, -fl.crit, -fl.n_ports))


def _timetable(fl: _Flows, order: np.ndarray, chip: Chip, min_piece_cycles: int) -> Timetable:
    """Place the flows in `order`, try König where it applies and keep the shorter, cut the pieces into chunks. The
    exchange code is left out: callers count it from the step's own table (_code)."""
    T = chip.tiles
    pieces = greedy_pieces(fl.flow_res, fl.flow_dur, order, 2 * T, min_piece_cycles)
    # Where the receive sides of the flows never partly overlap (unicast, or broadcasts to disjoint tile sets), the
    # step is a bipartite graph senders x receiver sets and König's construction reaches its maximum degree exactly.
    greedy_end = int(pieces[2].max())
    lb = fl.lower_bound
    classes = receiver_classes(fl.flow_res) if lb < greedy_end and len(fl.flow_res) <= KONIG_MAX_FLOWS else None
    if classes is not None:
        exact = konig_schedule(fl.flow_src, classes, fl.flow_dur)
        if int(exact[2].max()) < greedy_end:
            pieces = exact

    tr_c, off_c, nb_c, st_c, en_c = _pieces_to_chunks(*pieces, fl.flow_id, fl.cyc, fl.nb, stream_rate(chip))
    fixed = chip.exchange_fixed_cycles
    return Timetable(tr_c, off_c, nb_c, st_c, en_c, fl.d_port, fixed + int(en_c.max()), fixed + lb, fixed)


def _flows(src: np.ndarray, nb: np.ndarray, upt: np.ndarray, bounds: np.ndarray, T: int) -> tuple[np.ndarray,
                                                                                                   np.ndarray]:
    """(flow of each transfer, -1 when it moves no bytes; first transfer of each flow). Flows are numbered in order
    of first appearance; transfer i's receive ports are upt[bounds[i]:bounds[i + 1]] (sorted, distinct)."""
    n = len(src)
    flow_id = np.full(n, -1, I64)
    live = np.flatnonzero(nb > 0)
    if len(live) == 0:
        return flow_id, np.zeros(0, I64)
    # Group by (sender, port count, two 64-bit sums of fixed pseudo-random words per port), then check every member
    # against its group's first transfer port by port, so a hash collision cannot merge two flows.
    words = np.random.default_rng(20240229).integers(0, 2**63, size=(2, T), dtype=np.int64)
    n_ports = np.diff(bounds)
    cols = [src[live], n_ports[live]]
    for w in words:
        c = np.concatenate([[0], np.cumsum(w[upt], dtype=np.int64)])  # wraps around: only equality matters
        cols.append((c[bounds[1:]] - c[bounds[:-1]])[live])
    _, first, inv = np.unique(np.stack(cols, axis=1), axis=0, return_index=True, return_inverse=True)
    number = np.empty(len(first), I64)
    number[np.argsort(first, kind="stable")] = np.arange(len(first), dtype=I64)
    ids = number[inv.reshape(-1)]
    rep = live[np.sort(first)]
    k = n_ports[live]
    pos = np.arange(int(k.sum()), dtype=I64) - np.repeat(np.cumsum(k) - k, k)
    mine = np.repeat(bounds[live], k) + pos
    theirs = np.repeat(bounds[rep[ids]], k) + pos
    if not np.array_equal(upt[mine], upt[theirs]):
        return _flows_by_dict(src, nb, upt, bounds)
    flow_id[live] = ids
    return flow_id, rep


def _flows_by_dict(src, nb, upt, bounds) -> tuple[np.ndarray, np.ndarray]:
    """_flows one transfer at a time (the reference; used if two port sets ever share a hash)."""
    flow_of: dict[tuple, int] = {}
    flow_id = np.full(len(src), -1, I64)
    rep: list[int] = []
    upt_l, bounds_l, src_l = upt.tolist(), bounds.tolist(), src.tolist()
    for i in np.flatnonzero(nb > 0).tolist():
        key = (src_l[i], *upt_l[bounds_l[i]: bounds_l[i + 1]])
        f = flow_of.get(key)
        if f is None:
            f = flow_of[key] = len(rep)
            rep.append(i)
        flow_id[i] = f
    return flow_id, np.asarray(rep, I64)


def _pieces_to_chunks(p_flow, p_a, p_b, p_f0, flow_id, cyc, nb, rate):
    """Cut each piece (cycles [f0, f0 + b - a) of its flow, run at wall cycles [a, b)) at transfer boundaries."""
    live = np.flatnonzero(flow_id >= 0)
    # Transfers of each flow, end to end in transfer order: flow-relative start cycle F of each transfer.
    o = live[np.argsort(flow_id[live], kind="stable")]
    fl = flow_id[o]
    cum = np.cumsum(cyc[o])
    first = np.ones(len(o), bool)
    first[1:] = fl[1:] != fl[:-1]
    base = np.maximum.accumulate(np.where(first, cum - cyc[o], 0))
    F = cum - cyc[o] - base  # start of transfer o[k] within its flow
    # Global axis: flow f's cycles are placed at offset G[f] so that every (flow, cycle) is one number.
    nf = int(fl.max()) + 1
    flow_len = np.bincount(fl, weights=cyc[o], minlength=nf).astype(I64)
    G = np.concatenate([[0], np.cumsum(flow_len)])
    t_lo = G[fl] + F  # transfer o[k] spans [t_lo, t_lo + cyc) on the global axis
    p_lo = G[p_flow] + p_f0
    p_hi = p_lo + (p_b - p_a)
    # Each piece intersects a run of consecutive transfers (sorted by t_lo).
    k0 = np.searchsorted(t_lo, p_lo, side="right") - 1
    k1 = np.searchsorted(t_lo, p_hi - 1, side="right") - 1
    cnt = k1 - k0 + 1
    piece = np.repeat(np.arange(len(p_lo)), cnt)
    k = k0[piece] + (np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    lo = np.maximum(p_lo[piece], t_lo[k])
    hi = np.minimum(p_hi[piece], t_lo[k] + cyc[o[k]])
    tr = o[k]
    off = (lo - t_lo[k]) * rate
    end_b = np.minimum((hi - t_lo[k]) * rate, nb[tr])
    start = p_a[piece] + (lo - p_lo[piece])
    end = start + (hi - lo)
    srt = np.lexsort((off, tr, start))
    return tr[srt], off[srt], (end_b - off)[srt], start[srt], end[srt]


def _code(table: TransferTable, tt: Timetable, chip: Chip) -> dict[str, np.ndarray]:
    """Timetable fields send_code, recv_code, phase_code: tt's chunks priced on `table`, the step's own (a cached
    timetable's chunks are the same, but its renamed table's tiles and rows are not the step's)."""
    send, recv, phase = chunk_code_bytes(chip.exchange_code, table, tt.transfer, tt.offset, tt.nbytes, tt.start,
                                         chip.tiles)
    return {"send_code": send, "recv_code": recv, "phase_code": phase}

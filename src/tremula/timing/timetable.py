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
2. Earliest fit: flows are placed widest multicast first, then most-critical first (the load of the busiest port
   they use), then longest; ties broken by the ring distance receiver - sender, which makes an all-to-all a sequence
   of permutations. Each flow fills, from cycle 0, every window where its sender and all its ports are idle, split
   into pieces of at least `min_piece_cycles` (fewer pieces = less exchange code) until it is done.
   König: when that ends above the lower bound and the receive sides of the flows never partly overlap (unicast, or
   multicasts to disjoint tile sets - then each set acts as one receiver), the step is a bipartite multigraph senders
   x receiver sets and is scheduled exactly in max-degree time (`_konig`, at most KONIG_MAX_FLOWS flows); the shorter
   of the two schedules is kept. Partly overlapping multicasts (e.g. matmul operand rows and columns) stay with
   earliest fit.
   Measured: at the bound on all-to-all, reduce-scatter, gather, K/V broadcasts, matmul operand grids and random
   unicast; within 1.2x on every step of bert-base and vit-base (c600, fp16); random wide multicasts can be ~1.9x of
   the bound, which is loose there (conflicting hyperedges, not port load, set their length).
3. Pieces map back to chunks of transfers (byte offset, bytes, start, end).

The chip's fixed exchange cost is added once: chunk times are from the start of the data movement, `makespan` =
exchange_fixed_cycles + the last chunk's end (0 when nothing moves, as cost.exchange_cycles).
"""

from __future__ import annotations

import dataclasses
import hashlib
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from itertools import chain

import numpy as np

from tremula.chip import Chip
from tremula.program import TransferTable
from tremula.timing.konig import KONIG_MAX_FLOWS, konig_schedule, receiver_classes

I64 = np.int64


@dataclass
class Timetable:
    """A scheduled exchange, columnar. Chunk k moves bytes [offset[k], offset[k] + nbytes[k]) of transfer[k] (bytes of
    its rows x row_bytes pattern in row order) from its sender to all its destinations during cycles [start[k], end[k]).

    d_port[j] (aligned with the table's d_tile) is the tile whose receive port takes destination j's bytes: d_tile[j]
    itself, or a bus-group neighbour that is also a destination of the same transfer.
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
    send_instructions: np.ndarray  # int64 [tiles]
    recv_instructions: np.ndarray  # int64 [tiles]

    def __len__(self) -> int:
        return len(self.transfer)

    @property
    def ratio(self) -> float:
        """makespan / lower_bound (1.0 for an empty exchange)."""
        return self.makespan / self.lower_bound if self.lower_bound else 1.0

    def exchange_code_bytes(self, chip: Chip) -> np.ndarray:
        """Bytes of exchange code per tile: (send + receive instructions) x bytes per instruction.

        Instruction counts (an estimate [I], no public source gives exchange code sizes): per chunk, the sender runs
        one set-up instruction plus one send per row of the 2-D pattern the chunk touches; every destination tile runs
        one set-up (mux select or address) plus one per row. Bytes per instruction: the chip's
        `exchange_instruction_bytes`.
        """
        per = chip.exchange_instruction_bytes
        return (self.send_instructions + self.recv_instructions) * per


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
        within = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)
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
    key = np.unique(tr * T + np.asarray(d_port, I64))
    return key // T, key % T


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
    uk = np.unique(tr * chip.tiles + d_tile)  # a tile named twice by one transfer receives it once
    tr, d_tile = uk // chip.tiles, uk % chip.tiles
    G = chip.tiles // P + 1
    ukey, counts = np.unique(tr * G + d_tile // P, return_counts=True)
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


# ------------------------------------------------------------------------------------------------ placement


WIDE_FLOW_PORTS = 8  # above this many ports a flow's idle windows are found with NumPy instead of port by port


class _Timelines:
    """Busy intervals of every port, each a sorted list of disjoint [start, end) kept merged."""

    def __init__(self, n: int) -> None:
        self.s: list[list[int]] = [[] for _ in range(n)]
        self.e: list[list[int]] = [[] for _ in range(n)]

    def free_from(self, r: int, t: int) -> tuple[int, float]:
        """The first idle window of port r that contains or follows cycle t: (from, until)."""
        s, e = self.s[r], self.e[r]
        i = bisect_right(s, t) - 1
        if i >= 0 and e[i] > t:
            t = e[i]
        nxt = s[i + 1] if i + 1 < len(s) else float("inf")
        return t, nxt

    def book(self, r: int, a: int, b: int) -> None:
        s, e = self.s[r], self.e[r]
        i = bisect_right(s, a)
        # merge with the previous interval when touching, and with the next one
        if i > 0 and e[i - 1] == a:
            e[i - 1] = b
            if i < len(s) and s[i] == b:
                e[i - 1] = e[i]
                del s[i], e[i]
        elif i < len(s) and s[i] == b:
            s[i] = a
        else:
            s.insert(i, a)
            e.insert(i, b)


def _place_wide(tl: _Timelines, res: list[int], dur: int, min_piece: int) -> list[tuple[int, int]]:
    """_place for flows on many ports: the common idle windows are the gaps of the union of their busy intervals."""
    starts = list(chain.from_iterable(tl.s[r] for r in res))
    pieces: list[tuple[int, int]] = []
    if starts:
        s = np.array(starts, I64)
        e = np.array(list(chain.from_iterable(tl.e[r] for r in res)), I64)
        o = np.argsort(s, kind="stable")
        run = np.maximum.accumulate(e[o])
        gap_a = np.r_[0, run]
        gap_b = np.r_[s[o], run[-1] + dur]  # the last gap is open-ended: long enough for the whole flow
        keep = gap_b - gap_a >= min(min_piece, dur)
        left = dur
        for a, b in zip(gap_a[keep].tolist(), gap_b[keep].tolist()):
            length = min(b - a, left)
            if length < min(min_piece, left):
                continue
            pieces.append((a, a + length))
            left -= length
            if left == 0:
                break
    else:
        pieces.append((0, dur))
    for a, b in pieces:
        for r in res:
            tl.book(r, a, b)
    return pieces


def _place(tl: _Timelines, res: list[int], dur: int, min_piece: int) -> list[tuple[int, int]]:
    """Earliest-fit preemptive placement of `dur` cycles on all ports in `res` at once."""
    if len(res) > WIDE_FLOW_PORTS:
        return _place_wide(tl, res, dur, min_piece)
    pieces: list[tuple[int, int]] = []
    t, left = 0, dur
    while left > 0:
        need = min(min_piece, left)
        while True:
            until = float("inf")
            moved = False
            for r in res:
                a, b = tl.free_from(r, t)
                if a > t:
                    t, moved = a, True
                    break
                until = min(until, b)
            if moved:
                continue
            if until - t >= need:
                break
            t = int(until)  # window too short: skip past the port that becomes busy there
        length = int(min(until - t, left))
        for r in res:
            tl.book(r, t, t + length)
        pieces.append((t, t + length))
        left -= length
        t += length
    return pieces


_CACHE: OrderedDict[tuple, Timetable] = OrderedDict()
_CACHE_SIZE = 256


def _pattern_key(table: TransferTable, chip: Chip, min_piece_cycles: int) -> tuple:
    """What the schedule depends on: the traffic pattern (not the addresses) and the chip's exchange constants."""
    h = hashlib.blake2b(digest_size=20)
    for a in (table.src_tile, table.rows, table.row_bytes, table.dst_start, table.d_tile):
        h.update(np.ascontiguousarray(a, I64).tobytes())
        h.update(b"|")
    return (h.digest(), chip.tiles, chip.exchange_send_bytes_per_cycle_per_tile,
            chip.exchange_recv_bytes_per_cycle_per_tile, chip.tiles_per_shared_exchange_bus,
            chip.exchange_fixed_cycles, min_piece_cycles)


def schedule_exchange(table: TransferTable, chip: Chip, min_piece_cycles: int = 16) -> Timetable:
    """A cycle-precise timetable for one step's exchange (see the module docstring for the model and the method).

    Steps of identical layers move the same pattern between other addresses; their timetable is computed once
    (an LRU cache keyed by the pattern) and returned as a copy.
    """
    key = _pattern_key(table, chip, min_piece_cycles)
    hit = _CACHE.get(key)
    if hit is None:
        hit = _schedule(table, chip, min_piece_cycles)
        _CACHE[key] = hit
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return dataclasses.replace(hit, **{f.name: getattr(hit, f.name).copy() for f in dataclasses.fields(hit)
                                        if isinstance(getattr(hit, f.name), np.ndarray)})


def _schedule(table: TransferTable, chip: Chip, min_piece_cycles: int) -> Timetable:
    T = chip.tiles
    n = len(table)
    rate = stream_rate(chip)
    d_port = assign_ports(table, chip)
    zeros = np.zeros(0, I64)
    if n == 0 or int(np.sum(np.asarray(table.rows, I64) * np.asarray(table.row_bytes, I64))) == 0:
        return Timetable(zeros, zeros, zeros, zeros, zeros, d_port, 0, 0, chip.exchange_fixed_cycles,
                         np.zeros(T, I64), np.zeros(T, I64))
    cyc = transfer_cycles(table, chip)
    nb = np.asarray(table.rows, I64) * np.asarray(table.row_bytes, I64)
    src = np.asarray(table.src_tile, I64)

    # Flows: transfers with the same sender and the same set of receive ports.
    utr, upt = unique_ports(table, d_port)
    bounds = np.searchsorted(utr, np.arange(n + 1))
    upt_l = upt.tolist()
    bounds_l = bounds.tolist()
    src_l = src.tolist()
    flow_of: dict[tuple, int] = {}
    flow_id = np.empty(n, I64)
    flow_res: list[list[int]] = []
    for i in range(n):
        if nb[i] == 0:
            flow_id[i] = -1
            continue
        key = (src_l[i], *upt_l[bounds_l[i]: bounds_l[i + 1]])
        f = flow_of.get(key)
        if f is None:
            f = flow_of[key] = len(flow_res)
            flow_res.append([src_l[i]] + [T + p for p in key[1:]])
        flow_id[i] = f
    nf = len(flow_res)
    live = flow_id >= 0
    flow_dur = np.bincount(flow_id[live], weights=cyc[live], minlength=nf).astype(I64)

    # Criticality: the load of the busiest port each flow uses.
    send_load, recv_load = port_loads(table, chip, d_port, (utr, upt))
    load = np.concatenate([send_load, recv_load])
    crit = np.array([max(load[r] for r in res) for res in flow_res], I64)
    first_port = np.array([(res[1] - T if len(res) > 1 else res[0]) for res in flow_res], I64)
    flow_src = np.array([res[0] for res in flow_res], I64)
    ring = (first_port - flow_src) % T
    # Widest multicasts first (they need many ports idle at once and are hardest to fit into gaps), then by
    # criticality; measured on random mixes this beats criticality-first by ~15 % and equals it on unicast.
    n_ports = np.array([len(r) for r in flow_res], I64)
    order = np.lexsort((np.arange(nf), flow_src, ring, -flow_dur, -crit, -n_ports))

    tl = _Timelines(2 * T)
    piece_flow, piece_a, piece_b, piece_f0 = [], [], [], []  # f0: the piece's first cycle within its flow
    for f in order.tolist():
        done = 0
        for a, b in _place(tl, flow_res[f], int(flow_dur[f]), min_piece_cycles):
            piece_flow.append(f)
            piece_a.append(a)
            piece_b.append(b)
            piece_f0.append(done)
            done += b - a
    pieces = (np.array(piece_flow, I64), np.array(piece_a, I64), np.array(piece_b, I64), np.array(piece_f0, I64))

    # Where the receive sides of the flows never partly overlap (unicast, or broadcasts to disjoint tile sets), the
    # step is a bipartite graph senders x receiver sets and König's construction reaches its maximum degree exactly.
    greedy_end = int(pieces[2].max())
    lb = stream_lower_bound(table, chip)
    classes = receiver_classes(flow_res) if lb < greedy_end and len(flow_res) <= KONIG_MAX_FLOWS else None
    if classes is not None:
        u = np.array([res[0] for res in flow_res], I64)
        exact = konig_schedule(u, classes, flow_dur)
        if int(exact[2].max()) < greedy_end:
            pieces = exact

    chunks = _pieces_to_chunks(*pieces, flow_id, cyc, nb, rate)
    tr_c, off_c, nb_c, st_c, en_c = chunks
    send_i, recv_i = _instruction_counts(table, d_port, tr_c, off_c, nb_c, T)
    fixed = chip.exchange_fixed_cycles
    return Timetable(tr_c, off_c, nb_c, st_c, en_c, d_port, fixed + int(en_c.max()), fixed + lb, fixed, send_i, recv_i)


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


def _instruction_counts(table: TransferTable, d_port, tr, off, nbytes, T: int) -> tuple[np.ndarray, np.ndarray]:
    """Send / receive instruction estimate per tile (see Timetable.exchange_code_bytes)."""
    if len(tr) == 0:
        return np.zeros(T, I64), np.zeros(T, I64)
    rb = np.asarray(table.row_bytes, I64)[tr]
    rows = (off + nbytes - 1) // rb - off // rb + 1
    per_chunk = 1 + rows
    send = np.bincount(np.asarray(table.src_tile, I64)[tr], weights=per_chunk, minlength=T).astype(I64)
    ndst = np.diff(np.asarray(table.dst_start, I64))
    per_transfer_chunks = np.bincount(tr, weights=per_chunk, minlength=len(table))
    d_tr = np.repeat(np.arange(len(table)), ndst)
    recv = np.bincount(np.asarray(table.d_tile, I64), weights=per_transfer_chunks[d_tr], minlength=T).astype(I64)
    return send, recv

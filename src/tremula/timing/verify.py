"""Timetable verifier: replay a scheduled exchange by sweeping interval endpoints and name the first broken rule."""

from __future__ import annotations

import numpy as np

from tremula.errors import TremulaError
from tremula.program import TransferTable
from tremula.sorting import positions_in_runs
from tremula.target.chip import Chip
from tremula.timing.timetable import Timetable, unique_ports

I64 = np.int64


class TimetableError(TremulaError):
    """A timetable breaks a rule of the exchange model; the message names the rule, the tile and the cycle."""


def _first_overlap(key: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[int, int] | None:
    """Indices (i, j) of two intervals with the same key that overlap in time, or None (a sweep over sorted starts)."""
    if len(key) < 2:
        return None
    o = np.lexsort((end, start, key))
    k, s, e = key[o], start[o], end[o]
    same = k[1:] == k[:-1]
    # Within one key, intervals sorted by start are disjoint iff each starts at or after the running max of the ends
    # before it; the max is restarted at every key by lifting each key's segment above all earlier ones (ends >= 0).
    seg = np.cumsum(np.r_[0, ~same]).astype(I64)
    lift = seg * (int(e.max()) + 1)
    run_end = np.maximum.accumulate(e + lift) - lift
    bad = np.flatnonzero(same & (s[1:] < run_end[:-1]))
    if len(bad) == 0:
        return None
    j = int(bad[0]) + 1
    # the earlier interval that is still running at s[j]
    cand = np.flatnonzero((k[:j] == k[j]) & (e[:j] > s[j]))
    return int(o[cand[0]]), int(o[j])


def verify_timetable(table: TransferTable, timetable: Timetable, chip: Chip) -> None:
    """Raise TimetableError naming the violated constraint; return None when the timetable is valid."""
    tt = timetable
    n = len(table)
    cols = {k: np.asarray(getattr(tt, k), I64) for k in ("transfer", "offset", "nbytes", "start", "end")}
    c = len(cols["transfer"])
    if any(len(v) != c for v in cols.values()):
        raise TimetableError("malformed timetable: chunk columns have different lengths")
    tr, off, nb, st, en = (cols[k] for k in ("transfer", "offset", "nbytes", "start", "end"))
    d_tile = np.asarray(table.d_tile, I64)
    d_port = np.asarray(tt.d_port, I64)
    if len(d_port) != len(d_tile):
        raise TimetableError(f"malformed timetable: {len(d_port)} destination ports for {len(d_tile)} destinations")
    src = np.asarray(table.src_tile, I64)
    total = np.asarray(table.rows, I64) * np.asarray(table.row_bytes, I64)

    # chunk outside the transfer
    bad = np.flatnonzero((tr < 0) | (tr >= n))
    if len(bad):
        k = int(bad[0])
        raise TimetableError(f"chunk outside the transfer: chunk {k} names transfer {int(tr[k])} of {n}")
    bad = np.flatnonzero((off < 0) | (nb <= 0) | (off + nb > total[tr]))
    if len(bad):
        k = int(bad[0])
        raise TimetableError(f"chunk outside the transfer: chunk {k} covers bytes [{int(off[k])}, "
                             f"{int(off[k] + nb[k])}) of transfer {int(tr[k])}, which has {int(total[tr[k]])} bytes")

    # negative times
    bad = np.flatnonzero((st < 0) | (en <= st))
    if len(bad):
        k = int(bad[0])
        raise TimetableError(f"negative times: chunk {k} of transfer {int(tr[k])} runs [{int(st[k])}, {int(en[k])})")

    # bandwidth exceeded (sender port, then receive port)
    dur = en - st
    for side, rate in (("send", chip.exchange_send_bytes_per_cycle_per_tile),
                       ("receive", chip.exchange_recv_bytes_per_cycle_per_tile)):
        bad = np.flatnonzero(nb > dur * rate)
        if len(bad):
            k = int(bad[0])
            raise TimetableError(f"bandwidth exceeded: chunk {k} of transfer {int(tr[k])} moves {int(nb[k])} B in "
                                 f"{int(dur[k])} cycles, over the {side} port's {rate} B/cycle")

    # shared-bus rule: a destination listens through its own port or through a port of its bus group that takes the
    # same transfer for itself
    P = max(1, chip.tiles_per_shared_exchange_bus)
    d_tr = np.repeat(np.arange(n, dtype=I64), np.diff(np.asarray(table.dst_start, I64)))
    borrowed = np.flatnonzero(d_port != d_tile)
    if len(borrowed):
        j = int(borrowed[0])
        if P == 1 or np.any(d_port[borrowed] // P != d_tile[borrowed] // P):
            j = int(borrowed[0] if P == 1 else borrowed[np.argmax(d_port[borrowed] // P != d_tile[borrowed] // P)])
            raise TimetableError(f"shared-bus rule: destination tile {int(d_tile[j])} of transfer {int(d_tr[j])} "
                                 f"listens through tile {int(d_port[j])}'s port, which is not on its exchange bus "
                                 f"({P} tile(s) per bus)")
        own = set(zip(d_tr[d_port == d_tile].tolist(), d_tile[d_port == d_tile].tolist()))
        for j in borrowed.tolist():
            if (int(d_tr[j]), int(d_port[j])) not in own:
                raise TimetableError(f"shared-bus rule: destination tile {int(d_tile[j])} of transfer {int(d_tr[j])} "
                                     f"borrows tile {int(d_port[j])}'s port, but that tile does not take the same "
                                     "transfer through its own port (only shared data may use the shared bus)")

    # every byte of every transfer delivered exactly once (each chunk reaches all destinations through their ports)
    o = np.lexsort((off, tr))
    tr_o, off_o, nb_o = tr[o], off[o], nb[o]
    first = np.r_[True, tr_o[1:] != tr_o[:-1]] if c else np.zeros(0, bool)
    expect = np.where(first, 0, np.r_[0, off_o[:-1] + nb_o[:-1]]) if c else np.zeros(0, I64)
    bad = np.flatnonzero(off_o != expect)
    if len(bad):
        k = int(bad[0])
        what = "twice" if off_o[k] < expect[k] else "never"
        lo, hi = sorted((int(off_o[k]), int(expect[k])))
        raise TimetableError(f"byte not delivered exactly once: bytes [{lo}, {hi}) of transfer {int(tr_o[k])} are "
                             f"delivered {what}")
    covered = np.zeros(n, I64)
    if c:
        last = np.r_[tr_o[1:] != tr_o[:-1], True]
        covered[tr_o[last]] = off_o[last] + nb_o[last]
    bad = np.flatnonzero(covered != total)
    if len(bad):
        i = int(bad[0])
        raise TimetableError(f"byte not delivered exactly once: bytes [{int(covered[i])}, {int(total[i])}) of "
                             f"transfer {i} are never delivered")

    # sender double-booked
    hit = _first_overlap(src[tr], st, en)
    if hit:
        a, b = hit
        raise TimetableError(f"sender double-booked: tile {int(src[tr[a]])} sends transfer {int(tr[a])} during "
                             f"[{int(st[a])}, {int(en[a])}) and transfer {int(tr[b])} during "
                             f"[{int(st[b])}, {int(en[b])})")

    # receiver listening to two senders: one listen interval per (chunk, distinct receive port of its transfer)
    utr, upt = unique_ports(table, d_port)
    if len(utr) and c:
        bounds = np.searchsorted(utr, np.arange(n + 1))
        per = (bounds[1:] - bounds[:-1])[tr]
        chunk = np.repeat(np.arange(c), per)
        pos = np.repeat(bounds[:-1][tr], per) + positions_in_runs(per)
        port = upt[pos]
        hit = _first_overlap(port, st[chunk], en[chunk])
        if hit:
            a, b = chunk[hit[0]], chunk[hit[1]]
            raise TimetableError(f"receiver listening to two senders: tile {int(port[hit[0]])}'s receive port hears "
                                 f"tile {int(src[tr[a]])} (transfer {int(tr[a])}, [{int(st[a])}, {int(en[a])})) and "
                                 f"tile {int(src[tr[b]])} (transfer {int(tr[b])}, [{int(st[b])}, {int(en[b])})) "
                                 "at once")

    # makespan covers every chunk plus the fixed cost
    need = (int(en.max()) + int(tt.fixed_cycles)) if c else 0
    if int(tt.makespan) < need:
        raise TimetableError(f"makespan smaller than its chunks: makespan {int(tt.makespan)} < last chunk end "
                             f"{int(en.max()) if c else 0} + fixed {int(tt.fixed_cycles)} cycles")
    if int(tt.fixed_cycles) != chip.exchange_fixed_cycles and c:
        raise TimetableError(f"makespan smaller than its chunks: fixed cost {int(tt.fixed_cycles)} differs from the "
                             f"chip's exchange_fixed_cycles {chip.exchange_fixed_cycles}")


def replay_order(timetable: Timetable) -> np.ndarray:
    """Chunk indices in the order the chunks complete (end cycle, then start, transfer, offset): the order in which a
    simulator applies them so that it executes the exchange as scheduled."""
    tt = timetable
    return np.lexsort((np.asarray(tt.offset), np.asarray(tt.transfer), np.asarray(tt.start), np.asarray(tt.end)))


def chunk_segments(table: TransferTable, timetable: Timetable) -> tuple[np.ndarray, ...]:
    """Each chunk cut into its contiguous row pieces: (chunk, row, col, nbytes) with row/col in the transfer's
    rows x row_bytes pattern, so that piece p copies src_addr + row*src_stride + col -> d_addr + row*d_stride + col
    for every destination. Lets a simulator apply a timetable chunk by chunk in replay_order."""
    tr = np.asarray(timetable.transfer, I64)
    off = np.asarray(timetable.offset, I64)
    nb = np.asarray(timetable.nbytes, I64)
    rb = np.asarray(table.row_bytes, I64)[tr]
    r0 = off // rb
    r1 = (off + nb - 1) // rb
    cnt = r1 - r0 + 1
    chunk = np.repeat(np.arange(len(tr), dtype=I64), cnt)
    row = r0[chunk] + positions_in_runs(cnt)
    lo = np.maximum(off[chunk], row * rb[chunk])
    hi = np.minimum(off[chunk] + nb[chunk], (row + 1) * rb[chunk])
    return chunk, row, lo - row * rb[chunk], hi - lo

"""Exchanges between layouts: turn "these destination bytes need those source elements" into (multicast) transfers.

Addresses here are symbolic (buffer id + byte offset inside the buffer); `lower.py` resolves them after the memory plan.
Two generators: `gather_rects` for rectangles of the source's 2-D view (re-layouts, operand delivery: one 2-D transfer
per source-block x rectangle intersection) and `gather_elems` for an arbitrary element map (Transpose, Slice, Concat,
Patchify, broadcasts: one transfer per run of consecutive bytes). Identical source patterns become one multicast.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from tremula.plan.layout import Layout
from tremula.sorting import lex_order, positions_in_runs

I64 = np.int64
# Re-layouts that the lowerings of one graph make alike are made once: a batch search lowers each batch at several
# budgets, and the ops before the first one a budget changes lower the same each time (BERT-base fp16 b128's
# embedding sum re-lays its word embeddings from 768 column blocks into 1,472 row blocks: 1.13 M transfers, a fifth
# of each lowering). gather_rects keeps its MEMO_SIZE latest tables of at least MEMO_PIECES pieces by the content of
# their arguments; a table is never changed once made (callers concatenate and compact into new ones), so the one
# kept is handed out again, and what is derived from it (overheads' exchange code) is kept on it (SymTransfers.memo).
MEMO_PIECES = 1 << 16
MEMO_SIZE = 2
_made: OrderedDict[bytes, SymTransfers] = OrderedDict()


@dataclass
class SymTransfers:
    src_tile: np.ndarray
    src_buf: np.ndarray
    src_rel: np.ndarray
    rows: np.ndarray
    row_bytes: np.ndarray
    src_stride: np.ndarray
    dst_start: np.ndarray  # [n + 1]
    d_tile: np.ndarray
    d_buf: np.ndarray
    d_rel: np.ndarray
    d_stride: np.ndarray

    def __len__(self) -> int:
        return len(self.src_tile)

    def memo(self, key, make):
        """make(), kept on this table under `key` when the table is one gather_rects keeps (MEMO_PIECES pieces or
        more): what is derived from a table made once is derived once. A smaller table is new in every lowering, and
        what is derived from it (a tile-long array of exchange code each) would only take memory on thousands."""
        if len(self) < MEMO_PIECES:
            return make()
        kept = self.__dict__.setdefault("_memo", {})
        if key not in kept:
            kept[key] = make()
        return kept[key]

    def compact(self) -> SymTransfers:
        """The same transfers in int32 (every field is a tile, buffer id, count or in-buffer offset, all far below
        2**31): a lowered base model keeps hundreds of thousands of transfers until the Program is made."""
        def made() -> SymTransfers:
            fields = [getattr(self, k) for k in self.__dataclass_fields__]
            if any(len(a) and (a.max() >= 2**31 or a.min() < -2**31) for a in fields):
                return self
            return SymTransfers(*(a.astype(np.int32) for a in fields))

        return self.memo("compact", made)

    @staticmethod
    def concat(parts: list[SymTransfers], dtype=None) -> SymTransfers:
        """The tables one after another; with `dtype` (int64: to_program) made in it, without another copy."""
        parts = [p for p in parts if len(p)]
        if not parts:
            z = np.zeros(0, I64)
            return SymTransfers(z, z, z, z, z, z, np.zeros(1, I64), z, z, z, z)
        starts, base = [np.zeros(1, I64)], 0
        for p in parts:
            starts.append(p.dst_start[1:] + base)
            base += int(p.dst_start[-1])
        cat = lambda k: np.concatenate([getattr(p, k) for p in parts], dtype=dtype)
        return SymTransfers(cat("src_tile"), cat("src_buf"), cat("src_rel"), cat("rows"), cat("row_bytes"),
                            cat("src_stride"), np.concatenate(starts), cat("d_tile"), cat("d_buf"), cat("d_rel"),
                            cat("d_stride"))

    def traffic(self, tiles: int) -> tuple[np.ndarray, np.ndarray]:
        """Bytes sent and received per tile (a multicast is sent once, received by each destination)."""
        nbytes = self.rows * self.row_bytes
        sent = np.bincount(self.src_tile, weights=nbytes, minlength=tiles)
        per_dest = np.repeat(nbytes, np.diff(self.dst_start))
        recv = np.bincount(self.d_tile, weights=per_dest, minlength=tiles)
        return sent, recv


def make_transfers(s_tile, s_buf, s_rel, rows, row_bytes, s_stride, d_tile, d_buf, d_rel, d_stride,
                   distinct: bool = False) -> SymTransfers:
    """Pieces (one per destination) -> transfers, merging pieces with the same source pattern into one multicast.
    distinct: the caller knows no two pieces start at the same source byte (each source element goes to one
    destination: a re-layout), so none merge and each piece is a transfer, in the same order."""
    a = [np.asarray(x, I64) for x in (s_tile, s_buf, s_rel, rows, row_bytes, s_stride, d_tile, d_buf, d_rel, d_stride)]
    s_tile, s_buf, s_rel, rows, row_bytes, s_stride, d_tile, d_buf, d_rel, d_stride = np.broadcast_arrays(*a)
    keep = rows * row_bytes > 0
    if not keep.all():
        s_tile, s_buf, s_rel, rows, row_bytes, s_stride, d_tile, d_buf, d_rel, d_stride = (
            x[keep] for x in (s_tile, s_buf, s_rel, rows, row_bytes, s_stride, d_tile, d_buf, d_rel, d_stride))
    rows, row_bytes, s_stride, d_stride = rows.copy(), row_bytes.copy(), s_stride.copy(), d_stride.copy()
    # A block that is contiguous on both sides is one row of bytes.
    flat = (rows > 1) & (row_bytes == s_stride) & (row_bytes == d_stride)
    row_bytes[flat] *= rows[flat]
    rows[flat] = 1
    single = rows == 1
    s_stride[single] = row_bytes[single]
    d_stride[single] = row_bytes[single]
    n = len(s_tile)
    if n == 0:
        return SymTransfers.concat([])
    # Sort by source position (then destination, for a deterministic order); pieces with an identical source
    # pattern become one multicast: a piece starts a new transfer where a field of its pattern differs from the
    # sorted piece before it. A field equal everywhere (often the buffer, the row count, the stride) is not
    # compared, and the fields are read at the transfers' first pieces only (two thirds of the time of permuting a
    # stacked key whole, on bert-base b128's calls).
    if distinct:  # the source position alone orders them: no two share one, so the other keys never break a tie
        order = lex_order((s_rel, s_tile, s_buf))
        return SymTransfers(s_tile[order], s_buf[order], s_rel[order], rows[order], row_bytes[order],
                            s_stride[order], np.arange(n + 1, dtype=I64), d_tile[order], d_buf[order], d_rel[order],
                            d_stride[order])
    order = lex_order((d_rel, d_tile, row_bytes, s_rel, s_tile, s_buf))
    new = np.ones(n, bool)
    differs = new[1:]
    differs[:] = False
    for x in (s_tile, s_buf, s_rel, rows, row_bytes, s_stride):
        if x.min() != x.max():
            xs = x[order]
            differs |= xs[1:] != xs[:-1]
    firsts = np.flatnonzero(new)
    at = order[firsts]
    starts = np.concatenate([firsts, [n]]).astype(I64)
    return SymTransfers(s_tile[at], s_buf[at], s_rel[at], rows[at], row_bytes[at], s_stride[at], starts,
                        d_tile[order], d_buf[order], d_rel[order], d_stride[order])


def gather_rects(src: Layout, r0, r1, c0, c1, d_tile, d_buf, d_rel, d_stride, disjoint: bool = False) -> SymTransfers:
    """Copy rectangles src[r0:r1, c0:c1] (of the source's 2-D view) to (d_tile, d_buf, d_rel), row stride d_stride.
    disjoint: the caller knows no two rectangles overlap (a re-layout into blocks that partition the matrix), so no
    piece is a multicast (make_transfers' `distinct`)."""
    r0, r1, c0, c1, d_tile, d_buf, d_rel, d_stride = np.broadcast_arrays(
        *[np.asarray(x, I64) for x in (r0, r1, c0, c1, d_tile, d_buf, d_rel, d_stride)])
    ok = (r1 > r0) & (c1 > c0)
    r0, r1, c0, c1, d_tile, d_buf, d_rel, d_stride = (x[ok] for x in (r0, r1, c0, c1, d_tile, d_buf, d_rel, d_stride))
    rc, cc, isz = src.row_cuts, src.col_cuts, src.itemsize
    ra = np.searchsorted(rc, r0, side="right") - 1
    rb = np.searchsorted(rc, r1 - 1, side="right") - 1
    ca = np.searchsorted(cc, c0, side="right") - 1
    cb = np.searchsorted(cc, c1 - 1, side="right") - 1
    nr, nc = rb - ra + 1, cb - ca + 1
    npieces = nr * nc
    key = None
    if npieces.sum() >= MEMO_PIECES:
        h = hashlib.blake2b(repr((src.buf, isz, src.rows, src.cols, disjoint)).encode(), digest_size=16)
        for a in (rc, cc, src.tiles, src.rel, r0, r1, c0, c1, d_tile, d_buf, d_rel, d_stride):
            h.update(repr(a.shape).encode())
            h.update(np.ascontiguousarray(a, I64).tobytes())
        key = h.digest()
        if key in _made:
            _made.move_to_end(key)
            return _made[key]
    rect = np.repeat(np.arange(len(r0)), npieces)
    local = positions_in_runs(npieces)
    bi = ra[rect] + local // nc[rect]
    bj = ca[rect] + local % nc[rect]
    pr0 = np.maximum(r0[rect], rc[bi])
    pr1 = np.minimum(r1[rect], rc[bi + 1])
    pc0 = np.maximum(c0[rect], cc[bj])
    pc1 = np.minimum(c1[rect], cc[bj + 1])
    width = cc[bj + 1] - cc[bj]
    s_rel = src.rel[bi, bj] + ((pr0 - rc[bi]) * width + (pc0 - cc[bj])) * isz
    dr = d_rel[rect] + (pr0 - r0[rect]) * d_stride[rect] + (pc0 - c0[rect]) * isz
    made = make_transfers(src.tiles[bi, bj], src.buf, s_rel, pr1 - pr0, (pc1 - pc0) * isz, width * isz,
                          d_tile[rect], d_buf[rect], dr, d_stride[rect], distinct=disjoint)
    if key is not None:
        _made[key] = made
        while len(_made) > MEMO_SIZE:
            _made.popitem(last=False)
    return made


def gather_elems(src: Layout, src_elem: np.ndarray, d_tile, d_buf, d_rel, chunk: int = 1) -> SymTransfers:
    """Element k of the destination (at d_tile[k], d_rel[k]) gets source element src_elem[k] (flat, of the 2-D view).

    With chunk > 1 each entry stands for `chunk` consecutive elements on both sides (the caller guarantees they stay
    inside one source block). Consecutive entries that are consecutive bytes on both sides become one transfer.
    """
    src_elem = np.asarray(src_elem, I64).reshape(-1)
    n = len(src_elem)
    if n == 0:
        return SymTransfers.concat([])
    d_tile, d_buf, d_rel = (np.broadcast_to(np.asarray(x, I64), (n,)) for x in (d_tile, d_buf, d_rel))
    s_tile, s_rel = src.locate_flat(src_elem)
    isz = src.itemsize * chunk
    brk = np.ones(n, bool)
    brk[1:] = ((s_tile[1:] != s_tile[:-1]) | (d_tile[1:] != d_tile[:-1]) | (d_buf[1:] != d_buf[:-1])
               | (s_rel[1:] != s_rel[:-1] + isz) | (d_rel[1:] != d_rel[:-1] + isz))
    first = np.flatnonzero(brk)
    length = np.diff(np.concatenate([first, [n]]))
    return _runs_to_patterns(s_tile[first], src.buf, s_rel[first], length * isz, d_tile[first], d_buf[first],
                             d_rel[first])


def _runs_to_patterns(s_tile, s_buf, s_rel, nb, d_tile, d_buf, d_rel) -> SymTransfers:
    """Runs of bytes -> 2-D transfers: runs between the same two tiles, of the same length, at constant source and
    destination strides, become one transfer of several rows (e.g. the head-dim slices of a Transpose)."""
    order = lex_order((d_rel, d_buf, d_tile, s_tile))
    s_tile, s_rel, nb, d_tile, d_buf, d_rel = (x[order] for x in (s_tile, s_rel, nb, d_tile, d_buf, d_rel))
    n = len(s_tile)
    if n > 1:
        ds, dd = np.diff(s_rel), np.diff(d_rel)
        ok = ((s_tile[1:] == s_tile[:-1]) & (d_tile[1:] == d_tile[:-1]) & (d_buf[1:] == d_buf[:-1])
              & (nb[1:] == nb[:-1]) & (ds > 0) & (dd >= nb[:-1]))
        change = np.zeros(n - 1, bool)
        change[1:] = (ds[1:] != ds[:-1]) | (dd[1:] != dd[:-1])
        prev_ok = np.concatenate([[False], ok[:-1]])
        # Consecutive links in one pattern must have equal strides: a link whose stride differs from an ok
        # predecessor starts no pattern of its own and is dropped (its right run begins a new pattern).
        used = ok & ~(prev_ok & change)
    else:
        used = np.zeros(0, bool)
        ds = dd = np.zeros(0, I64)
    start = np.concatenate([[True], ~used])
    firsts = np.flatnonzero(start)
    rows = np.diff(np.concatenate([firsts, [n]]))
    link = np.minimum(firsts, max(n - 2, 0))  # the first link of each pattern (only read when rows > 1)
    s_stride = np.where(rows > 1, ds[link] if len(ds) else 0, nb[firsts])
    d_stride = np.where(rows > 1, dd[link] if len(dd) else 0, nb[firsts])
    return make_transfers(s_tile[firsts], s_buf, s_rel[firsts], rows, nb[firsts], s_stride, d_tile[firsts],
                          d_buf[firsts], d_rel[firsts], d_stride)

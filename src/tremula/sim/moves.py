"""Compiled byte moves for the functional simulator (numba, optional): rows of bytes copied between flat offsets of
tile memory (and weight blocks from a constant to their tiles), and the one-bit-per-byte written map marked and
checked, in one pass per call.

The simulator holds every tile's SRAM as bytes, so it copies every byte a Program moves: an exchange's rows to each of
their destinations, a vertex's operands into a stack and its outputs back. NumPy does each with fancy indexing: a
multicast's rows are gathered into a temporary, then scattered once per destination. Here each row goes straight from
its source to each destination with the C library's memmove (through LLVM's memmove intrinsic). The written map is
checked and marked apart, over the union of a step's ranges in address order (8 map bytes to a word): an exchange's
rows land all over the tiles, and checked row by row as they were copied every map access missed the cache. Measured
on vit-base b1 fp32 (176 exchanges, 4.3 M destination rows, 4.1 GB; one core): copying 0.57 s, and 1.38 s with the
map checked and marked row by row; the map over the unions costs about 0.4 s for the whole forward (its 5.7 GB of
reads checked, 5.1 GB of writes marked).

NumPy's path stays the fallback (no numba, or TREMULA_NO_JIT=1: numerics/jit.ENABLED); the tests run both
(tests/unit/test_sim_moves.py against slicing, tests/unit/test_sim_vectorised.py's faults, and whole models in
tests/models/test_sim_bit_identical.py). Memory and the written map are flat uint8 arrays; bit j of map byte i is
memory byte 8i + j, and a map's length is a multiple of 8 (the simulator's rows of memory are multiples of 64 bytes).
The callers keep every range inside the arrays: the kernels do not check bounds.
"""

from __future__ import annotations

import numpy as np

from tremula.numerics import jit

numba = jit.numba
if numba is not None:
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic
_NO_MAP = np.zeros(0, np.uint8)  # (the kernels' "no written map": numba takes one array type)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


def enabled() -> bool:
    """Whether the compiled moves run (read at call time: the tests switch numerics.jit.ENABLED)."""
    return jit.ENABLED


if numba is not None:

    @intrinsic
    def _move(typingctx, dst, d, src, s, n):
        """n bytes from byte s of uint8 array src to byte d of uint8 array dst: LLVM's memmove, which becomes the C
        library's (vector moves; rows that overlap stay defined). The caller keeps the ranges inside the arrays."""
        sig = types.void(dst, types.intp, src, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            da, d, sa, s, n = args
            dptr = builder.gep(context.make_array(signature.args[0])(context, builder, da).data, [d])
            sptr = builder.gep(context.make_array(signature.args[2])(context, builder, sa).data, [s])
            cgutils.raw_memmove(builder, dptr, sptr, n, 1)

        return sig, codegen

    @numba.njit(cache=True, nogil=True, inline="always")
    def _full(wmap, w64, i0, i1):
        # whether map bytes [i0, i1) are all 0xFF: bytes up to an 8-byte boundary, then whole words
        i = i0
        while i < i1 and i & 7:
            if wmap[i] != 0xFF:
                return False
            i += 1
        while i + 8 <= i1:
            if w64[i >> 3] != _ALL:
                return False
            i += 8
        while i < i1:
            if wmap[i] != 0xFF:
                return False
            i += 1
        return True

    @numba.njit(cache=True, nogil=True, inline="always")
    def _fill(wmap, w64, i0, i1):
        # map bytes [i0, i1) set to 0xFF, in whole words between the ends
        i = i0
        while i < i1 and i & 7:
            wmap[i] = 0xFF
            i += 1
        while i + 8 <= i1:
            w64[i >> 3] = _ALL
            i += 8
        while i < i1:
            wmap[i] = 0xFF
            i += 1

    @numba.njit(cache=True, nogil=True, inline="always")
    def _mark(wmap, w64, a, n):
        # set the bits of memory bytes [a, a + n)
        if n <= 0:
            return
        i0, i1 = a >> 3, (a + n - 1) >> 3
        head = np.uint8((0xFF << (a & 7)) & 0xFF)
        tail = np.uint8(0xFF >> (7 - ((a + n - 1) & 7)))
        if i0 == i1:
            wmap[i0] |= head & tail
            return
        wmap[i0] |= head
        _fill(wmap, w64, i0 + 1, i1)
        wmap[i1] |= tail

    @numba.njit(cache=True, nogil=True, inline="always")
    def _first_unset(wmap, w64, a, n):
        # the offset in [0, n) of the first memory byte of [a, a + n) whose bit is clear, or -1 when all are set
        if n <= 0:
            return -1
        i0, i1 = a >> 3, (a + n - 1) >> 3
        head = np.uint8((0xFF << (a & 7)) & 0xFF)
        tail = np.uint8(0xFF >> (7 - ((a + n - 1) & 7)))
        if i0 == i1:
            ok = (wmap[i0] & head & tail) == (head & tail)
        else:
            ok = (wmap[i0] & head) == head and (wmap[i1] & tail) == tail and _full(wmap, w64, i0 + 1, i1)
        if ok:
            return -1
        for j in range(n):  # (rare: the check is about to fail) the first clear bit, byte by byte
            b = a + j
            if not (wmap[b >> 3] >> (b & 7)) & 1:
                return j
        return -1

    @numba.njit(cache=True, nogil=True)
    def _gather(mem, starts, n, out):
        for i in range(len(starts)):
            _move(out, i * n, mem, starts[i], n)

    @numba.njit(cache=True, nogil=True)
    def _scatter(mem, wmap, starts, n, data):
        mark = len(wmap) > 0
        w64 = wmap.view(np.uint64)
        for i in range(len(starts)):
            _move(mem, starts[i], data, i * n, n)
            if mark:
                _mark(wmap, w64, starts[i], n)

    @numba.njit(cache=True, nogil=True)
    def _mark_rows(wmap, starts, lens):
        w64 = wmap.view(np.uint64)
        for i in range(len(starts)):
            _mark(wmap, w64, starts[i], lens[i])

    @numba.njit(cache=True, nogil=True)
    def _unwritten(wmap, starts, lens, bad):
        w64 = wmap.view(np.uint64)
        for i in range(len(starts)):
            j = _first_unset(wmap, w64, starts[i], lens[i])
            if j >= 0:
                bad[0], bad[1] = i, j
                return False
        return True

    @numba.njit(cache=True, nogil=True)
    def _exchange(mem, s0, s_stride, row_bytes, rows, dst_start, d0, d_stride):
        # every row of every transfer to each of its destinations (the written map is checked and marked apart, over
        # the exchange's ranges in address order: functional.Machine.exchange)
        for t in range(len(rows)):
            n = row_bytes[t]
            for r in range(rows[t]):
                s = s0[t] + r * s_stride[t]
                for k in range(dst_start[t], dst_start[t + 1]):
                    _move(mem, d0[k] + r * d_stride[k], mem, s, n)


if numba is not None:

    @numba.njit(cache=True, nogil=True, inline="always")
    def _extend(starts, lens, n, fs, fe):
        # add flat range [fs, fe) to a union built in address order (n ranges so far); the new count
        if n == 0 or fs > starts[n - 1] + lens[n - 1]:
            starts[n], lens[n] = fs, fe - fs
            return n + 1
        if fe > starts[n - 1] + lens[n - 1]:
            lens[n - 1] = fe - starts[n - 1]
        return n

    @numba.njit(cache=True, nogil=True)
    def _scan_rows(t, s, e, is_src, size, bad, s_start, s_len, d_start, d_len, counts):
        # rows (tile, start, end, is a source) sorted by tile and start: bad[0] the first destination row overlapping
        # an earlier destination on its tile, bad[1] the first row overlapping an earlier row of the other kind
        # (-1: none); the unions of the sources' and the destinations' flat ranges
        ns = nd = 0
        dmax = smax = -1
        cur = -1
        bad[0] = bad[1] = -1
        for i in range(len(t)):
            if t[i] != cur:
                cur, dmax, smax = t[i], -1, -1
            fs, fe = t[i] * size + s[i], t[i] * size + e[i]
            if is_src[i]:
                if s[i] < dmax and bad[1] < 0:
                    bad[1] = i
                smax = max(smax, e[i])
                ns = _extend(s_start, s_len, ns, fs, fe)
            else:
                if s[i] < dmax and bad[0] < 0:
                    bad[0] = i
                if s[i] < smax and bad[1] < 0:
                    bad[1] = i
                dmax = max(dmax, e[i])
                nd = _extend(d_start, d_len, nd, fs, fe)
        counts[0], counts[1] = ns, nd


if numba is not None:

    @numba.njit(cache=True, nogil=True)
    def _blocks(mem, wmap, starts, src, row_stride, r0, c0, rows, row_bytes):
        # block i: rows r0[i].. of the source (row_stride bytes apart), row_bytes from byte c0[i] of each, written
        # back to back from flat offset starts[i] (and marked in the written map)
        if row_bytes <= 16:  # narrow rows (BERT's word embedding: 768 blocks of one half a row): row by row across
            for r in range(rows):  # the blocks, so the source is read in order, a few byte stores each
                for i in range(len(starts)):
                    d, s = starts[i] + r * row_bytes, (r0[i] + r) * row_stride + c0[i]
                    for b in range(row_bytes):
                        mem[d + b] = src[s + b]
        else:  # block by block, each destination written in order
            for i in range(len(starts)):
                for r in range(rows):
                    _move(mem, starts[i] + r * row_bytes, src, (r0[i] + r) * row_stride + c0[i], row_bytes)
        if len(wmap) > 0:
            w64 = wmap.view(np.uint64)
            for i in range(len(starts)):
                _mark(wmap, w64, starts[i], rows * row_bytes)


def _i64(a) -> np.ndarray:
    return np.ascontiguousarray(a, np.int64)


def gather(mem: np.ndarray, starts: np.ndarray, nbytes: int) -> np.ndarray:
    """The rows of nbytes at flat byte offsets `starts` of mem (flat uint8), as uint8 [n, nbytes]."""
    out = np.empty(len(starts) * nbytes, np.uint8)
    _gather(mem, _i64(starts), nbytes, out)
    return out.reshape(len(starts), nbytes)


def scatter(mem: np.ndarray, wmap: np.ndarray | None, starts: np.ndarray, data: np.ndarray) -> None:
    """Rows of bytes (uint8 [n, nbytes]) written at flat byte offsets `starts` of mem, and marked in wmap (None:
    no written map)."""
    data = np.ascontiguousarray(data)
    _scatter(mem, _NO_MAP if wmap is None else wmap, _i64(starts), data.shape[1], data.reshape(-1).view(np.uint8))


def blocks(mem: np.ndarray, wmap: np.ndarray | None, starts: np.ndarray, src: np.ndarray, r0: np.ndarray,
           c0: np.ndarray, rows: int, cols: int) -> None:
    """Blocks [rows, cols] of the 2-D C-contiguous array src at its rows r0 and columns c0, each written row after row
    at flat byte offset `starts` of mem (flat uint8), and marked in wmap (None: no written map): a weight's blocks
    straight from the constant to their tiles, with no stack between. The caller keeps the blocks inside src."""
    isz = src.itemsize
    flat = src.reshape(-1).view(np.uint8)
    _blocks(mem, _NO_MAP if wmap is None else wmap, _i64(starts), flat, src.shape[1] * isz, _i64(r0),
            _i64(c0) * isz, rows, cols * isz)


def _lens(starts: np.ndarray, nbytes) -> np.ndarray:
    return _i64(np.broadcast_to(np.asarray(nbytes, np.int64), np.shape(starts)))


def mark(wmap: np.ndarray, starts: np.ndarray, nbytes) -> None:
    """Mark the rows [start, start + nbytes) written (nbytes one length, or one per row)."""
    _mark_rows(wmap, _i64(starts), _lens(starts, nbytes))


def unwritten(wmap: np.ndarray, starts: np.ndarray, nbytes) -> tuple[int, int] | None:
    """(row, byte offset) of the first unwritten byte of the first row [start, start + nbytes) that has one (nbytes
    one length, or one per row), else None."""
    bad = np.zeros(2, np.int64)
    return None if _unwritten(wmap, _i64(starts), _lens(starts, nbytes), bad) else (int(bad[0]), int(bad[1]))


def exchange(mem: np.ndarray, s0, s_stride, row_bytes, rows, dst_start, d0, d_stride) -> None:
    """Copy every row r of every transfer t (bytes s0[t] + r * s_stride[t], row_bytes[t] long; flat offsets) to
    d0[k] + r * d_stride[k] for each destination k of the transfer (dst_start[t] to dst_start[t + 1]). In check mode
    the simulator has first checked that no destination overlaps another or a source, so the order of the copies
    cannot matter, and that every source byte was written; it marks the destinations after."""
    _exchange(mem, _i64(s0), _i64(s_stride), _i64(row_bytes), _i64(rows), _i64(dst_start), _i64(d0), _i64(d_stride))


def scan_rows(t: np.ndarray, s: np.ndarray, e: np.ndarray, is_src: np.ndarray, size: int):
    """An exchange's rows (tile, start, end, is a source; sorted by tile and start, as functional._sorted_rows gives
    them) in one pass: (index of the first destination row overlapping an earlier destination on its tile, index of
    the first row overlapping an earlier row of the other kind (-1: none), (starts, lengths) of the union of the
    sources' flat ranges (tile * size + address), the same of the destinations')."""
    n = len(t)
    bad, counts = np.zeros(2, np.int64), np.zeros(2, np.int64)
    s_start, s_len, d_start, d_len = (np.empty(n, np.int64) for _ in range(4))
    _scan_rows(_i64(t), _i64(s), _i64(e), np.ascontiguousarray(is_src, np.bool_), size, bad, s_start, s_len, d_start,
               d_len, counts)
    ns, nd = int(counts[0]), int(counts[1])
    return int(bad[0]), int(bad[1]), (s_start[:ns], s_len[:ns]), (d_start[:nd], d_len[:nd])

"""Compiled byte moves for the functional simulator (numba, optional): rows of bytes copied between flat offsets of
tile memory (and weight blocks from a constant to their tiles), and the one-bit-per-byte written map marked and
checked, in one pass per call.

The simulator holds every tile's SRAM as bytes, so it copies every byte a Program moves: an exchange's rows to each of
their destinations, a vertex's operands into a stack and its outputs back. NumPy does each with fancy indexing: a
multicast's rows are gathered into a temporary, then scattered once per destination, and the written map is marked in
further passes. Here each row goes straight from its source to each destination with the C library's memmove (through
LLVM's memmove intrinsic), and its bits of the written map are checked or marked as it goes, 8 map bytes to a word.
Measured on vit-base b1 fp16 (164 exchanges, 2.1 GB to destinations; one core): 1.0-1.3 s against NumPy's 1.5-2.3 s,
and about 2.2-3.0 s against 2.4-3.5 s with the written map; the rest of the gap to memcpy's speed is cache and TLB
misses on rows scattered over the tiles (356 bytes a destination row on average there).

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
    def _mark_rows(wmap, starts, n):
        w64 = wmap.view(np.uint64)
        for i in range(len(starts)):
            _mark(wmap, w64, starts[i], n)

    @numba.njit(cache=True, nogil=True)
    def _unwritten(wmap, starts, n, bad):
        w64 = wmap.view(np.uint64)
        for i in range(len(starts)):
            j = _first_unset(wmap, w64, starts[i], n)
            if j >= 0:
                bad[0], bad[1] = i, j
                return False
        return True

    @numba.njit(cache=True, nogil=True)
    def _exchange(mem, wmap, s0, s_stride, row_bytes, rows, dst_start, d0, d_stride, bad):
        # every row of every transfer to each of its destinations; with a written map, each source row is checked
        # written before it is copied and each destination row marked
        check = len(wmap) > 0
        w64 = wmap.view(np.uint64)
        for t in range(len(rows)):
            n = row_bytes[t]
            for r in range(rows[t]):
                s = s0[t] + r * s_stride[t]
                if check:
                    j = _first_unset(wmap, w64, s, n)
                    if j >= 0:
                        bad[0] = s + j
                        return False
                for k in range(dst_start[t], dst_start[t + 1]):
                    d = d0[k] + r * d_stride[k]
                    _move(mem, d, mem, s, n)
                    if check:
                        _mark(wmap, w64, d, n)
        return True


if numba is not None:

    @numba.njit(cache=True, nogil=True)
    def _blocks(mem, wmap, starts, src, row_stride, r0, c0, rows, row_bytes):
        # block i: rows r0[i].. of the source (row_stride bytes apart), row_bytes from byte c0[i] of each, written
        # back to back from flat offset starts[i] (and marked in the written map)
        mark = len(wmap) > 0
        w64 = wmap.view(np.uint64)
        for i in range(len(starts)):
            for r in range(rows):
                _move(mem, starts[i] + r * row_bytes, src, (r0[i] + r) * row_stride + c0[i], row_bytes)
            if mark:
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


def mark(wmap: np.ndarray, starts: np.ndarray, nbytes: int) -> None:
    """Mark the rows [start, start + nbytes) written."""
    _mark_rows(wmap, _i64(starts), nbytes)


def unwritten(wmap: np.ndarray, starts: np.ndarray, nbytes: int) -> tuple[int, int] | None:
    """(row, byte offset) of the first unwritten byte of the first row [start, start + nbytes) that has one, else
    None."""
    bad = np.zeros(2, np.int64)
    return None if _unwritten(wmap, _i64(starts), nbytes, bad) else (int(bad[0]), int(bad[1]))


def exchange(mem: np.ndarray, wmap: np.ndarray | None, s0, s_stride, row_bytes, rows, dst_start, d0,
             d_stride) -> int | None:
    """Copy every row r of every transfer t (bytes s0[t] + r * s_stride[t], row_bytes[t] long; flat offsets) to
    d0[k] + r * d_stride[k] for each destination k of the transfer (dst_start[t] to dst_start[t + 1]). With a written
    map: each source row must be written (else the flat offset of its first unwritten byte is returned, and the
    exchange is left part done) and every destination row is marked. In check mode the simulator has first checked
    that no destination overlaps another or a source, so the order of the copies cannot matter."""
    bad = np.zeros(1, np.int64)
    ok = _exchange(mem, _NO_MAP if wmap is None else wmap, _i64(s0), _i64(s_stride), _i64(row_bytes),
                   _i64(rows), _i64(dst_start), _i64(d0), _i64(d_stride), bad)
    return None if ok else int(bad[0])

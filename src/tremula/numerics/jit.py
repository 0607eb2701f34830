"""Compiled kernels (numba, optional): the simulator's per-element arithmetic in one pass instead of NumPy's many.

NumPy rounds a float32 array to half values in seven whole-array passes (amp.saturate_round_half), and the
half-partials matmul does that after every 16 input channels, so the simulator's fp16 and FP8 matmuls spent most of
their time there; NumPy's own float16 casts run an element at a time; the float32 erf/Gelu interpolation is some thirty
float64 passes. These kernels do the same operations on each element in registers, in the same order, so they give
the same bits (tests run both paths: tests/unit/test_half_partials.py, test_erf.py and a whole simulated model in
tests/models/test_sim_bit_identical.py): no fast-math, so the compiler neither reassociates nor fuses a multiply and
an add. Kernels: the half rounding, alone and after an add (`round_half`, `add_round_half`), half <-> float32
(`from_half`, `to_half`, `cast_half`), an FP8 round trip (`fp8_round_trip`), the erf interpolation (`erf_block`).

numba is an optional dependency (`pip install tremula[fast]`): without it, or with TREMULA_NO_JIT=1 in the
environment, ENABLED is False and the callers run their NumPy passes. Kernels are compiled on first use and cached
on disk (numba's cache=True), so a machine pays the compile once.
"""

from __future__ import annotations

import math
import os

import numpy as np

try:  # (numba is an extra; ImportError covers its absence, the rest a numba that does not fit this NumPy)
    import numba
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic
except Exception:  # pragma: no cover - depends on the installation
    numba = None

ENABLED = numba is not None and not os.environ.get("TREMULA_NO_JIT")

_EXP, _SIGN = np.uint32(0x7F800000), np.uint32(0x80000000)
_LO, _HI = np.float32(2.0**-14), np.float32(2.0**15)  # as amp._BINADES
_MAGIC = np.float32(1.5 * 2.0**13)
_MAX, _NMAX = np.float32(65504.0), np.float32(-65504.0)

if numba is not None:

    def _bitcast(result, arg, llvm_type, doc: str):
        """A numba intrinsic reinterpreting an `arg` value's bits as a `result` (a register move, not a conversion)."""
        def cast(typingctx, x):
            def codegen(context, builder, sig, args):
                return builder.bitcast(args[0], llvm_type)
            return result(arg), codegen
        cast.__doc__ = doc
        return intrinsic(cast)

    _bits = _bitcast(types.uint32, types.float32, ir.IntType(32), "A float32's bits as uint32.")
    _float = _bitcast(types.float32, types.uint32, ir.FloatType(), "uint32 bits as the float32 they encode.")
    _bits64 = _bitcast(types.uint64, types.float64, ir.IntType(64), "A float64's bits as uint64.")
    _float64 = _bitcast(types.float64, types.uint64, ir.DoubleType(), "uint64 bits as the float64 they encode.")

    @numba.njit(cache=True, nogil=True, inline="always")
    def _to_grid(v, lo, hi, magic):
        """float32 v rounded to nearest even on a grid of floating-point values: add and subtract its binade (clamped
        to lo..hi) times `magic` (1.5 x 2**(23 - mantissa bits)), which leaves the grid's spacing as the float32 ulp
        of the sum."""
        m = _float(_bits(v) & _EXP)
        m = lo if m < lo else m
        m = hi if m > hi else m
        m = m * magic
        return (v + m) - m

    @numba.njit(cache=True, nogil=True, inline="always")
    def _round_half(v):
        """amp.saturate_round_half of one float32: the same operations, so the same bits (NaN stays NaN: its
        comparisons are false, as in NumPy's clip)."""
        a = _to_grid(v, _LO, _HI, _MAGIC)
        a = _MAX if a > _MAX else a
        a = _NMAX if a < _NMAX else a
        return _float(_bits(a) | (_bits(v) & _SIGN))

    @numba.njit(cache=True, nogil=True)
    def _round_rows(v):
        for i in range(v.size):
            v[i] = _round_half(v[i])

    @numba.njit(cache=True, nogil=True)
    def _add_round_rows(acc, p, scale):
        # acc [rows, n] += p [rows, n] * scale [rows], each sum rounded to half (a multiply by 1 is exact)
        for r in range(acc.shape[0]):
            s = scale[r]
            for i in range(acc.shape[1]):
                acc[r, i] = _round_half(acc[r, i] + p[r, i] * s)


if numba is not None:

    @numba.njit(cache=True, nogil=True)
    def _sum_parts_rows(own, recv, mine, s):
        # s[v] = the parts of vertex v in part order, own[v] at index mine[v] and recv[v] around it, each add rounded
        # to half: part 0 as it is, then s = round(s + part q) (add_round_half's formula, a multiply by 1 is exact)
        n_parts = recv.shape[1] + 1
        for v in range(own.shape[0]):
            me = mine[v]
            first = own[v] if me == 0 else recv[v, 0]
            for e in range(own.shape[1]):
                s[v, e] = first[e]
            for q in range(1, n_parts):
                part = own[v] if q == me else recv[v, q - 1 if q > me else q]
                for e in range(own.shape[1]):
                    s[v, e] = _round_half(s[v, e] + part[e] * np.float32(1.0))


def sum_half_parts(own: np.ndarray, recv: np.ndarray, mine: np.ndarray) -> np.ndarray | None:
    """Each vertex's split-K parts summed in part order with every add rounded to half (codelets/matmul.py
    reduce_partials): own [n, ...] float32 (its own part, index mine[v] of the parts), recv [n, parts - 1, ...]
    float32 (the others in part order); the sums [n, ...] float32, or None when the kernel cannot take them."""
    if not ENABLED or own.dtype != np.float32 or recv.dtype != np.float32 or len(recv) != len(own):
        return None
    n = len(own)
    o2 = np.ascontiguousarray(own).reshape(n, -1)
    r3 = np.ascontiguousarray(recv).reshape(n, recv.shape[1], -1)
    if r3.shape[2] != o2.shape[1]:
        return None
    s = np.empty_like(o2)
    _sum_parts_rows(o2, r3, np.ascontiguousarray(mine, np.int64), s)
    return s.reshape(own.shape)


def _flat32(a: np.ndarray) -> bool:
    return a.dtype == np.float32 and a.flags.c_contiguous


def round_half(v: np.ndarray) -> bool:
    """saturate_round_half(v) in place in one pass; False (nothing done) when the kernel cannot take v."""
    if not ENABLED or not _flat32(v):
        return False
    _round_rows(v.reshape(-1))
    return True


def row_scale(acc: np.ndarray, scale=None) -> np.ndarray | None:
    """add_round_half's scale as float32, one per entry of acc's first axis (scale None, one number or one per
    entry), to pass to it for every group of a block (no array made per call); None when the kernel cannot take
    them."""
    if not ENABLED or acc.ndim == 0:
        return None
    rows = len(acc)
    if scale is None or np.ndim(scale) == 0:
        if scale is not None and np.float32(scale) != scale:  # (the NumPy path multiplies in scale's type)
            return None
        return np.full(rows, 1.0 if scale is None else scale, np.float32)
    s = np.asarray(scale, np.float32)
    if s.size != rows or np.asarray(scale).dtype != np.float32:
        return None
    return s.reshape(rows)


def add_round_half(acc: np.ndarray, p: np.ndarray, scale=None, rows_scale: np.ndarray | None = None) -> bool:
    """acc = saturate_round_half(acc + p * scale) in place in one pass, scale None, one number, or one per entry of
    acc's first axis (broadcasting over the rest), or `rows_scale` (row_scale's) in its place; False (nothing done)
    when the kernel cannot take the arrays."""
    if not ENABLED or not _flat32(acc) or not _flat32(p) or acc.shape != p.shape or acc.ndim == 0:
        return False
    s = row_scale(acc, scale) if rows_scale is None else rows_scale
    if s is None:
        return False
    rows = len(acc)
    _add_round_rows(acc.reshape(rows, -1), p.reshape(rows, -1), s)
    return True


if numba is not None:

    @numba.njit(cache=True, nogil=True)
    def _from_half_bits(h, f):
        # amp.from_half's integer passes on each element: sign-extend, shift into float32's fields, rebias; False when
        # h holds an inf or NaN (they come out finite, from 2**16 up), which the caller leaves to NumPy's cast
        special = 0  # (an integer OR of every element's flag, not a branch: the loop stays SIMD)
        for i in range(h.size):
            b = np.int32(h[i])
            f[i] = _float(np.uint32((b << 13) & np.int32(-0x70002000))) * np.float32(2.0**112)
            special |= ((b & 0x7C00) + 0x400) >> 15  # 1 when the exponent is all ones: inf or NaN
        return special == 0

    @numba.njit(cache=True, nogil=True)
    def _to_half_bits(v, out):
        # amp.to_half's passes on each element: v / 2**112 holds the half's exponent and mantissa in bits >> 13
        for i in range(v.size):
            t = _bits(v[i] * np.float32(2.0**-112))
            out[i] = np.uint16(((t >> 13) & 0x7FFF) | ((t >> 16) & 0x8000))


if numba is not None:

    @numba.njit(cache=True, nogil=True, inline="always")
    def _half_value(x):
        """float32 -> the half NumPy's cast gives, as a float32 (exact): _round_half's rounding without its
        saturation (a result past 65504 is an overflow: inf), the sign of x kept (-0 included)."""
        a = _to_grid(x, _LO, _HI, _MAGIC)
        a = np.float32(np.inf) if a > _MAX else a
        a = np.float32(-np.inf) if a < _NMAX else a
        return _float(_bits(a) | (_bits(x) & _SIGN))

    @numba.njit(cache=True, nogil=True, inline="always")
    def _half_bits(x):
        """float32 -> its float16 bits as NumPy's cast: _half_value, then _to_half_bits' shifts."""
        t = _bits(_half_value(x) * np.float32(2.0**-112))
        return np.uint16(((t >> 13) & 0x7FFF) | ((t >> 16) & 0x8000))

    @numba.njit(cache=True, nogil=True)
    def _cast_half_bits(v, out):
        for i in range(v.size):
            out[i] = _half_bits(v[i])

    @numba.njit(cache=True, nogil=True)
    def _fp8_round_trip(v, down, lo, hi, magic, top, nan, up, out):
        # half(v * down) rounded to the FP8 grid as _half_value rounds to half's (lo..hi the format's binades),
        # saturated at `top`, no -0 (the fnuz formats have none), NaN to the NaN code's value; then times `up`.
        # Branch-free: it vectorises, where table lookups run an element at a time.
        for i in range(v.size):
            a = _half_value(v[i] * down)
            b = _to_grid(abs(a), lo, hi, magic)
            b = top if b > top else b
            r = _float(_bits(b) | (_bits(a) & _SIGN)) if b != 0 else np.float32(0.0)
            r = nan if a != a else r
            out[i] = r * up


def cast_half(v: np.ndarray, out: np.ndarray) -> bool:
    """out[...] = v.astype(np.float16) in one pass (float32 v of out's shape, out C-contiguous float16): NumPy's
    bits, round to nearest even, inf past half's range (a signalling NaN comes out quiet); False when the kernel
    cannot take them."""
    if not ENABLED or v.dtype != np.float32 or out.dtype != np.float16 or not out.flags.c_contiguous \
            or v.shape != out.shape:
        return False
    _cast_half_bits(np.ascontiguousarray(v).reshape(-1), out.view(np.uint16).reshape(-1))
    return True


def fp8_round_trip(v: np.ndarray, down: float, mantissa: int, min_binade: float, max_binade: float, top: float,
                   nan: np.float32, up: float) -> np.ndarray | None:
    """FP8 quantize then dequantize of float32 v in one pass (numerics/fp8.fake_quantize): v * down cast to half as
    NumPy does, rounded to nearest even on the grid of `mantissa` bits over binades min_binade..max_binade,
    saturated at +-top, a NaN to `nan`, times `up`; None when the kernel cannot take v. NumPy's way is five passes
    and four temporaries, two of them table lookups."""
    if not ENABLED or v.dtype != np.float32:
        return None
    out = np.empty(v.shape, np.float32)
    _fp8_round_trip(np.ascontiguousarray(v).reshape(-1), np.float32(down), np.float32(min_binade),
                    np.float32(max_binade), np.float32(1.5 * 2.0 ** (23 - mantissa)), np.float32(top),
                    np.float32(nan), np.float32(up), out.reshape(-1))
    return out


def from_half(h: np.ndarray) -> np.ndarray | None:
    """amp.from_half in one pass: float16 -> float32, or None when the kernel cannot take h (or h holds inf/NaN)."""
    if not ENABLED or h.dtype != np.float16:
        return None
    f = np.empty(h.shape, np.float32)
    if not _from_half_bits(np.ascontiguousarray(h).view(np.int16).reshape(-1), f.reshape(-1)):
        return None
    return f


def to_half(v: np.ndarray, out: np.ndarray) -> bool:
    """amp.to_half into `out` (float16, C-contiguous, v's shape) in one pass; False when the kernel cannot take them."""
    if not ENABLED or v.dtype != np.float32 or out.dtype != np.float16 or not out.flags.c_contiguous \
            or v.shape != out.shape:
        return False
    _to_half_bits(np.ascontiguousarray(v).reshape(-1), out.view(np.uint16).reshape(-1))
    return True


if numba is not None:

    _ERF_CHUNK = 1024  # elements a chunk: its float64 results and tolerances stay in L1

    @numba.njit(cache=True, nogil=True, error_model="numpy")  # (no ZeroDivisionError branch per division)
    def _erf_block(x, gelu, nodes_f, nodes_d, step, limit, err, out, unsure):
        """erf.py's _erf_block on each float32 element (the same float64 formula): the float32 result, and 1 in
        `unsure` where the error bound cannot place it on one side of a float32 rounding boundary (the caller takes
        the reference there). The boundaries are the float32 neighbours by bits. Two loops a chunk, the
        interpolation (its results and tolerances kept in float64) and then the bound: the same operations, in one
        loop they ran 2.5-3 times slower (31 against 11 ns an element on the VM this was measured on)."""
        last = len(nodes_f) - 2
        n = x.size
        ys = np.empty(_ERF_CHUNK, np.float64)
        tols = np.empty(_ERF_CHUNK, np.float64)  # the bound's part from the formula; -1 outside the table
        for c0 in range(0, n, _ERF_CHUNK):
            c1 = min(n, c0 + _ERF_CHUNK)
            for k in range(c0, c1):
                x64 = np.float64(x[k])
                z = x64 / math.sqrt(2.0) if gelu else x64
                inside = abs(z) < limit
                zz = z if inside else 0.0
                u = abs(zz) / step
                i = min(np.int64(u), last)
                t = u - i
                t2 = t * t
                t3 = t2 * t
                p = ((2 * t3 - 3 * t2 + 1) * nodes_f[i] + (t3 - 2 * t2 + t) * nodes_d[i] + (3 * t2 - 2 * t3)
                     * nodes_f[i + 1] + (t3 - t2) * nodes_d[i + 1])
                e = math.copysign(p, zz)
                y = 0.5 * x64 * (1.0 + e) if gelu else e
                ys[k - c0] = y
                tols[k - c0] = (0.5 * abs(x64) * (err + 4.5e-16) if gelu else err) if inside else -1.0
                out[k] = np.float32(y)
            for k in range(c0, c1):
                y = ys[k - c0]
                ay = abs(y)
                spacing = _float64(_bits64(ay) + np.uint64(1)) - ay  # (np.spacing for finite ay; inf is unsure below)
                tol = tols[k - c0] + 4 * spacing
                # By magnitude, without a branch (twice as fast as choosing the neighbour by sign): |y| must lie more
                # than tol inside the halfway points to the float32 neighbours towards and away from zero. Outside
                # the table, inf, NaN and zero go to the reference.
                b = _bits(out[k])
                mag = b & np.uint32(0x7FFFFFFF)
                m64 = np.float64(_float(mag))
                d = ay - m64
                half_up = (np.float64(_float(mag + np.uint32(1))) - m64) * 0.5
                half_down = (m64 - np.float64(_float(mag - np.uint32(1)))) * 0.5
                sure = (tols[k - c0] >= 0) & ((b & _EXP) != _EXP) & (mag != 0) & (d + half_down > tol) \
                    & (half_up - d > tol)
                unsure[k] = np.uint8(1 - sure)


def erf_block(x: np.ndarray, gelu: bool, nodes_f, nodes_d, step: float, limit: float, err: float):
    """(float32 results, mask of the elements to take from the reference) of erf.py's interpolation, one pass; None
    when the kernel cannot take x."""
    if not ENABLED or x.dtype != np.float32:
        return None
    flat = np.ascontiguousarray(x).reshape(-1)
    out, unsure = np.empty(flat.shape, np.float32), np.empty(flat.shape, np.uint8)
    _erf_block(flat, gelu, nodes_f, nodes_d, step, limit, err, out, unsure)
    return out.reshape(x.shape), unsure.view(bool).reshape(x.shape)


if numba is not None:

    @numba.njit(cache=True, nogil=True)
    def _lookup(table, idx, out):
        for i in range(idx.size):
            out[i] = table[idx[i]]


def lookup(table: np.ndarray, idx: np.ndarray) -> np.ndarray | None:
    """table[idx] (a 1-D table, uint8 or uint16 indices that it covers) in one pass: np.take converts every index to
    a 64-bit one first, and the FP8 codes and half bit patterns it decodes are 1 or 2 bytes; None when the kernel cannot
    take them."""
    if not ENABLED or table.ndim != 1 or idx.dtype not in (np.uint8, np.uint16) or len(table) < 1 << 8 * idx.itemsize:
        return None
    out = np.empty(idx.shape, table.dtype)
    _lookup(table, np.ascontiguousarray(idx).reshape(-1), out.reshape(-1))
    return out

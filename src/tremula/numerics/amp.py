"""The AMP's half partials: a matmul whose running sums are rounded to half after every group of input channels.

With half partials (poplibs' partialsType half: ConvPartial1x1Out<half, half, ...>, the path PopRT's SigLIP profile
runs its fp16 matmuls on; ../shared/reference/ipu-stack-facts.md section 4.3) the AMP sums one group of input channels
(its weights per conv unit: 16 for half) in its float accumulators and adds that into the output's half partial,
which is written back as half. So the running sum is rounded to half after every group of k, and it saturates at
half's largest finite value as the hardware's conversions do. Modelled as: partial = half(partial + group sum), the
group sum a float32 BLAS product of the group's columns (the order inside a group is BLAS's, as for float partials:
how the AMP's adder orders them is not published).

BLAS's order can differ between the simulator's blocks and the reference's whole tensors (on some CPUs the two shapes
take kernels that add in different orders: OpenBLAS's Haswell kernels on an AMD EPYC put bert-tiny's leftover
attention heads one half ulp from the reference, where its SkylakeX kernels agreed), so the matched check allows for
it. EXACT_GROUP_SUMS makes each group sum the exact sum of its products rounded once to float32, the same bits on
every CPU: computed in float64, where the products of halves (11 bits of mantissa each) or FP8 codes are exact, and so
is the sum of a group of them unless their exponents spread over more than float64's 53 bits less the products' 22.
It costs BLAS's speed (vit-base fp16 batch 1: 3.5-3.9 -> 5.9-6.1 s simulated), so it is for the tests that compare
the simulator with the reference bit for bit.
"""

from __future__ import annotations

import numpy as np

from tremula.numerics import jit

F16_MAX = float(np.finfo(np.float16).max)
AMP_BLOCK = 1 << 16  # accumulator elements per block of rows: its running sum and products stay in the L2 cache
EXACT_GROUP_SUMS = False  # see above: read at each call (tests set it)


_EXP, _SIGN = np.uint32(0x7F800000), np.uint32(0x80000000)
_BINADES = np.float32(2.0**-14), np.float32(2.0**15)  # the half binades: subnormals' quantum at the bottom, 65504's
_MAGIC = np.float32(1.5 * 2.0**13)


def saturate_round_half(v: np.ndarray, a: np.ndarray | None = None, m: np.ndarray | None = None) -> np.ndarray:
    """float32 values (or NaN) clipped to half's finite range and rounded to the nearest half value, ties to even,
    kept in float32, in place: adding M = 1.5 x 2**13 x the value's binade (clamped to 2**-14.. 2**15, half's
    subnormal range at the bottom) rounds it to a multiple of M's float32 ulp, which is the half quantum there (the
    1.5 keeps v + M in M's binade for either sign, so no abs / copysign pass); subtracting M back is exact. That gives
    +0 for a negative value rounding to zero, so v's sign bit is ORed back in (a no-op for every other result). `a`
    and `m` are scratch arrays of v's shape (made when not given: a loop passes its own, so no pass allocates). The
    same bits as abs / min / binade / add / sub / copysign (NumPy's copysign is not SIMD: 6x an add) for all 2**32
    float32 patterns. The simulator's quarter and half-partials matmuls, their split-K sums and the reference all
    round with this (numerics/jit.py does it in one pass when numba is installed)."""
    if jit.round_half(v):
        return v
    a = np.empty_like(v) if a is None else a
    m = np.empty_like(v) if m is None else m
    vb, ab, mb = v.view(np.uint32), a.view(np.uint32), m.view(np.uint32)
    np.bitwise_and(vb, _EXP, out=mb)  # 2**exponent (0 for zero, inf for inf and NaN)
    np.clip(m, *_BINADES, out=m)
    m *= _MAGIC
    np.add(v, m, out=a)
    a -= m
    np.clip(a, -np.float32(F16_MAX), np.float32(F16_MAX), out=a)  # partials saturate (NaN stays NaN)
    np.bitwise_and(vb, _SIGN, out=mb)
    np.bitwise_or(ab, mb, out=vb)
    return v


def half_partial_sums(x: np.ndarray, w: np.ndarray, group: int, scale=None, matmul=None,
                      init: np.ndarray | None = None) -> np.ndarray:
    """[.., m, k] @ [.., k, n] (float32 operands) -> float32 holding the half partials: the sum of each `group` of k
    (times `scale`, when given: the FP8 path's power of two, one per stack entry or one in all) added into the running
    half partial, clipped and rounded to half after every group. Rows of x (or entries of a stack) run in blocks whose
    sums stay in cache across the groups; every element is its own sum, so blocking changes no bit. `matmul` sums a
    group's products (None or np.matmul: float32 BLAS, or exactly with EXACT_GROUP_SUMS; the matched reference passes
    other legal orders of the float32 sums). `init`: the half
    partials to continue (a later K round of the same sums: with whole groups before it, the same bits as one call
    over all of K), else +0."""
    out = np.zeros(np.broadcast_shapes(x.shape[:-2], w.shape[:-2]) + (x.shape[-2], w.shape[-1]), np.float32)
    if init is not None:
        out[...] = init
    if w.ndim == 2:  # one weight matrix: blocks of x's rows
        x2, o2 = x.reshape(-1, x.shape[-1]), out.reshape(-1, w.shape[-1])
        per = max(1, AMP_BLOCK // max(1, w.shape[-1]))
        blocks = [(x2[r: r + per], w, o2[r: r + per], scale) for r in range(0, len(x2), per)]
    elif x.ndim == 3 and w.ndim == 3 and len(x) == len(w) == len(out):  # a stack of vertices: blocks of entries
        per = max(1, AMP_BLOCK // max(1, x.shape[-2] * w.shape[-1]))
        sc = scale if scale is None or np.ndim(scale) == 0 else np.asarray(scale)
        blocks = [(x[r: r + per], w[r: r + per], out[r: r + per], sc if sc is None or np.ndim(sc) == 0 else
                   sc[r: r + per]) for r in range(0, len(x), per)]
    else:
        blocks = [(x, w, out, scale)]
    own = matmul is None or matmul is np.matmul  # the codelets' own group sums, however the caller names them
    for xb, wb, ob, sb in blocks:
        a, m = np.empty_like(ob), np.empty_like(ob)  # scratch, reused by every group of the block
        part = np.empty_like(ob)  # each group's sums (matmul's out: no allocation per group)
        rs = jit.row_scale(ob, sb)  # (the compiled add's scale per row: made once a block, not once a group)
        exact = own and EXACT_GROUP_SUMS
        if exact:  # the block's operands in float64 once, a float64 out per group
            xw, ww, wide = xb.astype(np.float64), wb.astype(np.float64), np.empty(ob.shape, np.float64)
        for k0 in range(0, x.shape[-1], group):
            if exact:
                np.matmul(xw[..., k0: k0 + group], ww[..., k0: k0 + group, :], out=wide)
                p = part
                p[...] = wide  # (rounded once to float32)
            elif own:
                p = np.matmul(xb[..., k0: k0 + group], wb[..., k0: k0 + group, :], out=part)
            else:
                p = matmul(xb[..., k0: k0 + group], wb[..., k0: k0 + group, :])
            if rs is not None and jit.add_round_half(ob, p, rows_scale=rs):  # (one pass; else NumPy's passes)
                continue
            if sb is not None:
                p *= sb
            ob += p
            saturate_round_half(ob, a, m)
    return out


_REBIAS = np.float32(2.0**112)  # float32's exponent bias less half's: a half's bits << 13 are its value / 2**112


def from_half(h: np.ndarray) -> np.ndarray:
    """float16 -> float32, exact, as h.astype(np.float32) but in a few SIMD passes (NumPy's half casts run one element
    at a time) over cache-sized chunks: the half's bits, sign-extended and shifted into float32's fields, are its value
    / 2**112 (half subnormals land on float32 subnormals), and the multiply by 2**112 is exact. inf and NaN, which
    would come out finite (from 2**16 up), take NumPy's cast. (numerics/jit.py: one pass.)"""
    f = jit.from_half(h)
    if f is not None:
        return f
    f = np.empty(h.shape, np.float32)
    hi, fi = np.ascontiguousarray(h).view(np.int16).reshape(-1), f.view(np.int32).reshape(-1)
    for c in range(0, hi.size, AMP_BLOCK):
        ic = fi[c: c + AMP_BLOCK]
        ic[...] = hi[c: c + AMP_BLOCK]
        ic <<= 13
        ic &= np.int32(-0x70002000)  # 0x8FFFE000: the sign and the half's exponent and mantissa, not sign copies
        fc = ic.view(np.float32)
        fc *= _REBIAS
        if not (float(fc.max()) < 65536 and float(fc.min()) > -65536):
            return h.astype(np.float32)
    return f


def to_half(v: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 half values or quiet NaNs (what saturate_round_half leaves) -> float16 (into `out` when given), the bits
    v.astype(np.float16) gives them, in a few SIMD passes over cache-sized chunks: v / 2**112 (exact) has the half's
    exponent and mantissa in its bits >> 13; the sign moves from bit 18 to 15. (A signalling NaN would come out
    quiet.) (numerics/jit.py: one pass.)"""
    res = np.empty(v.shape, np.float16) if out is None or not out.flags.c_contiguous else out
    if jit.to_half(v, res):
        if out is not None and res is not out:
            out[...] = res
        return res if out is None else out
    vf, ru = np.ascontiguousarray(v, np.float32).reshape(-1), res.view(np.uint16).reshape(-1)
    t = np.empty(min(vf.size, AMP_BLOCK), np.float32)
    tu, s = t.view(np.uint32), np.empty(len(t), np.uint32)
    for c in range(0, vf.size, AMP_BLOCK):
        vc = vf[c: c + AMP_BLOCK]
        k = len(vc)
        np.multiply(vc, np.float32(1 / _REBIAS), out=t[:k])
        tu[:k] >>= np.uint32(13)
        np.right_shift(tu[:k], np.uint32(3), out=s[:k])
        s[:k] &= np.uint32(0x8000)
        tu[:k] &= np.uint32(0x7FFF)
        tu[:k] |= s[:k]
        ru[c: c + k] = tu[:k]
    if out is not None and res is not out:
        out[...] = res
    return res if out is None else out


def as_half(v: np.ndarray) -> np.ndarray:
    """v.astype(np.float16), in one pass for float32 (numerics/jit.py) when numba is installed."""
    v = np.asarray(v)
    out = np.empty(v.shape, np.float16)
    return out if jit.cast_half(v, out) else v.astype(np.float16)


def store(out: np.ndarray, y: np.ndarray) -> None:
    """out[...] = y in out's dtype: a float32 result into a half buffer in one pass (numerics/jit.py) when it can."""
    y = np.asarray(y)
    if not (out.dtype == np.float16 and jit.cast_half(y, out)):
        out[...] = y.astype(out.dtype, copy=False)


def half_partials_matmul(x: np.ndarray, w: np.ndarray, group: int) -> np.ndarray:
    """x @ w of half values on the AMP with half partials (groups of `group` input channels): float16."""
    return to_half(half_partial_sums(widen(x), widen(w), group))


def widen(a: np.ndarray) -> np.ndarray:
    """An array as float32: half through from_half, float32 as it is, others cast."""
    a = np.asarray(a)
    return from_half(a) if a.dtype == np.float16 else a.astype(np.float32, copy=False)

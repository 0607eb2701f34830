"""The AMP's half partials: a matmul whose running sums are rounded to half after every group of input channels.

With half partials (poplibs' partialsType half: ConvPartial1x1Out<half, half, ...>, the path PopRT's SigLIP profile
runs its fp16 matmuls on; ../shared/reference/ipu-stack-facts.md section 4.3) the AMP sums one group of input channels
(its weights per conv unit: 16 for half) in its float accumulators and adds that into the output's half partial,
which is written back as half. So the running sum is rounded to half after every group of k, and it saturates at
half's largest finite value as the hardware's conversions do. Modelled as: partial = half(partial + group sum), the
group sum a float32 BLAS product of the group's columns (the order inside a group is BLAS's, as for float partials).
"""

from __future__ import annotations

import numpy as np

F16_MAX = float(np.finfo(np.float16).max)
AMP_BLOCK = 1 << 16  # accumulator elements per block of rows: its running sum and products stay in the L2 cache


def saturate_round_half(v: np.ndarray, a: np.ndarray | None = None, m: np.ndarray | None = None) -> np.ndarray:
    """float32 values (or NaN) clipped to half's finite range and rounded to the nearest half value, ties to even,
    kept in float32, in place: adding M = 2**13 x the value's binade (at least 2**-14, the half subnormal range)
    rounds it to a multiple of M's float32 ulp, which is the half quantum there; subtracting M back is exact. `a` and
    `m` are scratch arrays of v's shape (made when not given: a loop passes its own, so no pass allocates). The
    simulator's quarter and half-partials matmuls, their split-K sums and the reference all round with this."""
    a = np.empty_like(v) if a is None else a
    m = np.empty_like(v) if m is None else m
    np.abs(v, out=a)
    np.minimum(a, np.float32(F16_MAX), out=a)  # partials saturate (NaN stays NaN)
    np.bitwise_and(a.view(np.uint32), np.uint32(0x7F800000), out=m.view(np.uint32))  # 2**exponent (0 for zero)
    np.maximum(m, np.float32(2.0**-14), out=m)
    m *= np.float32(2.0**13)
    a += m
    a -= m
    return np.copysign(a, v, out=v)


def half_partial_sums(x: np.ndarray, w: np.ndarray, group: int, scale=None, matmul=np.matmul) -> np.ndarray:
    """[.., m, k] @ [.., k, n] (float32 operands) -> float32 holding the half partials: the sum of each `group` of k
    (times `scale`, when given: the FP8 path's power of two, one per stack entry or one in all) added into the running
    half partial, clipped and rounded to half after every group. Rows of x (or entries of a stack) run in blocks whose
    sums stay in cache across the groups; every element is its own sum, so blocking changes no bit. `matmul` sums a
    group's products (the matched reference passes other legal orders of the float32 sums)."""
    out = np.zeros(np.broadcast_shapes(x.shape[:-2], w.shape[:-2]) + (x.shape[-2], w.shape[-1]), np.float32)
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
    for xb, wb, ob, sb in blocks:
        a, m = np.empty_like(ob), np.empty_like(ob)  # scratch, reused by every group of the block
        for k0 in range(0, x.shape[-1], group):
            part = matmul(xb[..., k0: k0 + group], wb[..., k0: k0 + group, :])
            if sb is not None:
                part *= sb
            ob += part
            saturate_round_half(ob, a, m)
    return out


def half_partials_matmul(x: np.ndarray, w: np.ndarray, group: int) -> np.ndarray:
    """x @ w of half values on the AMP with half partials (groups of `group` input channels): float16."""
    return half_partial_sums(np.asarray(x, np.float32), np.asarray(w, np.float32), group).astype(np.float16)

"""FP8 codelets (C600): cast half/float to QUARTER codes, and the quarter -> half AMP matmul.

QUARTER tensors are one byte per element plus per-tensor metadata (format, power-of-two scale), as Poplar keeps them: an
FP8 dtype in the Graph and the Program (numerics/fp8.FP8_DTYPES), whose code bytes the simulator hands these codelets as
uint8 (program.storage_dtype). An activation's scale is calibrated at compile time and travels as a vertex parameter; a
weight's scale is found from its max-abs when the weights are loaded and sits on the tile as a one-byte int8 metadata
operand. Format ids in params: 0 = F143, 1 = F152.

Operands are stacks of vertices ([n, rows, cols]). The quarter matmul decodes codes through a 256-entry table (the
decode is exact) and runs each group of K as float32 BLAS matmuls on the whole stack, rounding the running sum to half
after every group as `amp_fp8_matmul` (the reference) does.
"""

from __future__ import annotations

import numpy as np

from tremula.codelets import first, optional, register
from tremula.numerics.amp import F16_MAX, half_partial_sums, store, widen
from tremula.numerics.fp8 import Fp8Format, amp_fp8_matmul, decode, dequantize, quantize
from tremula.target import cost, cost_terms

__all__ = ["FORMATS", "amp_fp8_matmul", "amp_matmul_stack", "format_id"]  # amp_fp8_matmul: the reference, re-exported

FORMATS = (Fp8Format.F143, Fp8Format.F152)


def format_id(fmt: Fp8Format | str) -> int:
    return FORMATS.index(fmt if isinstance(fmt, Fp8Format) else Fp8Format.parse(fmt))


def _cast(ops: list[np.ndarray], params) -> None:
    # params: (format id, scale, stochastic, seed). operands: x [rows, cols] float, out codes [rows, cols] uint8.
    # The hardware converts float -> half -> quarter; quantize() follows that path, saturating.
    x, out = ops
    fmt, scale, stochastic = FORMATS[first(params, 0)], first(params, 1), first(params, 2)
    if not stochastic:
        out[...] = quantize(x, fmt, scale)
        return
    p = np.asarray(params, np.int64).reshape(-1, 4)
    if x.ndim == 2:
        x, out = x[None], out[None]
    for i in range(len(x)):  # each vertex draws from its own seeded generator, as each tile would
        out[i] = quantize(x[i], fmt, scale, "stochastic", np.random.default_rng(int(p[i, 3])))


def _cast_cycles(chip, params, shapes, dtypes) -> int:
    n = shapes[0][0] * shapes[0][1]
    # Two conversions (to half when the input is float, then half -> quarter), each one vector pass.
    passes = 2 if dtypes[0] == "float32" else 1
    return passes * cost_terms.vector_cycles(chip, "copy", n, "float16")


# code -> float32 value at scale 0, per format (the NaN code decodes to NaN)
_DECODE = {f: dequantize(np.arange(256, dtype=np.uint8), f, 0, "float32") for f in FORMATS}

# Codes that decode to NaN or inf, per format: only they can make a running sum non-finite (finite products of FP8
# values stay far below float32's range, and clipping bounds the sum), so without them no per-group check is needed.
_BAD_CODES = {f: np.flatnonzero(~np.isfinite(_DECODE[f])).astype(np.uint8) for f in FORMATS}


def _finite_codes(codes: np.ndarray, fmt: Fp8Format) -> bool:
    bad = _BAD_CODES[fmt]
    if len(bad) == 0:
        return True
    if len(bad) == 1:
        return not (codes == bad[0]).any()
    return not np.isin(codes, bad).any()


def amp_matmul_stack(x_codes: np.ndarray, w_codes: np.ndarray, x_fmt: Fp8Format, w_fmt: Fp8Format, x_scale: int,
                     w_scale: np.ndarray, group: int, init: np.ndarray | None = None) -> np.ndarray:
    """`amp_fp8_matmul` on a stack [n, m, k] @ [n, k, n'] with one weight scale per vertex (w_scale [n, 1, 1]).

    The same float32 products per group of K (one BLAS matmul per vertex and group, on the same strided blocks), the
    same scaling, clipping and rounding of the running sum to half after each group (numerics/amp.half_partial_sums,
    which runs the vertices in blocks whose sums stay in cache), so the result is bit-identical. `init`: the half
    partials a later K round continues (float32 half values), else +0.
    """
    x, w = decode(x_codes, x_fmt), decode(w_codes, w_fmt)
    n, m, k = x.shape
    scale = (2.0 ** (x_scale + w_scale.astype(np.int64))).astype(np.float32)
    if not (_finite_codes(x_codes, x_fmt) and _finite_codes(w_codes, w_fmt) and np.isfinite(scale).all()):
        # NaN codes (or an infinite scale): let the half casts carry the NaNs as the reference does
        return _amp_with_half_casts([np.matmul(x[..., k0: k0 + group], w[..., k0: k0 + group, :])
                                     for k0 in range(0, k, group)], scale, init)
    return half_partial_sums(x, w, group, scale, init=init)  # (+0 start, as the reference's zero half partials)


def _amp_with_half_casts(parts: list[np.ndarray], scale: np.ndarray, init: np.ndarray | None = None) -> np.ndarray:
    acc = np.zeros(parts[0].shape, np.float16) if init is None else init.astype(np.float16)
    for part in parts:
        acc = np.clip(acc.astype(np.float32) + part * scale, -F16_MAX, F16_MAX).astype(np.float16)
    return acc.astype(np.float32)


def _matmul_fp8(ops: list[np.ndarray], params) -> None:
    # params: (has_bias, x format, w format, x scale, k group[, accumulate]). operands: x codes [m,k] uint8,
    # w codes [k,n] uint8, w scale [1,1] int8, (bias [1,n] half), (with accumulate: the half partials of the K rounds
    # before, [m,n], at out's bytes), out [m,n] (half; the half partials when K is split).
    has_bias, xf, wf, xs, group = (first(params, j) for j in range(5))
    x, w, wscale, out = ops[0], ops[1], ops[2], ops[-1]
    prev = ops[-2] if optional(params, 5) else None
    single = x.ndim == 2
    if single:
        x, w, wscale = x[None], w[None], wscale[None]
        prev = None if prev is None else prev[None]
    y = amp_matmul_stack(x, w, FORMATS[xf], FORMATS[wf], xs, wscale.reshape(len(x), -1)[:, :1, None], group,
                         None if prev is None else widen(prev))
    if has_bias:
        y = y + ops[3].astype(np.float32)
    store(out, y[0] if single else y)


def _matmul_fp8_cycles(chip, params, shapes, dtypes) -> int:
    (m, k), (_, n) = shapes[0], shapes[1]
    # the quarter -> half AMP path (C600 only), with a Linear's stored weight codes (matmul.stored_weights)
    c = cost.amp_matmul_cycles(chip, m, k, n, "fp8", "float16", bool(optional(params, 5)), weights=True)
    if params[0]:
        c += cost_terms.vector_cycles(chip, "add", m * n, "float16")
    return c


register("fp8_cast", _cast, (-1,), _cast_cycles, uniform=(0, 1, 2))
register("matmul_fp8", _matmul_fp8, (-1,), _matmul_fp8_cycles, uniform=(0, 1, 2, 3, 4))

"""FP8 codelets (C600): cast half/float to QUARTER codes, and the quarter -> half AMP matmul.

QUARTER tensors are one byte per element (uint8 codes) plus per-tensor metadata (format, power-of-two scale), as
Poplar keeps them. An activation's scale is calibrated at compile time and travels as a vertex parameter; a weight's
scale is found from its max-abs when the weights are loaded and sits on the tile as a one-byte int8 metadata operand.
Format ids in params: 0 = F143, 1 = F152.
"""

from __future__ import annotations

import numpy as np

from tremula import cost
from tremula.codelets import register
from tremula.numerics.fp8 import Fp8Format, amp_fp8_matmul, quantize
from tremula.plan import cost_terms

FORMATS = (Fp8Format.F143, Fp8Format.F152)


def format_id(fmt: Fp8Format | str) -> int:
    return FORMATS.index(fmt if isinstance(fmt, Fp8Format) else Fp8Format.parse(fmt))


def _cast(ops: list[np.ndarray], params) -> None:
    # params: (format id, scale, stochastic, seed). operands: x [rows, cols] float, out codes [rows, cols] uint8.
    # The hardware converts float -> half -> quarter; quantize() follows that path, saturating.
    x, out = ops
    fmt, scale, stochastic, seed = FORMATS[int(params[0])], int(params[1]), int(params[2]), int(params[3])
    rng = np.random.default_rng(seed) if stochastic else None
    out[...] = quantize(x, fmt, scale, "stochastic" if stochastic else "nearest", rng)


def _cast_cycles(chip, params, shapes, dtypes) -> int:
    n = shapes[0][0] * shapes[0][1]
    # Two conversions (to half when the input is float, then half -> quarter), each one vector pass.
    passes = 2 if dtypes[0] == "float32" else 1
    return passes * cost_terms.vector_cycles(chip, "copy", n, "float16")


def _matmul_fp8(ops: list[np.ndarray], params) -> None:
    # params: (has_bias, x format, w format, x scale, k group). operands: x codes [m,k] uint8,
    # w codes [k,n] uint8, w scale [1,1] int8, (bias [1,n] half), out [m,n] (half; the half partials when K is split).
    has_bias, xf, wf, xs, group = (int(p) for p in params[:5])
    x, w, wscale, out = ops[0], ops[1], ops[2], ops[-1]
    w_scale = int(np.asarray(wscale).reshape(-1)[0]) if wscale.ndim == 2 else wscale.reshape(len(wscale), -1)[:, :1]
    if np.ndim(w_scale):  # a stack of vertices (batched): one weight scale per vertex
        y = np.stack([amp_fp8_matmul(x[i], w[i], FORMATS[xf], FORMATS[wf], xs, int(w_scale[i, 0]), group)
                      for i in range(len(x))])
    else:
        y = amp_fp8_matmul(x, w, FORMATS[xf], FORMATS[wf], xs, w_scale, group)
    if has_bias:
        y = y + ops[3].astype(np.float32)
    out[...] = y.astype(out.dtype)


def _matmul_fp8_cycles(chip, params, shapes, dtypes) -> int:
    (m, k), (_, n) = shapes[0], shapes[1]
    c = cost.amp_matmul_cycles(chip, m, k, n, "fp8", "float16")  # the quarter -> half AMP path (C600 only)
    if params[0]:
        c += cost_terms.vector_cycles(chip, "add", m * n, "float16")
    return c


register("fp8_cast", _cast, (-1,), _cast_cycles)
register("matmul_fp8", _matmul_fp8, (-1,), _matmul_fp8_cycles)

"""Row codelets: LayerNorm, Softmax and last-axis reductions, accumulating half in float as the hardware does.

Operands are stacks of vertices ([n, rows, cols]); every formula works along the last axis, so a stack is one call.
"""

from __future__ import annotations

import numpy as np

from tremula.codelets import first, i2f, register
from tremula.numerics.amp import store, widen
from tremula.numerics.attention import softmax
from tremula.target import cost_terms


def _layernorm(ops, params) -> None:
    # params: (eps as float64 bits, has_bias). operands: x [r,c], gamma [1,c], (beta [1,c]), out [r,c]
    x, g, out = ops[0], ops[1], ops[-1]
    acc = widen(x) if x.dtype == np.float16 else x
    mu = acc.mean(axis=-1, keepdims=True)
    var = ((acc - mu) ** 2).mean(axis=-1, keepdims=True)
    y = (acc - mu) / np.sqrt(var + np.asarray(i2f(first(params, 0)), acc.dtype)) * g.astype(acc.dtype)
    if first(params, 1):
        y = y + ops[2].astype(acc.dtype)
    store(out, y)


def _layernorm_cycles(chip, params, shapes, dtypes) -> int:
    r, c = shapes[0]
    return cost_terms.layernorm_cycles(chip, r, c, dtypes[0])


def _ln_moments(ops, params) -> None:
    # LayerNorm over column blocks, step 1. operands: x [r,w], out [r,2] float32 = (mean, M2) of each row of the block
    x, out = ops
    acc = widen(x)
    mu = acc.mean(axis=-1, keepdims=True)
    out[..., 0:1] = mu
    out[..., 1:2] = ((acc - mu) ** 2).sum(axis=-1, keepdims=True)


def _ln_moments_cycles(chip, params, shapes, dtypes) -> int:
    r, w = shapes[0]
    return cost_terms.layernorm_moments_cycles(chip, r, w, dtypes[0])


def _ln_apply(ops, params) -> None:
    # LayerNorm over column blocks, step 2. params: (eps as float64 bits, has_bias, parts, cols). operands: x [r,w],
    # the moments of all parts of these rows [parts*r, 2] (part j at rows j*r), gamma [1,w], (beta [1,w]), out [r,w].
    # The parts' widths are even_cuts(cols, parts); the combine (Chan et al.) runs in part order, so every block of a
    # row computes the same mean and variance, and they equal the two-pass ones up to float32 rounding.
    x, mom, g, out = ops[0], ops[1], ops[2], ops[-1]
    parts, cols = first(params, 2), first(params, 3)
    r = x.shape[-2]
    m = mom.astype(np.float32).reshape(mom.shape[:-2] + (parts, r, 2))
    base, extra = divmod(cols, parts)
    n = (base + (np.arange(parts) < extra)).astype(np.float32)[:, None]  # [parts, 1]
    mu_p, m2_p = m[..., 0], m[..., 1]  # [.., parts, r]
    mean = (n * mu_p).sum(axis=-2) / np.float32(cols)
    var = (m2_p + n * (mu_p - mean[..., None, :]) ** 2).sum(axis=-2) / np.float32(cols)
    acc = widen(x)
    y = (acc - mean[..., None]) / np.sqrt(var[..., None] + np.float32(i2f(first(params, 0)))) * g.astype(np.float32)
    if first(params, 1):
        y = y + ops[3].astype(np.float32)
    store(out, y)


def _ln_apply_cycles(chip, params, shapes, dtypes) -> int:
    r, w = shapes[0]
    return cost_terms.layernorm_apply_cycles(chip, r, w, int(params[2]), dtypes[0])


def _softmax(ops, params) -> None:
    x, out = ops
    store(out, softmax(x))  # over each row, in float32 (numerics/attention.softmax)


def _softmax_cycles(chip, params, shapes, dtypes) -> int:
    r, c = shapes[0]
    return cost_terms.softmax_cycles(chip, r, c, dtypes[0])


REDUCE = {"ReduceSum": np.sum, "ReduceMean": np.mean, "ReduceMax": np.max}
REDUCE_IDS = {n: i for i, n in enumerate(REDUCE)}
_REDUCE_FNS = list(REDUCE.values())


def _reduce(ops, params) -> None:
    x, out = ops
    acc = np.float32 if x.dtype == np.float16 else x.dtype
    store(out, _REDUCE_FNS[first(params, 0)](x.astype(acc), axis=-1, keepdims=True))


def _reduce_cycles(chip, params, shapes, dtypes) -> int:
    r, c = shapes[0]
    return cost_terms.reduce_cycles(chip, r, c, dtypes[0])


register("layernorm", _layernorm, (-1,), _layernorm_cycles, uniform=(0, 1))
register("layernorm_moments", _ln_moments, (-1,), _ln_moments_cycles)
register("layernorm_apply", _ln_apply, (-1,), _ln_apply_cycles, uniform=(0, 1, 2, 3))
register("softmax", _softmax, (-1,), _softmax_cycles)
register("reduce", _reduce, (-1,), _reduce_cycles, uniform=(0,))

"""Row codelets: LayerNorm, Softmax and last-axis reductions, accumulating half in float as the hardware does."""

from __future__ import annotations

import numpy as np

from tremula.codelets import i2f, register
from tremula.plan import cost_terms


def _layernorm(ops, params) -> None:
    # params: (eps as float64 bits, has_bias). operands: x [r,c], gamma [1,c], (beta [1,c]), out [r,c]
    x, g, out = ops[0], ops[1], ops[-1]
    acc = x.astype(np.float32) if x.dtype == np.float16 else x
    mu = acc.mean(axis=-1, keepdims=True)
    var = ((acc - mu) ** 2).mean(axis=-1, keepdims=True)
    y = (acc - mu) / np.sqrt(var + np.asarray(i2f(params[0]), acc.dtype)) * g.astype(acc.dtype)
    if params[1]:
        y = y + ops[2].astype(acc.dtype)
    out[...] = y.astype(out.dtype)


def _layernorm_cycles(chip, params, shapes, dtypes) -> int:
    r, c = shapes[0]
    return cost_terms.layernorm_cycles(chip, r, c, dtypes[0])


def softmax_rows(x: np.ndarray) -> np.ndarray:
    """Numerically stable softmax over the last axis in float32 (float64 stays float64); all -inf rows give 0."""
    acc = x.astype(np.float32) if x.dtype == np.float16 else x
    m = np.max(acc, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(acc - m)
    s = np.sum(e, axis=-1, keepdims=True)
    return e / np.where(s == 0, 1, s)


def _softmax(ops, params) -> None:
    x, out = ops
    out[...] = softmax_rows(x).astype(out.dtype)


def _softmax_cycles(chip, params, shapes, dtypes) -> int:
    r, c = shapes[0]
    return cost_terms.softmax_cycles(chip, r, c, dtypes[0])


REDUCE = {"ReduceSum": np.sum, "ReduceMean": np.mean, "ReduceMax": np.max}
REDUCE_IDS = {n: i for i, n in enumerate(REDUCE)}
_REDUCE_FNS = list(REDUCE.values())


def _reduce(ops, params) -> None:
    x, out = ops
    acc = np.float32 if x.dtype == np.float16 else x.dtype
    out[...] = _REDUCE_FNS[params[0]](x.astype(acc), axis=-1, keepdims=True).astype(out.dtype)


def _reduce_cycles(chip, params, shapes, dtypes) -> int:
    r, c = shapes[0]
    return cost_terms.reduce_cycles(chip, r, c, dtypes[0])


register("layernorm", _layernorm, (-1,), _layernorm_cycles)
register("softmax", _softmax, (-1,), _softmax_cycles)
register("reduce", _reduce, (-1,), _reduce_cycles)

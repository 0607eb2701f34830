"""Matmul codelets: a block of x @ w (+ bias) on one tile, accumulating half inputs in float as the AMP does."""

from __future__ import annotations

import numpy as np

from tremula.codelets import register
from tremula.plan import cost_terms


def _acc(dtype) -> type:
    return np.float32 if dtype == np.float16 else dtype


def _matmul(ops: list[np.ndarray], params) -> None:
    # params: (has_bias,). operands: x [m,k], w [k,n], (bias [1,n]), out [m,n]
    x, w, out = ops[0], ops[1], ops[-1]
    acc = _acc(x.dtype)
    y = np.matmul(x.astype(acc), w.astype(acc)).astype(out.dtype)
    if params[0]:
        y = (y + ops[2]).astype(out.dtype)
    out[...] = y


def _matmul_cycles(chip, params, shapes, dtypes) -> int:
    (m, k), (_, n) = shapes[0], shapes[1]
    c = cost_terms.matmul_cycles(chip, m, k, n, dtypes[0])
    if params[0]:
        c += cost_terms.vector_cycles(chip, "add", m * n, dtypes[-1])
    return c


def _matmul_partial(ops: list[np.ndarray], params) -> None:
    # x [m,k] @ w [k,n] -> float32 partial sums [m,n] (K was split over tiles; a reduce step adds the partials)
    x, w, out = ops
    out[...] = np.matmul(x.astype(np.float32), w.astype(np.float32))


def _partial_cycles(chip, params, shapes, dtypes) -> int:
    (m, k), (_, n) = shapes[0], shapes[1]
    return cost_terms.matmul_cycles(chip, m, k, n, dtypes[0])


def _reduce_partials(ops: list[np.ndarray], params) -> None:
    # params: (n_parts, has_bias). operands: n_parts float32 partials [m,n], (bias [1,n]), out [m,n]
    n_parts, has_bias = params[0], params[1]
    out = ops[-1]
    s = ops[0].astype(np.float32)
    for p in ops[1:n_parts]:
        s = s + p
    y = s.astype(out.dtype)
    if has_bias:
        y = (y + ops[n_parts]).astype(out.dtype)
    out[...] = y


def _reduce_partials_cycles(chip, params, shapes, dtypes) -> int:
    m, n = shapes[-1]
    return cost_terms.vector_cycles(chip, "add", m * n * (params[0] - 1 + params[1]), "float32")


register("matmul", _matmul, (-1,), _matmul_cycles)
register("matmul_partial", _matmul_partial, (-1,), _partial_cycles)
register("reduce_partials", _reduce_partials, (-1,), _reduce_partials_cycles)

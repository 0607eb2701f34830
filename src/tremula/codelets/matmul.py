"""Matmul codelets: a block of x @ w (+ bias) on one tile, accumulating half inputs in float as the AMP does.

Every codelet takes a stack of vertices ([n, rows, cols] operands); the products run as float32 (or float64) BLAS
matmuls on the stack, so half inputs are widened once (exactly) and rounded to half where the AMP writes half.
"""

from __future__ import annotations

import numpy as np

from tremula.codelets import first, register
from tremula.target import cost_terms


def _acc(dtype) -> type:
    return np.float32 if dtype == np.float16 else dtype


def _matmul(ops: list[np.ndarray], params) -> None:
    # params: (has_bias,). operands: x [m,k], w [k,n], (bias [1,n]), out [m,n]
    x, w, out = ops[0], ops[1], ops[-1]
    acc = _acc(x.dtype)
    y = np.matmul(x.astype(acc, copy=False), w.astype(acc, copy=False)).astype(out.dtype, copy=False)
    if first(params, 0):
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
    out[...] = np.matmul(x.astype(np.float32, copy=False), w.astype(np.float32, copy=False))


def _partial_cycles(chip, params, shapes, dtypes) -> int:
    (m, k), (_, n) = shapes[0], shapes[1]
    return cost_terms.matmul_cycles(chip, m, k, n, dtypes[0])


def _reduce_partials(ops: list[np.ndarray], params) -> None:
    # params: (n_parts, has_bias). operands: own partial [m,n], the n_parts - 1 received ones stacked [(n_parts-1)*m, n]
    # (partials float32, or half from the FP8 AMP; summed in float32 in part order), (bias [1,n]), out [m,n]
    n_parts, has_bias = first(params, 0), first(params, 1)
    own, recv, out = ops[0], ops[1], ops[-1]
    m = own.shape[-2]
    s = own.astype(np.float32, copy=False)
    for q in range(n_parts - 1):
        s = s + recv[..., q * m: (q + 1) * m, :].astype(np.float32, copy=False)
    y = s.astype(out.dtype, copy=False)
    if has_bias:
        y = (y + ops[2]).astype(out.dtype)
    out[...] = y


def _reduce_partials_cycles(chip, params, shapes, dtypes) -> int:
    m, n = shapes[-1]
    return cost_terms.vector_cycles(chip, "add", m * n * (params[0] - 1 + params[1]), "float32")


register("matmul", _matmul, (-1,), _matmul_cycles, uniform=(0,))
register("matmul_partial", _matmul_partial, (-1,), _partial_cycles)
register("reduce_partials", _reduce_partials, (-1,), _reduce_partials_cycles, uniform=(0, 1))

"""Matmul codelets: a block of x @ w (+ bias) on one tile, accumulating half inputs as the AMP does.

Every codelet takes a stack of vertices ([n, rows, cols] operands); the products run as float32 (or float64) BLAS
matmuls on the stack, so half inputs are widened once (exactly) and rounded to half where the AMP writes half. Half
inputs accumulate in float32 (float partials) or, when the vertex's `group` param is set, in half partials rounded
after every group of that many input channels (numerics/amp.py); split-K partials are then half, and so is their sum.
A Program without the param (saved before partials were a choice) means float partials. With half partials a vertex
may continue the partials of the K rounds before it (its `accumulate` param; plan/strategies.py LinearStrategy.kchunk):
they are read from the output's own bytes as an extra operand before the output, and the chunks are whole groups, so
the rounds together give the bits of one vertex over all of K.
"""

from __future__ import annotations

import numpy as np

from tremula.codelets import first, optional, register
from tremula.numerics.amp import as_half, half_partial_sums, saturate_round_half, to_half, widen
from tremula.numerics.jit import add_round_half, sum_half_parts
from tremula.target import cost_terms


def partials_of(codelet_name: str, params) -> str:
    """"half" or "float": the partials a matmul or attention vertex accumulates in (its `group` param; reports price
    by it)."""
    from tremula.codelets.attention import GROUP

    j = {"matmul": 1, "matmul_partial": 0, **GROUP}.get(codelet_name)
    return "half" if j is not None and optional(params, j) else "float"


def stored_weights(codelet_name: str, partials: str) -> bool:
    """Whether a matmul vertex's w is a Linear's stored weights (priced as a weights kernel, cost.amp_matmul_cycles):
    always for matmul_partial (only a Linear's K is split) and matmul_fp8 (weight codes); for matmul with half
    partials (a MatMul of two activations runs with float partials, plan/lower_matmul.py)."""
    return codelet_name in ("matmul_partial", "matmul_fp8") or (codelet_name == "matmul" and partials == "half")


def _half_stack(x: np.ndarray, w: np.ndarray, group: int, prev: np.ndarray | None = None) -> np.ndarray:
    """Half partials of a stack of vertices (one vertex run alone is a stack of one, so it takes the same BLAS calls
    and gives the same bits as inside a stack: a group's float32 sum depends on the kernel that forms it), continuing
    `prev` (the half partials of the K rounds before) when given."""
    single = x.ndim == 2
    one = (lambda a: widen(a)[None]) if single else widen
    y = half_partial_sums(one(x), one(w), group, init=None if prev is None else one(prev))
    return y[0] if single else y


def _matmul(ops: list[np.ndarray], params) -> None:
    # params: (has_bias[, group[, accumulate]]): group > 0 means half partials. operands: x [m,k], w [k,n],
    # (bias [1,n]), (with accumulate: the half partials so far [m,n], at out's bytes), out [m,n]
    x, w, out = ops[0], ops[1], ops[-1]
    group = optional(params, 1)
    if group and x.dtype == np.float16:
        y = _half_stack(x, w, group, ops[-2] if optional(params, 2) else None)
        y = to_half(y) if out.dtype == np.float16 else y.astype(out.dtype)
    else:
        y = np.matmul(widen(x), widen(w)) if x.dtype == np.float16 else np.matmul(x, w.astype(x.dtype, copy=False))
        y = as_half(y) if out.dtype == np.float16 else y.astype(out.dtype, copy=False)
    if first(params, 0):
        y = (y + ops[2]).astype(out.dtype)
    out[...] = y


def _matmul_cycles(chip, params, shapes, dtypes) -> int:
    (m, k), (_, n) = shapes[0], shapes[1]
    partials = partials_of("matmul", params)
    c = cost_terms.matmul_cycles(chip, m, k, n, dtypes[0], partials, bool(optional(params, 2)),
                                 stored_weights("matmul", partials))
    if params[0]:
        c += cost_terms.vector_cycles(chip, "add", m * n, dtypes[-1])
    return c


def _matmul_partial(ops: list[np.ndarray], params) -> None:
    # x [m,k] @ w [k,n] -> partial sums [m,n] (K was split over tiles; a reduce step adds the partials): float32, or
    # half with params (group[, accumulate]); with accumulate an operand before out holds the half partials so far
    x, w, out = ops[0], ops[1], ops[-1]
    group = optional(params, 0)
    if group:
        y = _half_stack(x, w, group, ops[-2] if optional(params, 1) else None)
        if out.dtype == np.float16:  # half values: to_half gives astype's bits in a fraction of its time
            to_half(y, out)
        else:
            out[...] = y
    else:
        out[...] = np.matmul(x.astype(np.float32, copy=False), w.astype(np.float32, copy=False))


def _partial_cycles(chip, params, shapes, dtypes) -> int:
    (m, k), (_, n) = shapes[0], shapes[1]
    partials = partials_of("matmul_partial", params)
    return cost_terms.matmul_cycles(chip, m, k, n, dtypes[0], partials, bool(optional(params, 1)),
                                    stored_weights("matmul_partial", partials))


def _reduce_partials(ops: list[np.ndarray], params) -> None:
    # params: (n_parts, has_bias[, half, own part]). operands: own partial [m,n], the n_parts - 1 received ones
    # stacked [(n_parts-1)*m, n] in part order without the own one (partials float32, or half from the FP8 AMP or
    # half partials), (bias [1,n]), out [m,n]. Float32 partials: own + the received ones. Half (`half` set): the
    # parts in part order (the own one at its index), rounded to half after every add and saturating, as the
    # reference sums them (the order matters once every add rounds).
    n_parts, has_bias, half = first(params, 0), first(params, 1), optional(params, 2)
    own, recv, out = ops[0], ops[1], ops[-1]
    m = own.shape[-2]
    if half:
        # every vertex's parts in part order: its own at its index, the received ones around it. Widened once, part
        # q of every vertex gathered as it is added (no array holding a copy of every part).
        own3 = own.reshape((-1,) + own.shape[-2:])
        n = len(own3)
        mine = np.asarray(params, np.int64).reshape(n, -1)[:, 3]
        own32 = widen(own3)
        recv32 = widen(recv).reshape(n, n_parts - 1, m, recv.shape[-1])
        rows = np.arange(n)
        s = sum_half_parts(own32, recv32, mine)  # (one compiled pass when numba is there; else the loop below)
        a = b = None
        for q in range(n_parts if s is None else 0):
            part = recv32[rows, np.clip(q - (q > mine), 0, n_parts - 2)] if n_parts > 1 else own32.copy()
            ours = mine == q
            if ours.any():
                part[ours] = own32[ours]
            if s is None:
                s, a, b = part, np.empty_like(part), np.empty_like(part)
            elif not add_round_half(s, part):  # (one pass when numba is there; else NumPy's passes)
                s += part
                saturate_round_half(s, a, b)
        s = s.reshape(own.shape)
        if n_parts > 1 and out.dtype == np.float16:  # rounded by saturate_round_half: to_half gives astype's bits
            y = to_half(s)
            if has_bias:
                y = (y + ops[2]).astype(out.dtype)
            out[...] = y
            return
    else:
        s = own.astype(np.float32)  # (a copy: summed in place)
        for q in range(n_parts - 1):
            s += recv[..., q * m: (q + 1) * m, :].astype(np.float32, copy=False)
    y = as_half(s) if out.dtype == np.float16 else s.astype(out.dtype, copy=False)
    if has_bias:
        y = (y + ops[2]).astype(out.dtype)
    out[...] = y


def _reduce_partials_cycles(chip, params, shapes, dtypes) -> int:
    m, n = shapes[-1]
    return cost_terms.vector_cycles(chip, "add", m * n * (params[0] - 1 + params[1]),
                                    "float16" if optional(params, 2) else "float32")


register("matmul", _matmul, (-1,), _matmul_cycles, uniform=(0,))
register("matmul_partial", _matmul_partial, (-1,), _partial_cycles)
register("reduce_partials", _reduce_partials, (-1,), _reduce_partials_cycles, uniform=(0, 1, 2))

"""The attention codelets: one (batch*head, query block) on one tile, with K and V for that head delivered to it.

softmax(q @ k^T * scale + mask) @ v with max-subtraction, in float32 or, with half partials, in half with float32 row
sums (numerics/attention.py, the arithmetic the reference rules share); causal keeps key j for global query row i iff
j <= i + Sk - Sq (the reference's tril offset).

The score matrix is an operand of its own, [rows, keys] before the outputs: the AMP writes q @ kᵀ there, the softmax
runs over it in place, and p @ v reads it, so the chip holds a tile's whole block of scores at once and the memory plan
must place it (half with half partials, float32 with float ones: `scores_dtype`). The codelets leave p in it, in that
dtype.

When a head's K and V are too big for one tile, the keys are split over tiles: `attention_partial` computes, for its
block of keys, the unnormalised p @ v (kept in the attention's dtype) with its own row max and row sum (float32), and
`attention_combine` rescales the blocks' results to their common max and divides by the total sum (the same algebra as
a one-pass softmax, exact up to rounding).

Operands are stacks of vertices ([n, rows, cols]); has_mask, causal, the scale and the half-partials group (0: float
partials) are uniform params, the query and key block starts vary per vertex.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from tremula.codelets import column, first, i2f, register
from tremula.numerics.amp import store, widen
from tremula.numerics.attention import combine_blocks, exp_shifted, probabilities, scores, weighted_values
from tremula.target import cost_terms

GROUP = {"attention": 6, "attention_partial": 7}  # the params column of each codelet's half-partials group


def scores_dtype(group: int) -> str:
    """The dtype a tile holds an attention vertex's scores in: the AMP's output with half partials, else float32."""
    return "float16" if group else "float32"


def _scores(q, k, mask, params, k_start, group: int):
    """q @ k^T * scale (+ mask), causal keys masked to -inf (numerics/attention.scores). Keys are k_start.. of sk.

    params: (has_mask, causal, q_start, sq, sk, scale bits, ...) of each vertex; k_start: each vertex's first key."""
    allowed = None
    if first(params, 1):
        q_start, sq, sk_total = column(params, 2), column(params, 3), column(params, 4)
        rows = q_start + np.arange(q.shape[-2])[:, None]
        keys = k_start + np.arange(k.shape[-2])[None, :]
        allowed = keys <= rows + (sk_total - sq)
    return scores(q, k, i2f(first(params, 5)), mask, allowed, group)


def _attention(ops, params) -> None:
    # params: (has_mask, causal, q_start, sq, sk, scale bits, group). operands: q [r,d], k [sk,d], v [sk,dv],
    # (mask [1|r, sk]), scores [r, sk] (p is left there), out [r, dv]
    q, k, v, out = ops[0], ops[1], ops[2], ops[-1]
    group = first(params, GROUP["attention"])
    s = _scores(q, k, ops[3] if first(params, 0) else None, params, 0, group)
    p = probabilities(s, bool(group))
    store(ops[-2], p)
    store(out, weighted_values(p, v, group))


def _attention_cycles(chip, params, shapes, dtypes, group_col: int) -> int:
    # q [r,d], k [sk,d], v [sk,dv]: a whole head's keys, or one key block of them (attention_partial). Half partials:
    # both products on the half -> half AMP, the scale and the softmax in half (its row sum in float32, as
    # cost.softmax_cycles prices every softmax). A key block's vertex leaves p unnormalised (the combine divides by
    # the total sum): its softmax is priced without the per-row reciprocal and the multiply over the scores.
    (r, d), (sk, _), (_, dv) = shapes[0], shapes[1], shapes[2]
    half = bool(params[group_col])
    partials, vec = ("half", "float16") if half else ("float", "float32")
    softmax = cost_terms.softmax_cycles if group_col == GROUP["attention"] else cost_terms.exp_shifted_cycles
    return (cost_terms.matmul_cycles(chip, r, d, sk, dtypes[0], partials)
            + cost_terms.matmul_cycles(chip, r, sk, dv, dtypes[0], partials)
            + softmax(chip, r, sk, vec) + cost_terms.vector_cycles(chip, "mul", r * sk, vec))


register("attention", _attention, (-2, -1), partial(_attention_cycles, group_col=GROUP["attention"]),
         uniform=(0, 1, 5, 6))


def _attention_partial(ops, params) -> None:
    # params: (has_mask, causal, q_start, sq, sk, scale bits, k_start, group). operands: q [r,d], k [kb,d], v [kb,dv],
    # (mask [1|r, kb]), scores [r, kb] (p is left there), pv [r, dv] (the attention's dtype): p @ v unnormalised,
    # stats [r, 2] float32: the row max and the row sum of p. p <= 1, so p @ v is bounded by kb x max |v| and stores
    # in the values' own precision.
    q, k, v, pv, stats = ops[0], ops[1], ops[2], ops[-2], ops[-1]
    group = first(params, GROUP["attention_partial"])
    s = _scores(q, k, ops[3] if first(params, 0) else None, params, column(params, 6), group)
    p, top, total = exp_shifted(s, bool(group))  # a block with every key masked contributes p = 0
    store(ops[-3], p)
    store(pv, weighted_values(p, v, group))
    stats[..., 0:1] = top
    stats[..., 1:2] = total


def _attention_combine(ops, params) -> None:
    # params: (blocks, group). operands: `blocks` p @ v partials [r, dv], then `blocks` stats [r, 2]
    # (attention_partial's), out [r, dv]; combined as numerics/attention.combine_blocks does, in half with half
    # partials (group > 0), else in float32
    nb = first(params, 0)
    st = [widen(o) for o in ops[nb: 2 * nb]]
    out = combine_blocks([widen(o) for o in ops[:nb]], [x[..., 0:1] for x in st], [x[..., 1:2] for x in st],
                         bool(first(params, 1)))
    store(ops[-1], out)


def _attention_combine_cycles(chip, params, shapes, dtypes) -> int:
    nb, half = int(params[0]), bool(params[1])
    r, dv = shapes[-1]
    # per block: the row max and the rescale's exp (float32, per row), and a multiply-add over its values and row
    # sum (float: all in float32, then a divide over the values; half: the values in half, the row sums in float32,
    # then the row sums' reciprocal and one half multiply over the values)
    per_block = (cost_terms.vector_cycles(chip, "max", r, "float32")
                 + cost_terms.vector_cycles(chip, "exp", r, "float32"))
    if not half:
        per_block += 2 * cost_terms.vector_cycles(chip, "mul", r * (dv + 1), "float32")
        return nb * per_block + cost_terms.vector_cycles(chip, "divide", r * dv, "float32")
    per_block += (2 * cost_terms.vector_cycles(chip, "mul", r, "float32")
                  + 2 * cost_terms.vector_cycles(chip, "mul", r * dv, "float16"))
    return (nb * per_block + cost_terms.vector_cycles(chip, "divide", r, "float32")
            + cost_terms.vector_cycles(chip, "mul", r * dv, "float16"))


register("attention_partial", _attention_partial, (-3, -2, -1),
         partial(_attention_cycles, group_col=GROUP["attention_partial"]), uniform=(0, 1, 5, 7))
register("attention_combine", _attention_combine, (-1,), _attention_combine_cycles, uniform=(0, 1))

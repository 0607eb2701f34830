"""The attention codelets: one (batch*head, query block) on one tile, with K and V for that head delivered to it.

softmax(q @ k^T * scale + mask) @ v with max-subtraction and float32 accumulation; causal keeps key j for global query
row i iff j <= i + Sk - Sq (the reference's tril offset).

When a head's K and V are too big for one tile, the keys are split over tiles: `attention_partial` computes, for its
block of keys, the unnormalised p @ v (kept in the attention's dtype) with its own row max and row sum (float32), and
`attention_combine` rescales the blocks' results to their common max and divides by the total sum (the same algebra as
a one-pass softmax, exact up to rounding).

Operands are stacks of vertices ([n, rows, cols]); has_mask, causal and the scale are uniform params, the query and
key block starts vary per vertex.
"""

from __future__ import annotations

import numpy as np

from tremula.codelets import column, first, i2f, register
from tremula.codelets.norm import softmax_rows
from tremula.target import cost_terms


def _scores(q, k, mask, params, k_start):
    """q @ k^T * scale (+ mask), causal keys masked to -inf; float32 for half inputs. Keys are k_start.. of sk.

    params: (has_mask, causal, q_start, sq, sk, scale bits, ...) of each vertex; k_start: each vertex's first key."""
    acc = np.float32 if q.dtype == np.float16 else q.dtype.type
    s = np.matmul(q.astype(acc, copy=False), np.swapaxes(k.astype(acc, copy=False), -1, -2)) * acc(i2f(first(params, 5)))
    if mask is not None:
        s = s + mask.astype(acc, copy=False)
    if first(params, 1):
        q_start, sq, sk_total = column(params, 2), column(params, 3), column(params, 4)
        rows = q_start + np.arange(q.shape[-2])[:, None]
        keys = k_start + np.arange(k.shape[-2])[None, :]
        s = np.where(keys <= rows + (sk_total - sq), s, -np.inf)
    return s, acc


def _attention(ops, params) -> None:
    # params: (has_mask, causal, q_start, sq, sk, scale bits). operands: q [r,d], k [sk,d], v [sk,dv], (mask [1|r, sk]),
    # out [r, dv]
    q, k, v, out = ops[0], ops[1], ops[2], ops[-1]
    s, acc = _scores(q, k, ops[3] if first(params, 0) else None, params, 0)
    p = softmax_rows(s)
    out[...] = np.matmul(p, v.astype(acc, copy=False)).astype(out.dtype, copy=False)


def _attention_cycles(chip, params, shapes, dtypes) -> int:
    # q [r,d], k [sk,d], v [sk,dv]: a whole head's keys, or one key block of them (attention_partial)
    (r, d), (sk, _), (_, dv) = shapes[0], shapes[1], shapes[2]
    return (cost_terms.matmul_cycles(chip, r, d, sk, dtypes[0]) + cost_terms.matmul_cycles(chip, r, sk, dv, dtypes[0])
            + cost_terms.softmax_cycles(chip, r, sk, "float32") + cost_terms.vector_cycles(chip, "mul", r * sk, "float32"))


register("attention", _attention, (-1,), _attention_cycles, uniform=(0, 1, 5))


def _attention_partial(ops, params) -> None:
    # params: (has_mask, causal, q_start, sq, sk, scale bits, k_start). operands: q [r,d], k [kb,d], v [kb,dv],
    # (mask [1|r, kb]), pv [r, dv] (the attention's dtype): p @ v unnormalised, stats [r, 2] float32: the row max and
    # the row sum of p. p <= 1, so p @ v is bounded by kb x max |v| and stores in the values' own precision.
    q, k, v, pv, stats = ops[0], ops[1], ops[2], ops[-2], ops[-1]
    s, acc = _scores(q, k, ops[3] if first(params, 0) else None, params, column(params, 6))
    top = np.max(s, axis=-1, keepdims=True)
    finite = np.isfinite(top)
    p = np.exp(s - np.where(finite, top, acc(0)))  # a block with every key masked contributes p = 0
    pv[...] = np.matmul(p, v.astype(acc, copy=False)).astype(pv.dtype, copy=False)
    stats[..., 0:1] = np.where(finite, top, -np.inf)
    stats[..., 1:2] = np.sum(p, axis=-1, keepdims=True)


def _attention_combine(ops, params) -> None:
    # params: (blocks,). operands: `blocks` p @ v partials [r, dv], then `blocks` stats [r, 2] (attention_partial's),
    # out [r, dv]; combined in float32
    nb = first(params, 0)
    pv = np.stack([o.astype(np.float32) for o in ops[:nb]])
    st = np.stack([o.astype(np.float32) for o in ops[nb: 2 * nb]])
    m = st[..., 0:1]
    top = np.max(m, axis=0)
    w = np.where(np.isfinite(m), np.exp(m - np.where(np.isfinite(top), top, 0)), 0).astype(np.float32)
    # Summed block by block in block order: np.sum over the blocks' axis picks its order from the array's shape (a
    # vertex alone and the same vertex in a stack came out one half ulp apart), this order is the same for any stack.
    num, den = w[0] * pv[0], w[0] * st[0, ..., 1:2]
    for b in range(1, nb):
        num += w[b] * pv[b]
        den += w[b] * st[b, ..., 1:2]
    ops[-1][...] = (num / den).astype(ops[-1].dtype)


def _attention_combine_cycles(chip, params, shapes, dtypes) -> int:
    nb = int(params[0])
    r, dv = shapes[-1]
    # per block: a max, an exp of the rescale and a multiply-add over its rows; then one divide
    per_block = (cost_terms.vector_cycles(chip, "max", r, "float32")
                 + cost_terms.vector_cycles(chip, "exp", r, "float32")
                 + 2 * cost_terms.vector_cycles(chip, "mul", r * (dv + 1), "float32"))
    return nb * per_block + cost_terms.vector_cycles(chip, "divide", r * dv, "float32")


register("attention_partial", _attention_partial, (-2, -1), _attention_cycles, uniform=(0, 1, 5))
register("attention_combine", _attention_combine, (-1,), _attention_combine_cycles, uniform=(0,))

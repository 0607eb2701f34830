"""The attention codelet: one (batch*head, query block) on one tile, with K and V for that head delivered to it.

softmax(q @ k^T * scale + mask) @ v with max-subtraction and float32 accumulation; causal keeps key j for global query
row i iff j <= i + Sk - Sq (the reference's tril offset).
"""

from __future__ import annotations

import numpy as np

from tremula.codelets import i2f, register
from tremula.codelets.norm import softmax_rows
from tremula.plan import cost_terms


def _attention(ops, params) -> None:
    # params: (has_mask, causal, q_start, sq, sk, scale bits). operands: q [r,d], k [sk,d], v [sk,dv], (mask [1|r, sk]),
    # out [r, dv]
    has_mask, causal, q_start, sq, sk, scale_bits = params
    q, k, v, out = ops[0], ops[1], ops[2], ops[-1]
    acc = np.float32 if q.dtype == np.float16 else q.dtype.type
    s = np.matmul(q.astype(acc), np.swapaxes(k.astype(acc), -1, -2)) * acc(i2f(scale_bits))
    if has_mask:
        s = s + ops[3].astype(acc)
    if causal:
        rows = np.arange(q_start, q_start + q.shape[-2])[:, None]
        s = np.where(np.arange(sk)[None, :] <= rows + (sk - sq), s, -np.inf)
    p = softmax_rows(s)
    out[...] = np.matmul(p, v.astype(acc)).astype(out.dtype)


def _attention_cycles(chip, params, shapes, dtypes) -> int:
    (r, d), (sk, _), (_, dv) = shapes[0], shapes[1], shapes[2]
    return (cost_terms.matmul_cycles(chip, r, d, sk, dtypes[0]) + cost_terms.matmul_cycles(chip, r, sk, dv, dtypes[0])
            + cost_terms.softmax_cycles(chip, r, sk, "float32") + cost_terms.vector_cycles(chip, "mul", r * sk, "float32"))


register("attention", _attention, (-1,), _attention_cycles)

"""Attention's arithmetic, one definition for the Attention rule (ir/ops.py), the precision-matched reference
(sim/reference.py) and the attention codelets (codelets/attention.py), on arrays [..., rows, features].

Two paths, by what the products accumulate in (`group`, from the node's partials mark, passes/precision.with_partials):

- float (group 0): q @ kᵀ and p @ v in float32 (half inputs widened), softmax in float32, the output rounded once.
- half (group > 0, fp16 inputs; PopRT's path, whose SigLIP profile runs QK and PV as fp16 AMP convolutions with half
  partials, ../shared/reference/ipu-stack-facts.md section 4.3): both products on the AMP's half -> half path, the
  running sum rounded to half after every `group` input channels (numerics/amp.half_partial_sums); the scale and the
  mask applied on the vector unit in half; the softmax in half with its row sum and reciprocal in float32 (the row max
  of half values is exact either way): e = half(exp(s - max)), p = half(e x (1 / sum e)). The custom stack measured
  this softmax ("F16, FP32 state") on the C600.

Every value is computed in float32 and rounded where the chip rounds, so the numbers are those of half arrays in a
fraction of NumPy's float16 time. A row whose keys are all masked gives p = 0 (and so a zero output).
"""

from __future__ import annotations

import numpy as np

from tremula.numerics.amp import half_partial_sums, saturate_round_half, widen

MatMul = np.matmul


def _acc(x: np.ndarray) -> np.dtype:
    return np.dtype(np.float32) if x.dtype == np.float16 else x.dtype


def _wide(x: np.ndarray) -> np.ndarray:
    """x in its accumulation type: half widened exactly (amp.widen: not NumPy's element-at-a-time half cast)."""
    return widen(x) if x.dtype == np.float16 else x


CHUNK = 1 << 16  # elements a softmax pass works on at a time: its temporaries stay in cache


def _softmax(acc: np.ndarray, axis: int) -> np.ndarray:
    top = np.max(acc, axis=axis, keepdims=True)
    e = np.exp(acc - np.where(np.isfinite(top), top, 0))
    total = np.sum(e, axis=axis, keepdims=True)
    return e / np.where(total == 0, 1, total)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax over `axis` in float32 for half input (wider types stay); a row of all -inf gives
    zeros, not NaN from inf - inf. The float path here, the Softmax rule (ir/ops.py) and the softmax codelet
    (codelets/norm.py) all compute it so. Over the last axis of a big array it runs on blocks of whole rows, so the
    passes' temporaries stay in cache (SigLIP so400m's scores on four calibration samples are 136 MB a layer): every
    row is computed alone either way, so the bits are the same."""
    acc = _wide(x)
    if axis not in (-1, acc.ndim - 1) or acc.size <= CHUNK:
        return _softmax(acc, axis)
    rows = acc.reshape(-1, acc.shape[-1])
    per = max(1, CHUNK // acc.shape[-1])
    first = _softmax(rows[:per], -1)
    out = np.empty(rows.shape, first.dtype)  # the type the formula gives (float64 for integers)
    out[:per] = first
    for r in range(per, len(rows), per):
        out[r: r + per] = _softmax(rows[r: r + per], -1)
    return out.reshape(acc.shape)


def scores(q: np.ndarray, k: np.ndarray, scale: float, mask: np.ndarray | None = None,
           allowed: np.ndarray | None = None, group: int = 0, mm=MatMul) -> np.ndarray:
    """q @ kᵀ x scale (+ mask), keys not `allowed` (a boolean mask broadcasting to the scores) at -inf: float32 for
    half inputs (float64 stays float64); with `group`, the values are half values."""
    acc = _acc(q)
    qa, ka = _wide(q), np.swapaxes(_wide(k), -1, -2)
    if group:
        s = half_partial_sums(qa, ka, group, matmul=mm)
        s *= acc.type(scale)
        saturate_round_half(s)
        if mask is not None:
            s += mask.astype(acc, copy=False)
            saturate_round_half(s)
    else:
        s = mm(qa, ka) * acc.type(scale)
        if mask is not None:
            s = s + mask.astype(acc, copy=False)
    if allowed is not None:
        s = np.where(allowed, s, -np.inf).astype(acc, copy=False)
    return s


def exp_shifted(s: np.ndarray, half: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(e = exp(s - row max), the row max (-inf for a row with every key masked), the row sum of e in float32 or
    s's type): a row with every key masked has e = 0. With `half`, e is rounded to half."""
    top = np.max(s, axis=-1, keepdims=True)
    finite = np.isfinite(top)
    e = np.exp(s - np.where(finite, top, s.dtype.type(0)))
    if half:
        saturate_round_half(e)
    return e, np.where(finite, top, -np.inf).astype(s.dtype, copy=False), np.sum(e, axis=-1, keepdims=True)


def probabilities(s: np.ndarray, half: bool = False) -> np.ndarray:
    """softmax over the last axis of the scores s; with `half`, e and p rounded to half (sum and reciprocal in
    float32)."""
    if not half:
        return softmax(s)
    e, _, total = exp_shifted(s, True)
    p = e * (s.dtype.type(1) / np.where(total == 0, 1, total))
    return saturate_round_half(p)


def weighted_values(p: np.ndarray, v: np.ndarray, group: int = 0, mm=MatMul) -> np.ndarray:
    """p @ v: float32 sums (half inputs widened), or half partials over keys in groups of `group`."""
    va = _wide(v)
    return half_partial_sums(p, va, group, matmul=mm) if group else mm(p, va)


SCORES_CHUNK = 1 << 20  # score elements attention computes at a time (4 MB of float32), whole matrices at a time


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, mask: np.ndarray | None = None,
              allowed: np.ndarray | None = None, group: int = 0, mm=MatMul) -> np.ndarray:
    """softmax(q @ kᵀ x scale + mask) @ v in q's dtype, on the path `group` names (module docstring).

    A stack of attention matrices ([..., rows, features], the same leading axes for q, k and v) bigger than
    SCORES_CHUNK runs a few whole matrices at a time along its first axis, so the scores and probabilities stay in
    cache instead of being fresh arrays of the whole stack (SigLIP so400m's float32 reference at four samples: 136 MB
    a layer): every matrix is computed alone either way (a stacked matmul runs one product per matrix), so the bits
    are the same."""
    sq, sk, n = q.shape[-2], k.shape[-2], int(np.prod(q.shape[:-2]))
    if n > 1 and sq * sk * n > SCORES_CHUNK:
        m = None if mask is None else np.broadcast_to(mask, q.shape[:-1] + (sk,))
        per = max(1, SCORES_CHUNK // (sq * sk * int(np.prod(q.shape[1:-2]))))
        if per == 1 and q.ndim > 3:  # one entry of the first axis (batch 1: the only one) is still a stack: chunk it
            return np.stack([attention(q[i], k[i], v[i], scale, None if m is None else m[i], allowed, group, mm)
                             for i in range(len(q))])
        return np.concatenate([attention(q[i: i + per], k[i: i + per], v[i: i + per], scale,
                                         None if m is None else m[i: i + per], allowed, group, mm)
                               for i in range(0, len(q), per)])
    s = scores(q, k, scale, mask, allowed, group, mm)
    return weighted_values(probabilities(s, bool(group)), v, group, mm).astype(q.dtype)


def combine_blocks(pvs: list[np.ndarray], tops: list[np.ndarray], sums: list[np.ndarray], half: bool) -> np.ndarray:
    """Key blocks' partials combined into attention's output, before its rounding to the output's dtype: each block's
    unnormalised p @ v (float32 arrays of values in the attention's dtype, [..., r, dv]) with its row max and row sum
    ([..., r, 1], float32). Each block is rescaled by w = exp(its max - the common max) and the weighted sum divided by
    the weighted row sums, block by block in block order (NumPy's sum over a stacked axis picks its order from the
    shape). The weights and the row sums stay in float32 (per row, few); the [r, dv] values:
    - float: summed in float32 and divided once;
    - half (half partials: the softmax's own path, values in half with float32 state): each weight rounded to half,
      each product and each running sum rounded to half, as f16 vector multiplies and adds do, then multiplied by the
      float32 reciprocal of the row sum, as the half softmax normalises (the caller's store rounds it once)."""
    m = np.stack(tops)
    top = np.max(m, axis=0)
    w = np.where(np.isfinite(m), np.exp(m - np.where(np.isfinite(top), top, 0)), 0).astype(np.float32)
    den = w[0] * sums[0]
    for b in range(1, len(sums)):
        den += w[b] * sums[b]
    if not half:
        num = w[0] * pvs[0]
        for b in range(1, len(pvs)):
            num += w[b] * pvs[b]
        return num / den
    wh = saturate_round_half(w)
    num = saturate_round_half(wh[0] * pvs[0])
    for b in range(1, len(pvs)):
        num += saturate_round_half(wh[b] * pvs[b])
        saturate_round_half(num)
    return num * (np.float32(1) / den)


def causal_allowed(sq: int, sk: int) -> np.ndarray:
    """Key j is allowed for query i iff j <= i + sk - sq (the reference's tril offset)."""
    return np.tril(np.ones((sq, sk), bool), k=sk - sq)


def group_of(attrs) -> int:
    """The half-partials group an Attention node's mark asks for (0: float partials)."""
    return int(attrs.get("group", 0)) if attrs.get("partials") == "half" else 0

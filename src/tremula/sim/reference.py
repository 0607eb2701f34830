"""The precision-matched reference: the graph as planned, evaluated with the Program's accumulation order and types.

The float32 reference answers "how accurate is fp16/fp8?"; it cannot answer "did the simulator run the right
Program?", because a 4-byte shift moves an fp16 output less than fp16 rounding does. This reference evaluates the
planned graph (half tensors, FP8 casts and quarter matmuls) with the interpreter's rules, which already accumulate as
the codelets do (half products in float32, quarter products in half after every group of K), except where the plan
changes the arithmetic (the compile's `split_sums`: each split sum and its cuts, as the planner made them):
- a Linear whose K is split over pk tiles sums pk partials (float32 for half inputs, half values for the quarter AMP)
  in float32 and rounds once, as `matmul_partial` / `matmul_fp8` + `reduce_partials` do;
- a LayerNorm kept in place on nc column blocks combines per-block (mean, M2) moments (`layernorm_moments`,
  `layernorm_apply`);
- an attention with keys split in nk blocks stores each block's unnormalised p @ v in the attention's dtype and
  combines the blocks (`attention_partial`, `attention_combine`; numerics/attention.combine_blocks: in half with half
  partials, else in float32); each block's scores, exponentials and p @ v are numerics/attention.py's, in half with
  half partials as the whole-head rule's.
Each override repeats its codelets' formulas on the whole tensor (the codelets work on one tile's block of rows, and
every formula here is per row, so the blocking of rows does not change a value).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import pairwise

import numpy as np

from tremula.ir.graph import Graph, Node
from tremula.ir.interp import run
from tremula.ir.ops import RefRule
from tremula.numerics.amp import half_partial_sums, saturate_round_half
from tremula.numerics.jit import add_round_half

SplitSums = Mapping[str, tuple[str, tuple[int, ...]]]  # node output -> ("k" | "columns" | "keys", cuts): plan/state.py


MatMulFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _mm32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Half or float32 operands multiplied and summed in float32, as the codelets do (BLAS picks the order)."""
    acc = np.float32 if a.dtype == np.float16 else a.dtype
    return np.matmul(a.astype(acc, copy=False), b.astype(acc, copy=False))


def _mm64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The same products summed in float64 and rounded once to float32: another legal order of the float32 sums."""
    acc = np.float32 if a.dtype == np.float16 else a.dtype
    return np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(acc)


def _mm_reversed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The same products summed in float32 with K reversed: a third legal order."""
    acc = np.float32 if a.dtype == np.float16 else a.dtype
    return np.matmul(np.ascontiguousarray(a[..., ::-1]).astype(acc), np.ascontiguousarray(b[..., ::-1, :]).astype(acc))


REORDERINGS: dict[str, MatMulFn] = {"float64": _mm64, "reversed": _mm_reversed}


def _widened(mm: MatMulFn) -> MatMulFn:
    """mm for rules that widen half operands themselves (numerics/amp, numerics/attention): _mm32 is then np.matmul,
    which those rules take for the codelets' own group sums (exact with amp.EXACT_GROUP_SUMS, as the codelets')."""
    return np.matmul if mm is _mm32 else mm


def _split_k_ref(op: str, cuts: tuple[int, ...], attrs: Mapping, mm: MatMulFn = _mm32) -> RefRule:
    """x @ w (+ b) as K-part partials (K cut at `cuts`) summed in float32 in part order, rounded to the output dtype,
    then the bias."""

    def ref(xs, a):
        x, w = xs[0], xs[1]
        half = a.get("partials") == "half"  # (passes/precision.with_partials)
        if op == "LinearFp8":
            from tremula.numerics.fp8 import amp_fp8_matmul, code_bytes, fp8_format

            ws = int(xs[2].reshape(-1)[0])
            xf, wf, x, w = fp8_format(x.dtype), fp8_format(w.dtype), code_bytes(x), code_bytes(w)
            parts = [amp_fp8_matmul(x[..., a0:a1], w[a0:a1], xf, wf, int(a["x_scale"]), ws, int(a["group"]))
                     for a0, a1 in pairwise(cuts)]
            bias, out_dt = (xs[3] if len(xs) > 3 else None), np.dtype(np.float16)
        else:
            acc = np.float32 if x.dtype == np.float16 else x.dtype
            xa, wa = x.astype(acc, copy=False), w.astype(acc, copy=False)  # (once, not once per part)
            if half and x.dtype == np.float16:  # each part in half partials (matmul_partial with its group)
                parts = (half_partial_sums(xa[..., a0:a1], wa[a0:a1], int(a["group"]), matmul=_widened(mm))
                         for a0, a1 in pairwise(cuts))
            else:
                parts = (mm(xa[..., a0:a1], wa[a0:a1]) for a0, a1 in pairwise(cuts))
            bias, out_dt = (xs[2] if len(xs) > 2 else None), x.dtype
        s = None
        for p in parts:  # in part order (in place: the same sums as s + p, without a copy per part)
            if s is None:
                s = np.array(p, dtype=np.float32)
            elif not (half and add_round_half(s, p)):  # reduce_partials sums half partials in half
                s += p
                if half:
                    saturate_round_half(s)
        y = s.astype(out_dt, copy=False)
        if bias is not None:
            y = (y + bias.astype(out_dt)).astype(out_dt)  # reduce_partials / matmul add the bias in the output dtype
        return [y]

    return ref


def _ln_blocks_ref(cuts: tuple[int, ...]) -> RefRule:
    """LayerNorm from the moments of the column blocks between `cuts`, combined in part order (codelets/norm.py
    _ln_apply)."""

    def ref(xs, a):
        x, g = xs[0], xs[1]
        b = xs[2] if len(xs) > 2 else None
        cols = x.shape[-1]
        acc = x.astype(np.float32)
        mus, m2s = [], []
        for c0, c1 in pairwise(cuts):
            blk = acc[..., c0:c1]
            mu = blk.mean(axis=-1, keepdims=True)
            mus.append(mu)
            m2s.append(((blk - mu) ** 2).sum(axis=-1, keepdims=True))
        mu_p, m2_p = np.stack(mus), np.stack(m2s)  # [parts, ..., 1]
        n = np.diff(cuts).astype(np.float32).reshape((-1,) + (1,) * (mu_p.ndim - 1))
        mean = (n * mu_p).sum(axis=0) / np.float32(cols)
        var = (m2_p + n * (mu_p - mean) ** 2).sum(axis=0) / np.float32(cols)
        eps = np.float32(a.get("epsilon", 1e-5))
        y = (acc - mean) / np.sqrt(var + eps) * g.astype(np.float32)
        if b is not None:
            y = y + b.astype(np.float32)
        return [y.astype(x.dtype)]

    return ref


def _attention_ref(mm: MatMulFn) -> RefRule:
    """The interpreter's Attention (ir/ops.py) with the matmuls' sums in mm's order."""
    from tremula.ir.ops import _attention_ref as rule

    return lambda xs, a: rule(xs, a, mm)


def _key_split_ref(cuts: tuple[int, ...], mm: MatMulFn = _mm32) -> RefRule:
    """Attention over the key blocks between `cuts`: per block p @ v (stored in the attention's dtype), row max and row
    sum; combined as codelets/attention.py's _attention_combine does (numerics/attention.combine_blocks)."""

    from tremula.numerics.attention import (causal_allowed, combine_blocks, exp_shifted, group_of, scores,
                                            weighted_values)

    mm = _widened(mm)

    def ref(xs, a):
        q, k, v = xs[:3]
        mask = xs[3] if len(xs) > 3 else None
        sq, sk = q.shape[-2], k.shape[-2]
        group = group_of(a)
        pvs, tops, sums = [], [], []
        for k0, k1 in pairwise(cuts):
            allowed = causal_allowed(sq, sk)[:, k0:k1] if a.get("causal", 0) else None
            m = None if mask is None else mask[..., k0:k1] if mask.shape[-1] == sk else mask
            s = scores(q, k[..., k0:k1, :], a["scale"], m, allowed, group, mm)
            p, top, total = exp_shifted(s, bool(group))
            pvs.append(weighted_values(p, v[..., k0:k1, :], group, mm).astype(q.dtype).astype(np.float32))
            tops.append(top.astype(np.float32))
            sums.append(total.astype(np.float32))
        return [combine_blocks(pvs, tops, sums, bool(group)).astype(q.dtype)]

    return ref


def matched_reference(planned: Graph, split_sums: SplitSums, feeds: dict[str, np.ndarray],
                      reorder: str | None = None) -> dict[str, np.ndarray]:
    """The outputs of the planned graph on `feeds`, rounded and accumulated as the Program computes them.

    The order of a float32 sum is not part of the Program: NumPy's BLAS picks it from the block's shape (a
    [8, 768] @ [768, 48] block and the same rows of the whole product can differ in the last bit), so the simulator
    and this reference agree exactly only while no sum is long enough for the order to matter. `reorder` (a key of
    REORDERINGS) sums every float matmul in another legal order instead: how far that moves the outputs measures how
    far such reorderings move them for this model and input (`check_model` sets its tolerance from the largest)."""
    mm = REORDERINGS[reorder] if reorder else _mm32

    def cuts(node: Node, what: str) -> tuple[int, ...] | None:
        kind, at = split_sums.get(node.outputs[0], ("", ()))  # by the node's output: node names need not be unique
        return at if kind == what else None

    def override(node: Node) -> RefRule | None:
        if node.op == "LayerNorm" and cuts(node, "columns"):
            return _ln_blocks_ref(cuts(node, "columns"))
        if node.op == "Attention":
            keys = cuts(node, "keys")
            return _key_split_ref(keys, mm) if keys else (_attention_ref(mm) if reorder else None)
        w = node.inputs[1] if len(node.inputs) > 1 else None
        const_w = w in planned.constants and len(planned.types[w].shape) == 2
        k = cuts(node, "k")
        if node.op in ("Linear", "MatMul", "LinearFp8") and const_w and (k or reorder):
            if node.op == "LinearFp8" and not k:
                return None  # quarter products are exact in float32: no order to vary
            return _split_k_ref(node.op, k or (0, planned.types[w].shape[0]), node.attrs, mm)
        if node.op == "MatMul" and reorder:  # activation x activation products
            return lambda xs, a: [mm(xs[0], xs[1]).astype(xs[0].dtype)]
        return None

    return run(planned, feeds, override=override)

"""Attention fusion: softmax(q @ kᵀ · scale [masked]) @ v  ->  Attention(q, k, v[, mask], scale, causal).

On [B, H, S, d] operands, or on [B*H, S, d] ones as torch's MultiheadAttention writes them: those become one sample of
B*H heads (Reshapes around the Attention), which passes/fuse_heads.py turns back into B samples of H heads.

Accepted between the score MatMul and Softmax(-1), in this order: a scale (Mul/Div by a scalar after the MatMul, or
√scale Muls on q and on kᵀ/k before it, as torch's SDPA decomposition writes it), a Where with a constant boolean
condition and a very negative fill, and an Add of a mask. A mask (additive or Where) that is exactly the causal
triangle becomes causal=1; other constant Where masks become an additive constant; other additive masks stay inputs.
"""

from __future__ import annotations

import numpy as np

from tremula.ir.graph import Graph, Node
from tremula.ir.ops import transpose_perm
from tremula.passes.pattern import Rewriter

# A fill this negative gives exp(score + fill) == 0 exactly in float32 for any sane score, the same as -inf, so the
# causal flag (which uses -inf) computes the same softmax. HF uses finfo(float32).min; old BERT's -10000 does not
# qualify and stays an additive mask.
MASKED = -1e9


def fuse_attention(graph: Graph) -> Graph:
    rw = Rewriter(graph)
    for tail in list(rw.g.nodes):
        if tail.op == "MatMul" and rw.free(tail):
            _match(rw, tail)
    return rw.result()


def _peel_scalar(rw: Rewriter, value: str, reader: Node) -> tuple[str, float, list[Node]]:
    """value = inner · s (Mul or Div by a scalar constant, read only by `reader`) -> (inner, s, [node])."""
    n = rw.prod(value, "Mul", "Div")
    if n is not None and rw.private(value, reader):
        for a, c in ([(n.inputs[0], n.inputs[1])] if n.op == "Div" else rw.operands(n)):
            s = rw.scalar(c)
            if s is not None and s != 0 and rw.g.types[a].shape == rw.g.types[value].shape:
                return a, (1.0 / s if n.op == "Div" else s), [n]
    return value, 1.0, []


def _causal(mask: np.ndarray, sq: int, sk: int) -> bool:
    """True if the additive mask (broadcast to [..., sq, sk]) is 0 on the causal triangle and very negative above."""
    if mask.ndim < 2 or mask.shape[-2:] != (sq, sk):
        return False
    allowed = np.tril(np.ones((sq, sk), bool), k=sk - sq)
    m = mask.reshape(-1, sq, sk)
    return bool(np.all(m[:, allowed] == 0) and np.all(m[:, ~allowed] <= MASKED))


def _softmax(rw: Rewriter, p: str, tail: Node) -> list[Node]:
    """[Softmax] or, as torch's SDPA decomposition writes it, [Softmax, IsNaN, Where(isnan, 0, softmax)]: the guard
    for rows that are all masked, which tremula's Softmax already maps to zeros."""
    guard = rw.prod(p, "Where")
    if guard is not None and rw.private(p, tail) and rw.is_zero(guard.inputs[1]):
        probs = guard.inputs[2]
        sm = rw.prod(probs, "Softmax")
        isnan = _isnan_of(rw, guard.inputs[0], probs, guard)
        if sm is not None and isnan and all(rw.private(o, *isnan, guard) for o in [probs, *isnan[0].outputs]):
            return [sm, *isnan, guard]
    sm = rw.prod(p, "Softmax")
    return [sm] if sm is not None and rw.private(p, tail) else []


def _isnan_of(rw: Rewriter, cond: str, x: str, reader: Node) -> list[Node]:
    """The nodes computing IsNaN(x): the op itself, or Not(Equal(x, x)) as the ONNX importer writes it."""
    n = rw.prod(cond, "IsNaN", "Not")
    if n is None or not rw.private(cond, reader):
        return []
    if n.op == "IsNaN":
        return [n] if n.inputs[0] == x else []
    eq = rw.prod(n.inputs[0], "Equal")
    return [n, eq] if eq is not None and eq.inputs == [x, x] and rw.private(eq.outputs[0], n) else []


def _match(rw: Rewriter, tail: Node) -> bool:
    p, v = tail.inputs
    body: list[Node] = _softmax(rw, p, tail)
    if not body:
        return False
    sm = body[0]
    s = sm.inputs[0]
    ts = rw.g.types[s]
    rank = len(ts.shape)
    if rank not in (3, 4) or sm.attrs.get("axis", -1) % rank != rank - 1 or not ts.dtype.startswith("float"):
        return False
    reader = sm
    # Optional additive mask: try each operand as the scores branch.
    mask = None
    add = rw.prod(s, "Add")
    if add is not None and rw.private(s, sm):
        for a, m in rw.operands(add):
            if _scores(rw, a, add) is not None and rw.g.types[a].shape == ts.shape:
                s, mask, reader = a, m, add
                body.append(add)
                break
    found = _scores(rw, s, reader)
    if found is None:
        return False
    q, kt, scale, where_mask, causal, nodes = found
    if any(len(rw.g.types[x].shape) != rank for x in (q, kt, v)):  # a kᵀ the MatMul broadcasts: not one k a head
        return False
    body += nodes
    new_nodes: list[Node] = []
    if rank == 3:  # [B*H, S, d] (torch's MultiheadAttention): attention over B*H heads of one sample
        new_nodes = [rw.node("Reshape", [x], name=f"{tail.name}_{t}4", shape=(1, *rw.g.types[x].shape))
                     for x, t in ((q, "q"), (kt, "kt"), (v, "v"))]
        q, kt, v = (n.outputs[0] for n in new_nodes)
        if where_mask is not None:
            where_mask = where_mask.reshape((1,) * (4 - where_mask.ndim) + where_mask.shape)
    sq, sk = ts.shape[-2:]
    if mask is not None and mask in rw.g.constants and rw.g.constants[mask].data is not None:
        m = rw.g.constants[mask].data
        if _causal(m, sq, sk) and not causal:
            mask, causal = None, 1
        elif not np.any(m):  # an all-zero mask (SDPA's "no mask") adds nothing
            mask = None
    if mask is not None and where_mask is not None:
        return False  # two masks would need an extra Add; rare enough to leave unfused
    k, perm, k_nodes, k_reader = _untranspose(rw, kt, body)
    if k_nodes:  # only this attention reads kᵀ: its transposes go, and a √scale under them too
        body += k_nodes
        k, ks, kn = _peel_scalar(rw, k, k_reader)
        scale, body = scale * ks, body + kn
    if perm is not None:
        t = rw.node("Transpose", [k], name=f"{tail.name}_k", perm=tuple(perm))
        new_nodes.append(t)
        k = t.outputs[0]
    tq, tk, tv = (rw.g.types[n] for n in (q, k, v))
    if not (len(tq.shape) == len(tv.shape) == 4 and tq.shape[:2] == tk.shape[:2] == tv.shape[:2]):
        return False
    if not all(rw.private(o, *body, tail) for n in body for o in n.outputs):
        return False
    if where_mask is not None:
        mask = rw.constant(f"{tail.outputs[0]}_mask", where_mask)
    if mask is not None and rank == 3:
        mshape = rw.g.types[mask].shape
        mask = rw.node("Reshape", [mask], name=f"{tail.name}_mask4", shape=(1,) * (4 - len(mshape)) + mshape)
        new_nodes.append(mask)
        mask = mask.outputs[0]
    ins = [q, k, v] + ([mask] if mask is not None else [])
    out = tail.outputs if rank == 4 else None
    attn = rw.node("Attention", ins, out, tail.name, scale=float(scale), causal=int(causal))
    new_nodes.append(attn)
    if rank == 3:
        new_nodes.append(rw.node("Reshape", attn.outputs, tail.outputs, f"{tail.name}_3",
                                 shape=rw.g.types[tail.outputs[0]].shape))
    return rw.replace(tail, body, new_nodes)


def _untranspose(
    rw: Rewriter, kt: str, body: list[Node]
) -> tuple[str, list[int] | None, list[Node], Node | None]:
    """k, with kᵀ = k with its last two axes swapped: (source, perm to apply to it or None, nodes that go, the first).

    kᵀ may come from one Transpose (composed with the swap into one perm), from a chain of Reshapes and Transposes
    that amounts to the swap (SDPA's reshape to [B·H, S, D], transpose, reshape back; checked on an index array), or
    from anything else (then a Transpose is added).
    """
    tr = rw.prod(kt, "Transpose")
    if tr is not None and len(rw.g.types[tr.inputs[0]].shape) == 4:
        p = transpose_perm(tr.attrs, 4)
        perm = [p[i] for i in (0, 1, 3, 2)]
        nodes = [tr] if rw.private(kt, *body) else []
        return tr.inputs[0], (None if perm == [0, 1, 2, 3] else perm), nodes, tr
    b, h, d, s = rw.g.types[kt].shape
    chain: list[Node] = []
    v = kt
    for _ in range(4):
        n = rw.prod(v, "Reshape", "Transpose")
        if n is None:
            break
        chain.insert(0, n)
        v = n.inputs[0]
        if rw.g.types[v].shape == (b, h, s, d) and _is_swap(rw, chain):
            private = all(rw.private(n.outputs[0], *chain, *body) for n in chain)
            return v, None, (chain if private else []), chain[0]
    return kt, [0, 1, 3, 2], [], None


def _is_swap(rw: Rewriter, chain: list[Node]) -> bool:
    """True if applying the Reshape/Transpose chain to a [B, H, S, D] tensor swaps its last two axes."""
    shape = rw.g.types[chain[0].inputs[0]].shape
    x = np.arange(int(np.prod(shape))).reshape(shape)
    y = x
    for n in chain:
        y = y.reshape(n.attrs["shape"]) if n.op == "Reshape" else np.transpose(y, transpose_perm(n.attrs, y.ndim))
    return y.shape == x.shape[:2] + x.shape[:1:-1] and np.array_equal(y, np.swapaxes(x, -1, -2))


def _scores(rw: Rewriter, s: str, reader: Node):
    """Match s = [Where(cond, ·, fill)] ∘ [scale] ∘ MatMul(q·√a, kᵀ·√b).

    Returns (q, kᵀ, scale, the Where as an additive mask array or None, causal, nodes) or None. Creates nothing.
    """
    nodes: list[Node] = []
    where_mask, causal = None, 0
    wh = rw.prod(s, "Where")
    if wh is not None and rw.private(s, reader):
        cond, a, b = wh.inputs
        cc = rw.const(cond)
        for keep_if, scores, fill in ((True, a, b), (False, b, a)):
            f = rw.scalar(fill)
            if cc is None or cc.data is None or cc.type.dtype != "bool" or f is None or f > MASKED:
                continue
            if rw.g.types[scores].shape != rw.g.types[s].shape:
                continue
            allowed = cc.data if keep_if else ~cc.data
            sq, sk = rw.g.types[s].shape[-2:]
            tri = np.tril(np.ones((sq, sk), bool), k=sk - sq)
            if allowed.shape[-2:] == (sq, sk) and np.all(allowed.reshape(-1, sq, sk) == tri):
                causal = 1
            else:
                where_mask = np.where(allowed, 0.0, f).astype(rw.g.types[s].dtype)
            nodes.append(wh)
            reader, s = wh, scores
            break
    inner, scale, scale_nodes = _peel_scalar(rw, s, reader)
    mm = rw.prod(inner, "MatMul")
    if mm is None or not rw.private(inner, *(scale_nodes or [reader])):
        return None
    nodes += scale_nodes + [mm]
    q, qs, qn = _peel_scalar(rw, mm.inputs[0], mm)
    kt, ks, kn = _peel_scalar(rw, mm.inputs[1], mm)
    return q, kt, scale * qs * ks, where_mask, causal, nodes + qn + kn

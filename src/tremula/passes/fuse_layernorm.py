"""LayerNorm fusion: (x - mean(x)) / sqrt(mean((x - mean(x))²) + eps) [· gamma] [+ beta] over the last axis."""

from __future__ import annotations

import numpy as np

from tremula.ir.graph import Graph, Node
from tremula.passes.pattern import Rewriter, last_axis


def fuse_layernorm(graph: Graph) -> Graph:
    rw = Rewriter(graph)
    for norm in list(rw.g.nodes):
        if norm.op in ("Div", "Mul") and rw.free(norm):
            _match(rw, norm)
    return rw.result()


def _mean_last(rw: Rewriter, value: str) -> Node | None:
    """ReduceMean over exactly the last axis, keeping dims (so it broadcasts back against its input)."""
    rm = rw.prod(value, "ReduceMean")
    if rm is None or not rm.attrs.get("keepdims", 1):
        return None
    return rm if last_axis(rm.attrs.get("axes"), len(rw.g.types[rm.inputs[0]].shape)) else None


def _root(rw: Rewriter, value: str, inverse: bool) -> list[Node]:
    """The nodes computing value = (v)^(-1/2) if inverse else (v)^(1/2): Sqrt, Pow 0.5, Reciprocal(Sqrt), Pow -0.5.
    The first node returned reads v."""
    n = rw.prod(value, "Sqrt", "Pow", "Reciprocal")
    if n is None:
        return []
    if n.op == "Pow":
        return [n] if rw.is_scalar(n.inputs[1], -0.5 if inverse else 0.5) else []
    if n.op == "Sqrt":
        return [] if inverse else [n]
    if not inverse:
        return []
    inner = _root(rw, n.inputs[0], inverse=False)
    return inner + [n] if inner else []


def _match(rw: Rewriter, norm: Node) -> bool:
    # norm = xc / sqrt(var + eps)  or  xc * reciprocal(sqrt(var + eps)), with Pow ±0.5 for the roots
    for xc, den in ([(norm.inputs[0], norm.inputs[1])] if norm.op == "Div" else rw.operands(norm)):
        root = _root(rw, den, inverse=norm.op == "Mul")
        add_eps = rw.prod(root[0].inputs[0], "Add") if root else None
        if add_eps is None:
            continue
        for var, eps in rw.operands(add_eps):
            epsilon = rw.scalar(eps)
            var_rm = _mean_last(rw, var)
            if epsilon is None or var_rm is None:
                continue
            sq = rw.prod(var_rm.inputs[0], "Pow", "Mul")
            if sq is None or sq.inputs[0] != xc:
                continue
            if not (sq.inputs[1] == xc if sq.op == "Mul" else rw.is_scalar(sq.inputs[1], 2.0)):
                continue
            sub = rw.prod(xc, "Sub")
            if sub is None:
                continue
            x, mean = sub.inputs
            mean_rm = _mean_last(rw, mean)
            if mean_rm is None or mean_rm.inputs[0] != x:
                continue
            core = [mean_rm, sub, sq, var_rm, add_eps, *root]
            return _finish(rw, norm, core, x, epsilon)
    return False


def _finish(rw: Rewriter, norm: Node, core: list[Node], x: str, epsilon: float) -> bool:
    """Extend the match through an optional Mul(gamma) and Add(beta), check privacy, and replace."""
    tx = rw.g.types[x]
    d = tx.shape[-1]
    if not tx.dtype.startswith("float") or rw.g.types[norm.outputs[0]].shape != tx.shape:
        return False
    tail, gamma, beta = norm, None, None
    for op in ("Mul", "Add"):
        y = tail.outputs[0]
        users = rw.users.get(y, [])
        if len(users) != 1 or users[0].op != op or not rw.private(y, users[0]) or not rw.free(users[0]):
            continue
        nxt = users[0]
        vec = rw.vector(nxt.inputs[1] if nxt.inputs[0] == y else nxt.inputs[0], d)
        if vec is None or rw.g.types[nxt.outputs[0]].shape != tx.shape:
            continue
        if op == "Mul":
            gamma = vec
        else:
            beta = vec
        core.append(tail)
        tail = nxt
    body = core
    if not all(rw.private(o, *body, tail) for n in body for o in n.outputs):
        return False
    if gamma is None:
        gamma = rw.constant(f"{tail.outputs[0]}_gamma", np.ones(d, tx.dtype))
    ins = [x, gamma] + ([beta] if beta else [])
    return rw.replace(tail, body, [rw.node("LayerNorm", ins, tail.outputs, tail.name, epsilon=epsilon)])

"""Projections of one input fused: Linear(x, Wq, bq), Linear(x, Wk, bk), Linear(x, Wv, bv) become one
Linear(x, [Wq | Wk | Wv], [bq | bk | bv]) followed by a Split of its output columns.

Why: each separate projection gathers its own copy of x onto its tiles, so attention's input crossed the exchange
three times; the fused one gathers it once, and its bigger output blocks keep the AMP busier. PopRT runs SigLIP
so400m's QKV as one matmul, and the custom C600 stack's first planner lesson is the same (ipu-stack-facts §5.1). The
planner cuts the fused output's columns at the Split's points (and the heads' within them), so the Split moves no
data: its outputs are column blocks of the fused layout (plan/lower_linear.py, plan/lower_move.py).

Only projections of equal width are fused (attention's Q, K, V; gate and up projections): the planner's even column
cuts then fall on the Split's points. The joined weights stay lazy (ir/graph.ConcatInit).
"""

from __future__ import annotations

from tremula.ir.graph import ConcatInit, Constant, Graph, Node, TensorType


def fuse_qkv(graph: Graph) -> Graph:
    g = graph.copy()
    groups: dict[tuple, list[Node]] = {}
    for n in g.nodes:
        key = _key(g, n)
        if key is not None:
            groups.setdefault(key, []).append(n)
    fused: dict[int, list[Node]] = {}  # id of a group's first node -> the nodes that replace the group
    gone: set[int] = set()
    for members in groups.values():
        if len(members) < 2:
            continue
        fused[id(members[0])] = _fuse(g, members)
        gone |= {id(m) for m in members[1:]}
    if not fused:
        return graph
    nodes: list[Node] = []
    for n in g.nodes:
        if id(n) in fused:
            nodes.extend(fused[id(n)])
        elif id(n) not in gone:
            nodes.append(n)
    g.nodes = nodes
    return g


def _key(g: Graph, n: Node) -> tuple | None:
    """What projections must share to be fused: the input, the weight's rows, width and dtype, having a bias, the
    attributes; None for a node that is not such a projection."""
    if n.op != "Linear" or n.inputs[0] in g.constants:
        return None
    w = g.constants.get(n.inputs[1])
    b = g.constants.get(n.inputs[2]) if len(n.inputs) > 2 and n.inputs[2] else None
    if w is None or len(w.type.shape) != 2 or (len(n.inputs) > 2 and n.inputs[2] and b is None):
        return None
    if b is not None and b.type.shape != (w.type.shape[1],):
        return None
    return (n.inputs[0], w.type.shape, w.type.dtype, None if b is None else b.type.dtype,
            tuple(sorted((k, repr(v)) for k, v in n.attrs.items())))


def _joined(g: Graph, parts: list[str], axis: int, base: str, what: str) -> str:
    cs = [g.constants[p] for p in parts]
    shape = list(cs[0].type.shape)
    shape[axis] = sum(c.type.shape[axis] for c in cs)
    t = TensorType(tuple(shape), cs[0].type.dtype)
    name = g.fresh_name(base)
    g.constants[name] = Constant(name, t, init=ConcatInit(tuple(cs), axis, f"{what} of {', '.join(parts)}"))
    g.types[name] = t
    return name


def _fuse(g: Graph, members: list[Node]) -> list[Node]:
    first = members[0]
    name = first.name or first.outputs[0]
    w = _joined(g, [m.inputs[1] for m in members], 1, f"{name}.fused_weight", "fused projection weights")
    ins = [first.inputs[0], w]
    if len(first.inputs) > 2 and first.inputs[2]:
        ins.append(_joined(g, [m.inputs[2] for m in members], 0, f"{name}.fused_bias", "fused projection biases"))
    out = g.fresh_name(f"{name}.fused")
    widths = [g.types[m.outputs[0]].shape[-1] for m in members]
    t = g.types[first.outputs[0]]
    g.types[out] = TensorType(t.shape[:-1] + (sum(widths),), t.dtype)
    linear = Node("Linear", ins, [out], dict(first.attrs), f"{name}.fused")
    split = Node("Split", [out], [m.outputs[0] for m in members], {"axis": len(t.shape) - 1, "sizes": widths},
                 f"{name}.split")
    return [linear, split]

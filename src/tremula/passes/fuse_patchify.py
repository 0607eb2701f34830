"""Patch-embedding fusion: Conv with stride = kernel, no padding, group 1 becomes Patchify + Linear.

The usual tail Conv -> Reshape [B, O, N] -> Transpose(0, 2, 1) collapses to Patchify + Linear giving [B, N, O]
directly; a Conv whose NCHW output is read otherwise gets a Transpose + Reshape back to NCHW.
"""

from __future__ import annotations

from tremula.ir.graph import Graph, Node
from tremula.passes.pattern import Rewriter


def fuse_patchify(graph: Graph) -> Graph:
    rw = Rewriter(graph)
    for conv in list(rw.g.nodes):
        if conv.op == "Conv" and rw.free(conv):
            _match(rw, conv)
    return rw.result()


def _match(rw: Rewriter, conv: Node) -> bool:
    x, w = conv.inputs[0], conv.inputs[1]
    bias = conv.inputs[2] if len(conv.inputs) > 2 and conv.inputs[2] else None
    wc = rw.const(w)
    if wc is None or len(wc.type.shape) != 4:
        return False
    o, c, kh, kw = wc.type.shape
    a = conv.attrs
    if (tuple(a.get("strides", (1, 1))) != (kh, kw) or any(a.get("pads", (0, 0, 0, 0)))
            or tuple(a.get("dilations", (1, 1))) != (1, 1) or a.get("group", 1) != 1):
        return False
    if bias is not None and (bias not in rw.g.constants or rw.g.types[bias].shape != (o,)):
        return False
    y = conv.outputs[0]
    b, _, gh, gw = rw.g.types[y].shape
    nodes: list[Node] = []
    if wc.data is not None:
        w2 = rw.constant(f"{w}_linear", wc.data.reshape(o, c * kh * kw).T)
    else:  # a lazy weight stays lazy: the reshape and transpose on it fold to a lazy constant (fold.py)
        r = rw.node("Reshape", [w], name=f"{conv.name}_w", shape=(o, c * kh * kw))
        t = rw.node("Transpose", [r.outputs[0]], name=f"{conv.name}_wt", perm=(1, 0))
        nodes += [r, t]
        w2 = t.outputs[0]
    patches = rw.node("Patchify", [x], name=f"{conv.name}_patches", patch=(kh, kw))
    lin_ins = [patches.outputs[0], w2] + ([bias] if bias else [])
    # The common tail: Reshape to [B, O, N] then Transpose(0, 2, 1) is exactly Linear's [B, N, O].
    rs = _only_user(rw, y, "Reshape")
    if rs is not None and tuple(rs.attrs["shape"]) == (b, o, gh * gw):
        tr = _only_user(rw, rs.outputs[0], "Transpose")
        if tr is not None and tuple(tr.attrs.get("perm") or ()) == (0, 2, 1):
            lin = rw.node("Linear", lin_ins, tr.outputs, name=tr.name)
            return rw.replace(tr, [conv, rs], [*nodes, patches, lin])
    lin = rw.node("Linear", lin_ins, name=f"{conv.name}_linear")
    back = rw.node("Transpose", lin.outputs, name=f"{conv.name}_nchw", perm=(0, 2, 1))
    shaped = rw.node("Reshape", back.outputs, conv.outputs, name=conv.name, shape=(b, o, gh, gw))
    return rw.replace(conv, [], [*nodes, patches, lin, back, shaped])


def _only_user(rw: Rewriter, value: str, op: str) -> Node | None:
    users = rw.users.get(value, [])
    if len(users) == 1 and users[0].op == op and rw.private(value, users[0]) and rw.free(users[0]):
        return users[0]
    return None

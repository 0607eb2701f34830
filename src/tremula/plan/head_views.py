"""Head views: the Reshape + Transpose pairs around a fused Attention that split a projection's [B*S, H*d] output
into heads and merge attention's heads back, recognised so attention reads and writes the projections' layouts in
place (plan/lower_attention.py) and the pairs move no data of their own."""

from __future__ import annotations

from dataclasses import dataclass

from tremula.ir.graph import Graph
from tremula.plan.layout import view2d

HEAD_PERM = (0, 2, 1, 3)  # [B, S, H, d] <-> [B, H, S, d]


@dataclass(frozen=True)
class HeadView:
    """A [B, H, S, d] attention operand or result that is a Reshape + Transpose of the [B*S, H*d] matrix `value`."""
    value: str
    heads: int
    seq: int
    dim: int


def _single(consumers, graph: Graph, value: str, op: str):
    users = consumers.get(value, [])
    if len(users) == 1 and users[0].op == op and value not in graph.outputs:
        return users[0]
    return None


def head_views(graph: Graph) -> tuple[dict[str, HeadView], dict[str, HeadView], set[str]]:
    """(attention operand -> its view, attention output -> its view, outputs of the Reshape/Transpose nodes the views
    replace). An operand qualifies when it is Transpose(HEAD_PERM) of Reshape([B, S, H, d]) of a [.., H*d] value with
    no other readers; an output when its only reader is Transpose(HEAD_PERM) then Reshape back to [.., H*dv]."""
    consumers, producers, types = graph.consumers(), graph.producers(), graph.types
    ins: dict[str, HeadView] = {}
    outs: dict[str, HeadView] = {}
    skip: set[str] = set()
    for node in graph.nodes:
        if node.op != "Attention":
            continue
        for x in [i for i in node.inputs[:3] if i]:
            tr = producers.get(x)
            if x in ins or tr is None or tr.op != "Transpose" or tuple(tr.attrs.get("perm", ())) != HEAD_PERM:
                continue
            if not all(c.op == "Attention" for c in consumers.get(x, [])) or x in graph.outputs:
                continue
            rs = producers.get(tr.inputs[0])
            if rs is None or rs.op != "Reshape" or _single(consumers, graph, tr.inputs[0], "Transpose") is None:
                continue
            src = rs.inputs[0]
            b, s, h, d = types[tr.inputs[0]].shape
            if src in graph.constants or view2d(types[src].shape) != (b * s, h * d):
                continue
            ins[x] = HeadView(src, h, s, d)
            skip |= {tr.inputs[0], x}
        out = node.outputs[0]
        tr = _single(consumers, graph, out, "Transpose")
        if tr is None or tuple(tr.attrs.get("perm", ())) != HEAD_PERM:
            continue
        rs = _single(consumers, graph, tr.outputs[0], "Reshape")
        b, h, s, dv = types[out].shape
        if rs is None or view2d(types[rs.outputs[0]].shape) != (b * s, h * dv):
            continue
        outs[out] = HeadView(rs.outputs[0], h, s, dv)
        skip |= {tr.outputs[0], rs.outputs[0]}
    return ins, outs, skip


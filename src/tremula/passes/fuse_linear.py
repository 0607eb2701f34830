"""matmul+bias fusion: MatMul(x, W[K,N] constant) [-> Add(b[N] constant)] becomes Linear(x, W[, b]).

Also drops the Reshape sandwich torch writes around Gemm (x[B,S,K] -> [B·S,K] -> Linear -> [B·S,N] -> [B,S,N]):
Linear takes any leading dims, so it reads x[B,S,K] and writes [B,S,N] directly.
"""

from __future__ import annotations

from tremula.ir.graph import Graph, Node
from tremula.passes.pattern import Rewriter


def fuse_linear(graph: Graph) -> Graph:
    rw = Rewriter(graph)
    for mm in list(rw.g.nodes):
        if mm.op == "MatMul" and rw.free(mm):
            _match(rw, mm)
    rw = Rewriter(rw.result())
    for lin in list(rw.g.nodes):
        if lin.op == "Linear" and rw.free(lin):
            _unflatten(rw, lin)
    return rw.result()


def _match(rw: Rewriter, mm: Node) -> bool:
    x, w = mm.inputs
    wc = rw.const(w)
    if wc is None or len(wc.type.shape) != 2 or not wc.type.dtype.startswith("float"):
        return False
    y = mm.outputs[0]
    users = rw.users.get(y, [])
    add = users[0] if len(users) == 1 and users[0].op == "Add" and rw.private(y, users[0]) else None
    bias = None
    if add is not None and rw.free(add):
        other = add.inputs[1] if add.inputs[0] == y else add.inputs[0]
        if rw.g.types[add.outputs[0]].shape == rw.g.types[y].shape:  # the bias must not broadcast y up
            bias = rw.vector(other, wc.type.shape[1])
    if bias is not None:
        return rw.replace(add, [mm], [rw.node("Linear", [x, w, bias], add.outputs, name=add.name)])
    return rw.replace(mm, [], [rw.node("Linear", [x, w], mm.outputs, name=mm.name)])


def _unflatten(rw: Rewriter, lin: Node) -> bool:
    """Reshape(x0 -> [M, K]) -> Linear -> Reshape([M, N] -> lead + [N]) with x0 = lead + [K]: Linear on x0."""
    rs_in = rw.prod(lin.inputs[0], "Reshape")
    y = lin.outputs[0]
    users = rw.users.get(y, [])
    if rs_in is None or len(users) != 1 or users[0].op != "Reshape" or not rw.private(y, users[0]):
        return False
    rs_out = users[0]
    x0 = rs_in.inputs[0]
    lead, k = rw.g.types[x0].shape[:-1], rw.g.types[x0].shape[-1:]
    n = rw.g.types[y].shape[-1:]
    if len(lead) == 0 or k != rw.g.types[lin.inputs[0]].shape[-1:] or tuple(rs_out.attrs["shape"]) != lead + n:
        return False
    interior = [rs_in] if rw.private(lin.inputs[0], lin) else []  # the flattened x may have other readers
    fused = rw.node("Linear", [x0, *lin.inputs[1:]], rs_out.outputs, name=lin.name)
    return rw.replace(rs_out, [lin, *interior], [fused])

"""The MatMul rule: a product whose right operand is a 2-D constant is a Linear (plan/lower_linear.py); a product of
two activations runs as batched products, one [m, k] x [k, n] product per tile and as many rounds as the products
need, each tile gathering its two operands whole."""

from __future__ import annotations

import numpy as np

from tremula.errors import TremulaError
from tremula.plan.context import I64, LoweringContext
from tremula.plan.exchange import SymTransfers, gather_elems, gather_rects
from tremula.plan.layout import Layout, reshape_free
from tremula.plan.lower_linear import has_weights, lower_linear
from tremula.plan.strategies import cdiv


def lower_matmul(cx: LoweringContext, node) -> None:
    if has_weights(cx, node):
        return lower_linear(cx, node)
    return lower_batched_matmul(cx, node)


def lower_batched_matmul(cx: LoweringContext, node) -> None:
    a, b = node.inputs
    out = node.outputs[0]
    at, bt, ot = cx.types[a], cx.types[b], cx.types[out]
    if len(at.shape) < 2 or len(bt.shape) < 2:
        raise TremulaError(f"MatMul {node.name}: 1-D operands are not supported by the planner")
    m, k = at.shape[-2:]
    n = bt.shape[-1]
    lead = tuple(ot.shape[:-2])
    nb = int(np.prod(lead, dtype=I64))
    ai = np.broadcast_to(np.arange(int(np.prod(at.shape[:-2], dtype=I64))).reshape(at.shape[:-2]), lead).reshape(-1)
    bi = np.broadcast_to(np.arange(int(np.prod(bt.shape[:-2], dtype=I64))).reshape(bt.shape[:-2]), lead).reshape(-1)
    sa = cx.layout_of(a)
    sb = cx.layout_of(b)
    sa = reshape_free(sa, sa.rows * sa.cols // k, k) or sa
    sb = reshape_free(sb, sb.rows * sb.cols // n, n) or sb
    units = np.arange(nb, dtype=I64)
    tiles_u = units % cx.T
    used = np.unique(tiles_u)
    isz = np.dtype(at.dtype).itemsize
    abuf = cx.new_buffer(f"{a}@{out}", "buffers", used, m * k * isz)
    bbuf = cx.new_buffer(f"{b}@{out}", "buffers", used, k * n * isz)
    lay = cx.alloc_layout(out + "@bmm", nb * m, n, ot.dtype, np.arange(nb + 1) * m, [0, n], tiles_u[:, None])
    for rnd in range(cdiv(nb, cx.T)):
        us = units[rnd * cx.T: (rnd + 1) * cx.T]
        tl = tiles_u[us]
        cx.exchange(SymTransfers.concat([
            _rect_gather(sa, ai[us] * m, ai[us] * m + m, k, tl, abuf),
            _rect_gather(sb, bi[us] * k, bi[us] * k + k, n, tl, bbuf)]))
        ops = [(abuf, 0, m, k), (bbuf, 0, k, n), (lay.buf, lay.rel[us, 0], m, n)]
        cx.compute([cx.group("matmul", (at.dtype, bt.dtype, ot.dtype), tl, [0], ops)], out)
    cx.set_output(out, lay)
    cx.strategies[node.name or out] = f"batched matmul, {nb} products over {len(used)} tiles"


def _rect_gather(src: Layout, r0, r1, cols: int, tl, buf: int) -> SymTransfers:
    """Rows r0:r1 (all columns) of a matrix with `cols` columns into `buf` at offset 0 on tiles tl."""
    if src.cols == cols:
        return gather_rects(src, r0, r1, 0, cols, tl, buf, 0, cols * src.itemsize)
    isz = src.itemsize
    elems = np.concatenate([np.arange(s * cols, e * cols, dtype=I64) for s, e in zip(r0, r1)])
    dt = np.concatenate([np.full((e - s) * cols, t, I64) for s, e, t in zip(r0, r1, tl)])
    dr = np.concatenate([np.arange((e - s) * cols, dtype=I64) * isz for s, e in zip(r0, r1)])
    return gather_elems(src, elems, dt, buf, dr)

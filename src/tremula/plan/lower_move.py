"""The data-movement rule (Reshape, Transpose, Concat, Slice, Split, Expand, Identity, Patchify): each output
element's source from the op's own reference applied to index maps, moved by one exchange; free when the bytes
already lie as the output's layout reads them."""

from __future__ import annotations

import numpy as np

from tremula.ir.graph import Node
from tremula.ir.ops import rule, slice_index_map, transpose_perm
from tremula.plan.context import I64, STRIDE, LoweringContext, _last_axis
from tremula.plan.layout import Layout, reshape_free, view2d


def lower_move(cx: LoweringContext, node) -> None:
    ins = [i for i in node.inputs if i]
    outs = node.outputs
    if node.op == "Split" and _split_free(cx, node):
        return
    in_place = node.op in ("Reshape", "Identity") or _keeps_order(node, cx.types)
    if in_place and ins[0] not in cx.graph.constants:
        rows, cols = view2d(cx.types[outs[0]].shape)
        free = reshape_free(cx.layout_of(ins[0]), rows, cols)
        if free is not None:
            cx.layouts[outs[0]] = free
            cx.strategies[node.name or outs[0]] = f"{node.op} free (same bytes)"
            return
    if node.op == "Slice":  # (its map from the output's size; the generic one is the input's)
        maps = [slice_index_map(cx.types[ins[0]].shape, node.attrs)]
    else:
        args = [np.arange(cx.types[i].size, dtype=I64).reshape(cx.types[i].shape) + k * STRIDE
                for k, i in enumerate(ins)]
        maps = rule(node.op).ref(args, node.attrs)
    srcs = [cx.layout_of(i) for i in ins]
    for o, m in zip(outs, maps):
        t = cx.types[o]
        rows, cols = view2d(t.shape)
        cx.layouts[o] = cx.move_elems(o, srcs, np.asarray(m, I64), rows, cols, t.dtype)
    cx.strategies[node.name or outs[0]] = f"{node.op} exchange"


def _split_free(cx: LoweringContext, node) -> bool:
    """A Split of the last axis whose points are column-block edges of its input's layout: each output is those
    blocks, in place (a fused projection's Q, K and V). False (nothing done) otherwise."""
    x = node.inputs[0]
    if all(o in cx.layouts for o in node.outputs):  # its fused projection made its parts apart
        cx.strategies[node.name or node.outputs[0]] = "Split free (its parts were made apart)"
        return True
    if x in cx.graph.constants or not _last_axis(node, cx.types):
        return False
    src = cx.layout_of(x)
    points = np.concatenate([[0], np.cumsum(node.attrs["sizes"])])
    at = np.searchsorted(src.col_cuts, points)
    if src.cols != points[-1] or (at >= len(src.col_cuts)).any() or not np.array_equal(src.col_cuts[at], points):
        return False
    for o, j0, j1 in zip(node.outputs, at[:-1], at[1:]):
        rows, cols = view2d(cx.types[o].shape)
        part = Layout(rows, cols, src.dtype, src.row_cuts, src.col_cuts[j0: j1 + 1] - src.col_cuts[j0],
                      src.tiles[:, j0:j1], src.rel[:, j0:j1], src.buf)
        cx.layouts[o] = part
    cx.strategies[node.name or node.outputs[0]] = "Split free (column blocks of its input)"
    return True


def _keeps_order(node: Node, types) -> bool:
    """A Transpose that moves only axes of size 1 (a sequence-first [S, 1, D] view of [1, S, D] at batch 1): its
    elements keep their order, so it is a Reshape, in place."""
    if node.op != "Transpose":
        return False
    shape = types[node.inputs[0]].shape
    perm = transpose_perm(node.attrs, len(shape))
    moved = [p for p in perm if shape[p] != 1]
    return moved == sorted(moved)

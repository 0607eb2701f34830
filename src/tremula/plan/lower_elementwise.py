"""The element-wise rule: an op whose output element i reads element i of each (broadcast) input runs where one
of its full-shape inputs lies, block for block, each other operand brought into those blocks."""

from __future__ import annotations

import numpy as np

from tremula.codelets.elementwise import BINARY_IDS, UNARY_IDS
from tremula.codelets.fp8 import format_id
from tremula.plan.context import I64, LoweringContext, is_panels
from tremula.plan.layout import blocks, view2d


def lower_elementwise(cx: LoweringContext, node) -> None:
    out = node.outputs[0]
    ot = cx.types[out]
    rows, cols = view2d(ot.shape)
    lay = None
    ins = list(node.inputs)
    if cx.perm_fraction is not None:  # under a memory budget the residual stream takes the panels' blocks
        ins.sort(key=lambda i: not (i and i in cx.layouts and is_panels(cx.layouts[i])))
    # A broadcast operand with more than one row (a position embedding) arrives in every block one row segment at
    # a time: rows x column blocks transfer entries. Into an embedding lookup's layout (the table's columns over
    # the tiles, one column a block) that was bert-base b128's 12.6 M two-byte entries, a third of its compile
    # time and most of the exchange code that kept its plan from fitting. When moving the input to a row layout
    # and the broadcast by whole rows takes fewer entries, and the rows spread over at least as many tiles (the
    # op loses no parallelism: GPT-2 b4's embedding sum on 78 row blocks instead of 768 column blocks cost 1.2 %
    # of its cycles), the op runs on rows.
    bcast = any(j and cx.types[j].shape != ot.shape and view2d(cx.types[j].shape)[0] > 1
                for j in node.inputs)
    ins = _spread_first(cx, ins, ot.shape)
    for i in ins:
        if i and cx.types[i].shape == ot.shape and i not in cx.graph.constants:
            src = cx.layout_of(i)
            ncb, parts = len(src.col_cuts) - 1, cx.row_parts(rows, cols, ot.dtype)
            if bcast and rows * ncb > ncb * parts + rows and parts >= src.tiles.size:
                continue
            others = [j for j in node.inputs if j and j != i and j not in cx.graph.constants
                      and cx.types[j].shape == ot.shape and not src.same_blocks(cx.layout_of(j))]
            tiles = src.tiles
            if others:
                # Another operand must be re-laid out into these blocks anyway: put them on the next tiles of
                # the rotation, not the input's own (moving the input's blocks is one contiguous transfer each).
                # A residual stream kept on one set of tiles makes those tiles receive every layer's re-layout
                # (SigLIP so400m: 102 KB of exchange code on one tile from its 54 residual Adds, 12 KB on the
                # mean tile).
                tiles = (src.tiles + cx.row_cursor) % cx.T
                cx.row_cursor = (cx.row_cursor + src.tiles.size) % cx.T
            lay = cx.alloc_layout(out, rows, cols, ot.dtype, src.row_cuts, src.col_cuts, tiles)
            break
    if lay is None:
        lay = cx.row_layout(out, rows, cols, ot.dtype)
    ins = [i for i in node.inputs if i]
    ops = [cx.block_operands(i, ot.shape, lay, out) for i in ins]
    tl, rel, r0, r1, c0, c1 = blocks(lay)
    ops.append((lay.buf, rel, r1 - r0, c1 - c0))
    dtypes = tuple(cx.types[i].dtype for i in ins) + (ot.dtype,)
    if node.op == "Where":
        name, params = "where", [0]
    elif node.op in BINARY_IDS:
        name, params = "binary", [BINARY_IDS[node.op]]
    elif node.op == "Fp8Quantize":
        name = "fp8_cast"  # scale and seed differ per layer: columns 1 and 3 (plan/replay.PER_LAYER_PARAMS)
        params = [format_id(node.attrs["fmt"]), int(node.attrs["scale"]),
                  int(node.attrs.get("rounding") == "stochastic"), int(node.attrs.get("seed", 0))]
    elif node.op == "Gelu":
        name = "unary"
        params = [UNARY_IDS["GeluTanh" if node.attrs.get("approximate", "none") == "tanh" else "Gelu"]]
    else:
        name, params = "unary", [UNARY_IDS[node.op]]
    if not (name == "fp8_cast" and params[2]):  # stochastic rounding draws its bits per vertex: keep them
        tl, ops = _merge_runs(tl, ops, dtypes)
    cx.compute([cx.group(name, dtypes, tl, params, ops)], out)
    cx.layouts[out] = lay
    cx.strategies[node.name or out] = f"{node.op} on {len(lay.tiles.reshape(-1))} blocks"


def _spread_first(cx: LoweringContext, ins: list[str], shape) -> list[str]:
    """The inputs in the order an element-wise op tries their layouts: as given, unless every full-shape input
    lies in blocks of its own (whichever layout is kept, the others move), none of them the residual stream's
    panels, and one spreads over more tiles than the first: then that one first, so the op runs on more tiles.
    BERT's embedding sum: the word lookup's 768 column blocks, the token-type lookup's rows on 1,472 tiles. ViT-B
    at batch 1: the residual Adds on the matmuls' blocks over 1,440 tiles instead of 197 rows on 197 (-3.9 % of
    the cycles in fp32, -5.1 % in fp16); GPT-2 b8 fp16 -8.6 %. Tiles, not blocks: counting blocks also moved
    ViT-B b8 fp32's residual Adds off rows on 1,472 tiles onto 5,760 blocks on 1,440 (4.1 % slower: its
    LayerNorms stayed on column blocks and fc2 took twice the rounds)."""
    full = [i for i in ins if i and cx.types[i].shape == shape and i not in cx.graph.constants]
    lays = [cx.layout_of(i) for i in full]
    if len(full) < 2 or any(is_panels(a) for a in lays) or any(
            a.same_blocks(b) for k, a in enumerate(lays) for b in lays[k + 1:]):
        return ins
    spread = [np.unique(a.tiles).size for a in lays]
    k = int(np.argmax(spread))
    if spread[k] <= spread[0]:
        return ins
    return [full[k]] + [i for i in ins if i != full[k]]


def _merge_runs(tl: np.ndarray, ops: list[tuple], dtypes: tuple[str, ...]) -> tuple[np.ndarray, list[tuple]]:
    """One element-wise vertex per run of blocks that sit back to back on one tile in every operand (a matmul's
    row slices of one tile, say), seen as one [1, n] row: a vertex per block made SigLIP so400m's Gelu and FP8 casts
    keep ~19 KB of vertex state on a tile at batch 8 (now ~11 KB). Operands broadcast within a block (a bias row)
    leave the blocks as they are."""
    n = len(tl)
    arr = [tuple(np.broadcast_to(np.asarray(x, I64), (n,)) for x in o) for o in ops]
    out_rows, out_cols = arr[-1][2], arr[-1][3]
    if n < 2 or any(not (np.array_equal(r, out_rows) and np.array_equal(c, out_cols)) for _, _, r, c in arr):
        return tl, ops
    size = out_rows * out_cols
    order = np.lexsort((np.arange(n), tl))
    t_s = tl[order]
    joined = np.zeros(n, bool)  # block order[k] continues the run of order[k - 1]
    joined[1:] = t_s[1:] == t_s[:-1]
    for (buf, rel, _, _), dt in zip(arr, dtypes):
        b_s, r_s = buf[order], rel[order]
        joined[1:] &= (b_s[1:] == b_s[:-1]) & (r_s[1:] == r_s[:-1] + size[order][:-1] * np.dtype(dt).itemsize)
    if not joined.any():
        return tl, ops
    run = np.cumsum(~joined) - 1
    firsts = order[~joined]
    total = np.bincount(run, weights=size[order]).astype(I64)
    one = np.ones(len(firsts), I64)
    return tl[firsts], [(buf[firsts], rel[firsts], one, total) for buf, rel, _, _ in arr]

"""The Gather rule: constant indices are a data movement; runtime indices into a constant table (an embedding
lookup) run the embed codelet, the table's columns over the tiles or, for a small table, the whole table on each
tile of the output's rows."""

from __future__ import annotations

import numpy as np

from tremula.errors import TremulaError
from tremula.ir.ops import _norm_axis, rule
from tremula.plan.context import I64, LoweringContext
from tremula.plan.exchange import gather_elems, gather_rects
from tremula.plan.layout import Layout, even_cuts, view2d
from tremula.plan.strategies import SMALL_TABLE_FRACTION, cdiv
from tremula.target import cost_terms


def lower_gather(cx: LoweringContext, node) -> None:
    data, ids = node.inputs
    out = node.outputs[0]
    axis = _norm_axis(node.attrs.get("axis", 0), len(cx.types[data].shape))
    if ids in cx.graph.constants:  # constant indices: pure data movement
        idx = cx.graph.constants[ids].value()
        arg = np.arange(cx.types[data].size, dtype=I64).reshape(cx.types[data].shape)
        m = rule("Gather").ref([arg, idx], node.attrs)[0]
        rows, cols = view2d(cx.types[out].shape)
        cx.layouts[out] = cx.move_elems(out, [cx.layout_of(data)], m, rows, cols, cx.types[out].dtype)
        return
    if data not in cx.graph.constants or axis != 0:
        raise TremulaError(f"Gather {node.name}: only embedding lookups (constant table, axis 0) take runtime "
                           "indices; fold or rewrite the others")
    dt = cx.types[data]
    v = dt.shape[0]
    d = int(np.prod(dt.shape[1:], dtype=I64))
    n = cx.types[ids].size
    it = cx.types[ids]
    isz = np.dtype(it.dtype).itemsize
    src = cx.layout_of(ids)
    if _lookup_rows(cx, v, d, n, dt.dtype, isz):
        return _lower_lookup_rows(cx, node, src, v, d, n, dt.dtype, it.dtype)
    parts = min(cx.T, d)
    ccuts = even_cuts(d, parts)
    tl = cx.take_tiles(len(ccuts) - 1)
    tbuf, trel = cx.resident(f"{data}@{out}", data, dt.dtype, tl, 0, v, ccuts[:-1], ccuts[1:])
    ibuf = cx.new_buffer(f"{ids}@{out}", "buffers", tl, n * isz)
    # every table tile gets all the ids, row-major: the whole id matrix as one rectangle each
    cx.exchange(gather_rects(src, 0, src.rows, 0, src.cols, tl, ibuf, 0, src.cols * isz))
    lay = cx.alloc_layout(f"{out}@emb", n, d, dt.dtype, [0, n], ccuts, tl[None, :])
    w = np.diff(ccuts)
    ops = [(ibuf, 0, 1, n), (tbuf, trel, v, w), (lay.buf, lay.rel.reshape(-1), n, w)]
    cx.compute([cx.group("embed", (it.dtype, dt.dtype, dt.dtype), tl, [0], ops)], out)
    cx.set_output(out, lay)
    cx.strategies[node.name or out] = f"embedding lookup, table columns over {len(tl)} tiles"


def _lookup_rows(cx: LoweringContext, v: int, d: int, n: int, dtype: str, isz: int) -> bool:
    """Whether a lookup copies its table to every tile of a row layout of its output, each tile picking the rows of
    its own tokens, instead of spreading the table's columns over the tiles, each of which then receives every id
    and picks one column of every token. Only a table within SMALL_TABLE_FRACTION of a tile (BERT's token types:
    2 x 768 halves), and only when the cost model prices it cheaper: the busiest tile's copies and receives."""
    tsz = np.dtype(dtype).itemsize
    if v * d * tsz > SMALL_TABLE_FRACTION * cx.chip.sram_bytes_per_tile:
        return False
    cols = cdiv(d, min(cx.T, d))
    rows = cdiv(n, cx.row_parts(n, d, dtype))
    by_cols = n * cost_terms.copy_cycles(cx.chip, cols * tsz) + cost_terms.exchange_cycles(cx.chip, 0, n * isz)
    by_rows = (rows * cost_terms.copy_cycles(cx.chip, d * tsz)
               + cost_terms.exchange_cycles(cx.chip, 0, rows * isz + v * d * tsz))
    return by_rows < by_cols


def _lower_lookup_rows(cx: LoweringContext, node, src: Layout, v: int, d: int, n: int, dtype: str, idtype: str) -> None:
    """The lookup on a row layout of its output: the whole table on each of its tiles, each tile's ids (its rows'
    tokens, in order) gathered from the id layout. The table is stored once, on the first of those tiles, and
    multicast to the others' temporary buffers when the lookup runs."""
    data, ids = node.inputs
    out = node.outputs[0]
    lay = cx.row_layout(f"{out}@emb", n, d, dtype)
    tl, cnt = lay.tiles[:, 0], np.diff(lay.row_cuts)
    isz = np.dtype(idtype).itemsize
    home = np.arange(len(tl)) == 0
    tbuf, trel = cx.weight_operand(f"{data}@{out}", data, dtype, tl, home, np.zeros(len(tl), I64), 0, v, 0, d)
    ibuf = cx.new_buffer(f"{ids}@{out}", "buffers", tl, cnt * isz)
    tok = np.arange(n, dtype=I64)
    cx.exchange(gather_elems(src, tok, np.repeat(tl, cnt), ibuf, (tok - np.repeat(lay.row_cuts[:-1], cnt)) * isz))
    ops = [(ibuf, 0, 1, cnt), (tbuf, trel, v, d), (lay.buf, lay.rel[:, 0], cnt, d)]
    cx.compute([cx.group("embed", (idtype, dtype, dtype), tl, [0], ops)], out)
    cx.set_output(out, lay)
    cx.strategies[node.name or out] = f"embedding lookup, the table on each of {len(tl)} tiles of its rows"

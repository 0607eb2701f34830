"""The row-op rule (reductions, Softmax, LayerNorm): the reduced axes brought last and the rows spread over the
tiles, or a LayerNorm normalised in place on the column blocks a matmul left."""

from __future__ import annotations

import numpy as np

from tremula.codelets import f2i
from tremula.codelets.norm import REDUCE_IDS
from tremula.ir.ops import _norm_axis
from tremula.plan.context import I64, LoweringContext
from tremula.plan.exchange import make_transfers
from tremula.plan.layout import Layout, block_rel_offsets, blocks, view2d
from tremula.plan.strategies import cdiv
from tremula.target import cost_terms


def lower_rows(cx: LoweringContext, node) -> None:
    x = node.inputs[0]
    xt, out = cx.types[x], node.outputs[0]
    ot = cx.types[out]
    rank = len(xt.shape)
    if node.op == "LayerNorm":
        axes = (rank - 1,)
    elif node.op == "Softmax":
        axes = (_norm_axis(node.attrs.get("axis", -1), rank),)
    elif node.attrs.get("axes") is not None:
        axes = tuple(sorted(_norm_axis(a, rank) for a in node.attrs["axes"]))
    else:
        axes = tuple(range(rank))
    keep = [a for a in range(rank) if a not in axes]
    red = int(np.prod([xt.shape[a] for a in axes], dtype=I64)) if axes else 1
    lead = int(np.prod([xt.shape[a] for a in keep], dtype=I64)) if keep else 1
    if node.op == "LayerNorm" or axes == (rank - 1,) or rank == 0:
        src = cx.layout_of(x)
        mat = src if (red == src.cols or rank == 0) else None
    else:
        mat = None
    if mat is None:  # bring the reduced axes last: a [lead, red] matrix
        perm = keep + list(axes)
        idx = np.transpose(np.arange(xt.size, dtype=I64).reshape(xt.shape), perm).reshape(-1)
        mat = cx.move_elems(f"{x}@T@{out}", [cx.layout_of(x)], idx, lead, red, xt.dtype)
    if node.op == "LayerNorm" and mat is not None and _layernorm_blocks(cx, node, mat):
        return
    mat = cx.as_rows(mat, f"{x}@rows@{out}")
    ocols = red if node.op in ("LayerNorm", "Softmax") else 1
    res = cx.alloc_layout(out if ocols == red and perm_free(node, axes, rank) else f"{out}@res", mat.rows, ocols,
                            ot.dtype, mat.row_cuts, [0, ocols], mat.tiles)
    tl, rel, r0, r1, _, _ = blocks(mat)
    ops = [(mat.buf, rel, r1 - r0, red)]
    dtypes = [xt.dtype]
    if node.op == "LayerNorm":
        for p in node.inputs[1:]:
            if p:
                ops.append(_row_vector(cx, p, res, out))
                dtypes.append(cx.types[p].dtype)
        name, params = "layernorm", [f2i(node.attrs.get("epsilon", 1e-5)), int(len(ops) == 3)]
    elif node.op == "Softmax":
        name, params = "softmax", [0]
    else:
        name, params = "reduce", [REDUCE_IDS[node.op]]
    ops.append((res.buf, blocks(res)[1], r1 - r0, ocols))
    dtypes.append(ot.dtype)
    cx.compute([cx.group(name, tuple(dtypes), tl, params, ops)], out)
    if node.op == "Softmax" and axes != (rank - 1,):  # move the softmax axis back where it was
        perm = keep + list(axes)
        inv = np.argsort(perm)
        shape_p = tuple(xt.shape[a] for a in perm)
        idx = np.transpose(np.arange(xt.size, dtype=I64).reshape(shape_p), inv).reshape(-1)
        r, c = view2d(ot.shape)
        cx.layouts[out] = cx.move_elems(out, [res], idx, r, c, ot.dtype)
    else:
        cx.set_output(out, res)
    cx.strategies[node.name or out] = f"{node.op} rows over {len(tl)} tiles"


def _layernorm_blocks(cx: LoweringContext, node, src: Layout) -> bool:
    """LayerNorm in place on a layout of column blocks (a matmul's output), instead of re-laying it out in rows:
    each block computes its rows' (mean, M2), every block of a row receives the others' (all-gather, one
    contiguous multicast per block), combines them and normalises its own columns. The output keeps the input's
    blocks, so the next matmul's K slices stay whole blocks. A re-layout to rows costs one exchange instruction
    per row and block on both sides, which grows with the batch (SigLIP so400m at batch 8: 28 KB a tile for its
    54 LayerNorms). False (nothing done) when the columns are not even cuts or the moments would not fit."""
    nr, nc = len(src.row_cuts) - 1, len(src.col_cuts) - 1
    if nc == 1 or not src.even_col_parts:
        return False
    tl, rel, r0, r1, c0, c1 = blocks(src)
    rows, w = r1 - r0, c1 - c0
    mom = nc * rows * 8  # every part's (mean, M2) per row, float32
    if mom.max() > cx.row_block_bytes * 4:
        return False
    x, out = node.inputs[0], node.outputs[0]
    xt, ot = cx.types[x], cx.types[out]
    # Under a memory budget (the compiler's retries) always; else only when it is also the faster of the two
    # (on small models the extra step's sync outweighs the re-layout it saves).
    if cx.perm_fraction is None:
        chip, isz = cx.chip, src.itemsize
        per = cdiv(src.rows, cx.row_parts(src.rows, src.cols, src.dtype))  # rows per tile of as_rows' layout
        as_rows = (cost_terms.exchange_cycles(chip, int((rows * w).max()) * isz, per * src.cols * isz)
                   + cost_terms.sync_cycles(chip) + cost_terms.layernorm_cycles(chip, per, src.cols, xt.dtype))
        rm, wm = int(rows.max()), int(w.max())
        in_place = (cost_terms.layernorm_moments_cycles(chip, rm, wm, xt.dtype) + 2 * cost_terms.sync_cycles(chip)
                    + cost_terms.exchange_cycles(chip, rm * 8, (nc - 1) * rm * 8)
                    + cost_terms.layernorm_apply_cycles(chip, rm, wm, nc, xt.dtype))
        if in_place > as_rows:
            return False
    mrel, used = block_rel_offsets(tl, mom)
    mbuf = cx.new_buffer(f"{out}@moments", "buffers", *used)
    j = np.tile(np.arange(nc), nr)
    cx.compute([cx.group("layernorm_moments", (xt.dtype, "float32"), tl, [0],
                             [(src.buf, rel, rows, w), (mbuf, mrel + j * rows * 8, rows, 2)])],
                 out, "moments")
    # block (i, j) sends its slot j to the nc - 1 other blocks of row block i
    snd = np.repeat(np.arange(nr * nc), nc)
    dst = (snd // nc) * nc + np.tile(np.arange(nc), nr * nc)
    keep = dst != snd
    snd, dst = snd[keep], dst[keep]
    nb_ = rows[snd] * 8
    cx.exchange(make_transfers(tl[snd], mbuf, mrel[snd] + j[snd] * nb_, 1, nb_, nb_, tl[dst], mbuf,
                                 mrel[dst] + j[snd] * nb_, nb_))
    res = cx.alloc_layout(out, src.rows, src.cols, ot.dtype, src.row_cuts, src.col_cuts, src.tiles)
    ops = [(src.buf, rel, rows, w), (mbuf, mrel, nc * rows, 2)]
    dtypes = [xt.dtype, "float32"]
    for p in node.inputs[1:]:
        if p:
            ops.append(_row_vector(cx, p, res, out))
            dtypes.append(cx.types[p].dtype)
    ops.append((res.buf, res.rel.reshape(-1), rows, w))
    params = [f2i(node.attrs.get("epsilon", 1e-5)), int(len(ops) == 5), nc, src.cols]
    cx.compute([cx.group("layernorm_apply", tuple(dtypes) + (ot.dtype,), tl, params, ops)], out)
    cx.set_output(out, res)
    cx.strategies[node.name or out] = f"LayerNorm on {nr} x {nc} blocks in place"
    cx.split_sums[node.outputs[0]] = ("columns", tuple(int(c) for c in src.col_cuts))
    return True


def _row_vector(cx: LoweringContext, value: str, lay: Layout, tag: str) -> tuple:
    """A [1, cols] constant (LayerNorm scale/bias) brought to every tile of a row layout."""
    # Not resident: a copy on every row tile of every LayerNorm would pile up (2 x cols per tile per LayerNorm);
    # the constant lives once (its home layout) and is multicast to the row tiles when the LayerNorm runs.
    return cx.block_operands(value, (lay.rows, lay.cols), lay, tag, resident=False)


def perm_free(node, axes: tuple[int, ...], rank: int) -> bool:
    """True when a row op's result needs no moving back (softmax over the last axis, LayerNorm)."""
    return node.op == "LayerNorm" or (node.op == "Softmax" and axes == (rank - 1,))

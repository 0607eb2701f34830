"""The Attention rule: one unit (head, query block[, key block]) per tile, q, k and v read straight from the
projections' [B*S, H*d] layouts through their head views (plan/head_views.py) and the output written in the [B*S, H*dv]
layout the output projection reads; the query x key grid chosen by its modelled cycles."""

from __future__ import annotations

import numpy as np

from tremula.codelets import codelet, f2i
from tremula.codelets.attention import scores_dtype
from tremula.numerics.attention import group_of
from tremula.plan.context import I64, LoweringContext
from tremula.plan.exchange import SymTransfers, gather_elems, gather_rects, make_transfers
from tremula.plan.layout import Layout, even_cuts
from tremula.plan.strategies import ATTENTION_KV_FRACTION, BUFFER_FRACTION, TEMP_FRACTION, cdiv
from tremula.target import cost_terms


def fill_rounds(nq: int, sq: int, units_per_block: int, per_round: int) -> int:
    """Query blocks for key-split attention: at least nq (what the budget needs), at most sq (one row each). Units run
    in rounds of per_round, and a round takes as long as its longest query block: as many (and so as small) blocks as
    fill the rounds nq blocks take anyway. SigLIP so400m fp8 b8 (128 heads x 5 key blocks) at a grown budget took 3
    blocks of 243 rows in 2 rounds, where 4 of 183 also take 2 (its attention 13.9 -> 10.9 M cycles); a third round
    costs more than smaller blocks save (b10 with 5 blocks in 3 rounds: 250.4 img/s against 259.5)."""
    rounds = cdiv(units_per_block * nq, per_round)
    return max(nq, min(sq, rounds * per_round // units_per_block))


def _attention_operands(cx: LoweringContext, node):
    """(q, k, v, mask or None, out, their four types, (Sq, d, Sk, dv), leading dims, batch*heads)."""
    q, k, v = node.inputs[:3]
    mask = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3] else None
    out = node.outputs[0]
    types = tuple(cx.types[x] for x in (q, k, v, out))
    (sq, d), (sk, dv) = types[0].shape[-2:], types[2].shape[-2:]
    lead = types[0].shape[:-2]
    return q, k, v, mask, out, types, (sq, d, sk, dv), lead, int(np.prod(lead, dtype=I64))


def _head_rects(cx: LoweringContext, value: str, units: np.ndarray, r0: np.ndarray, r1: np.ndarray):
    """Where rows r0:r1 of each unit's [S, d] matrix of `value` are: (layout, rows from, rows to, cols from,
    cols to). A head view reads head h of sample b at rows b*S + r, columns h*d + j of the projection."""
    hv = cx.head_in.get(value)
    if hv is None:
        t = cx.types[value]
        s, d = t.shape[-2:]
        zero = np.zeros(len(units), I64)
        return cx.as_matrix(value, d), units * s + r0, units * s + r1, zero, zero + d
    b, h = units // hv.heads, units % hv.heads
    return cx.layout_of(hv.value), b * hv.seq + r0, b * hv.seq + r1, h * hv.dim, (h + 1) * hv.dim


def _gather_heads(cx: LoweringContext, value: str, units, r0, r1, tiles, buf: int) -> SymTransfers:
    lay, a0, a1, c0, c1 = _head_rects(cx, value, units, r0, r1)
    return gather_rects(lay, a0, a1, c0, c1, tiles, buf, 0, (c1 - c0) * lay.itemsize)


def _attention_output(cx: LoweringContext, out: str, dtype: str, units, q0, tiles) -> tuple[Layout, np.ndarray, str]:
    """The output layout (one block per unit: rows q0.. of head `units`, to the next unit's q0 of that head's
    sample), each unit's block offset, and the value it holds: the merged [B*S, H*dv] value under a head view
    (every head of a sample cut at the same rows), else `out` itcx."""
    t = cx.types[out]
    sq, dv = t.shape[-2:]
    hv = cx.head_out.get(out)
    h = hv.heads if hv is not None else 1
    b = units // h
    rows = (int(units.max()) // h + 1) * sq
    starts = np.unique(b * sq + q0)
    r = np.searchsorted(starts, b * sq + q0)
    grid = np.zeros((len(starts), h), I64)
    grid[r, units % h] = tiles
    rows_cuts = np.concatenate([starts, [rows]])
    if hv is None:
        lay = cx.alloc_layout(out + "@attn", rows, dv, dtype, rows_cuts, [0, dv], grid)
        return lay, lay.rel[r, 0], out
    lay = cx.alloc_layout(hv.value, rows, h * dv, dtype, rows_cuts, np.arange(h + 1) * dv, grid)
    return lay, lay.rel[r, units % h], hv.value


def _attention_units(cx: LoweringContext, out: str, bh: int, sq: int):
    """(head, first query row, end row) of every unit of work and the units of each round (their tiles: 0, 1, ..
    in each round). Fewer heads than tiles: each head's query rows cut in as many blocks as fill the tiles, one
    round. More: whole heads in rounds of whole samples (a head view's grid cuts every head of a sample at the same
    rows), and the samples left over after the last full round in one more round, their query rows cut finer to
    fill it (BERT-base b128: 1,536 heads on 1,472 tiles ran a second round of 64 whole heads, a whole head's
    cycles), unless that takes more rounds than whole heads in rounds of all the tiles."""
    hv = cx.head_out.get(out)
    h = hv.heads if hv is not None else 1
    T = cx.T
    rounds_whole = cdiv(bh, T)
    per = T // h if h <= T else 0  # whole samples a round
    left = (bh // h) % per if per else 0
    if bh <= T or not per or left == 0 or (bh // h) // per + 1 > rounds_whole:
        qcuts = even_cuts(sq, max(1, min(sq, T // bh)) if bh <= T else 1)
        nq = len(qcuts) - 1
        u_bh = np.repeat(np.arange(bh, dtype=I64), nq)
        qi = np.tile(np.arange(nq, dtype=I64), bh)
        n = len(u_bh)
        return u_bh, qcuts[qi], qcuts[qi + 1], [np.arange(r, min(n, r + T)) for r in range(0, n, T)]
    whole = bh - left * h
    fine = even_cuts(sq, max(1, min(sq, T // (left * h))))
    nq = len(fine) - 1
    u_bh = np.concatenate([np.arange(whole, dtype=I64), np.repeat(np.arange(whole, bh, dtype=I64), nq)])
    qi = np.tile(np.arange(nq, dtype=I64), left * h)
    u_q0 = np.concatenate([np.zeros(whole, I64), fine[qi]])
    u_q1 = np.concatenate([np.full(whole, sq, I64), fine[qi + 1]])
    step = per * h
    rounds = [np.arange(r, min(whole, r + step)) for r in range(0, whole, step)]
    return u_bh, u_q0, u_q1, rounds + [np.arange(whole, len(u_bh))]


def _key_blocks(cx: LoweringContext, node) -> int:
    """How many blocks the keys are split in (1: a head's keys whole on each tile of that head), by the modelled
    cycles of each grid (`_grid_cycles`), from the fewest the memory allows: a head's K and V on a tile past
    ATTENTION_KV_FRACTION of its SRAM split the keys, and with few heads every key block count up to one unit per
    tile for every (head, key block) is priced. ViT-B/16 b8 fp16: 96 heads x 15 query blocks of 14 rows (36.2 k
    cycles of compute a layer, the AMP passes all overhead on so few rows) against 5 query blocks x 3 key blocks
    of 40 rows x 66 keys (21.9 k, and 5.6 k to combine)."""
    _, _, _, _, _, (qt, _, _, _), (sq, d, sk, dv), _, bh = _attention_operands(cx, node)
    kv_bytes = sk * (d + dv) * np.dtype(qt.dtype).itemsize
    low = min(sk, cdiv(kv_bytes, int(ATTENTION_KV_FRACTION * cx.chip.sram_bytes_per_tile)), max(1, cx.T // bh))
    high = max(low, min(sk, cx.T // bh))
    held = _held_operand_bytes(cx, node)
    return min(range(low, high + 1), key=lambda nk: (_grid_cycles(cx, node, nk, held), nk))


def _held_operand_bytes(cx: LoweringContext, node) -> int:
    """The most bytes of q, k and v (their projections' layouts) one tile holds: what it sends in the attention's
    operand exchange, each block once."""
    q, k, v = node.inputs[:3]
    held = np.zeros(cx.T)
    for name in dict.fromkeys(cx.head_in[x].value if x in cx.head_in else x for x in (q, k, v)):
        lay = cx.layouts.get(name)
        if lay is not None:
            sizes = np.outer(np.diff(lay.row_cuts), np.diff(lay.col_cuts)).reshape(-1) * lay.itemsize
            held += np.bincount(lay.tiles.reshape(-1), weights=sizes, minlength=cx.T)[:cx.T]
    return int(held.max())


def _grid_cycles(cx: LoweringContext, node, nk: int, held: int | None = None) -> int:
    """The modelled cycles of the attention with the keys in nk blocks, as its lowering would run it, priced
    without lowering it: per round, the busiest tile's operand exchange (each source tile sends what it holds of
    q, k and v once, spread over the rounds: `held`, _held_operand_bytes's; a unit's tile receives its q rows,
    its key block of K and V and its mask), a unit's vertex, and with split keys the partials' exchange and the
    combine, one sync a step."""
    q, k, v, mask, out, (qt, kt, vt, ot), (sq, d, sk, dv), lead, bh = _attention_operands(cx, node)
    chip, isz, osz = cx.chip, np.dtype(qt.dtype).itemsize, np.dtype(ot.dtype).itemsize
    group = group_of(node.attrs)
    sdt = scores_dtype(group)
    mb = cx.types[mask].itemsize if mask is not None else 0
    mdt = (cx.types[mask].dtype,) if mask is not None else ()
    mask_rows_same = mask is None or _mask_index(cx, mask, lead, sq, sk)[1]
    held = _held_operand_bytes(cx, node) if held is None else held
    sync = cost_terms.sync_cycles(chip)

    def unit(codelet_name: str, r: int, kb: int, rounds: int) -> int:  # a round's operands in, then its vertex
        recv = (r * d + kb * (d + dv)) * isz + (1 if mask_rows_same else r) * kb * mb
        split = codelet_name == "attention_partial"
        params = [int(mask is not None), int(node.attrs.get("causal", 0)), 0, sq, sk, 0] + ([0] if split else [])
        shapes = [(r, d), (kb, d), (kb, dv)] + ([(1 if mask_rows_same else r, kb)] if mask is not None else [])
        shapes += [(r, kb), (r, dv)] + ([(r, 2)] if split else [])  # scores, output (p @ v), and its stats
        vx = codelet(codelet_name).cycles(chip, params + [group], shapes, (qt.dtype, kt.dtype, vt.dtype) + mdt
                                          + (sdt, ot.dtype) + (("float32",) if split else ()))
        return cost_terms.exchange_cycles(chip, int(held / rounds), recv) + sync + vx

    if nk == 1:
        u_bh, u_q0, u_q1, rounds = _attention_units(cx, out, bh, sq)
        return sum(unit("attention", int((u_q1[us] - u_q0[us]).max()), sk, len(rounds)) for us in rounds)
    qcuts, kcuts, per_round = _key_grid(cx, node, nk)
    nq, nk = len(qcuts) - 1, len(kcuts) - 1
    r, kb = int(np.diff(qcuts).max()), int(np.diff(kcuts).max())
    rounds = cdiv(bh * nq * nk, per_round)
    rs, pw = cdiv(r, nk), dv * osz + 8  # an owner's slice of rows; a partial row (p @ v, max and sum)
    combine = codelet("attention_combine").cycles(chip, [nk, group], [(rs, dv)] * nk + [(rs, 2)] * nk + [(rs, dv)],
                                                  (ot.dtype,) * nk + ("float32",) * nk + (ot.dtype,))
    partials = cost_terms.exchange_cycles(chip, (r - rs) * pw, (nk - 1) * rs * pw) + sync + combine
    return rounds * (unit("attention_partial", r, kb, rounds) + partials)


def _key_grid(cx: LoweringContext, node, nk: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(query cuts, key cuts, units a round) of the attention with its keys in nk blocks: query blocks small
    enough that one unit's buffers stay within the op budget, and as many as fill the rounds (fill_rounds); the
    rounds run whole groups of nk units."""
    q, k, v, mask, out, (qt, kt, vt, ot), (sq, d, sk, dv), lead, bh = _attention_operands(cx, node)
    isz = np.dtype(qt.dtype).itemsize
    osz = np.dtype(ot.dtype).itemsize
    pw = dv * osz + 8  # a partial row: p @ v in the attention's dtype, and the row max and row sum (float32)
    budget = BUFFER_FRACTION * cx.temp_fraction / TEMP_FRACTION * cx.chip.sram_bytes_per_tile
    sdt = scores_dtype(group_of(node.attrs))
    # q, the row's scores, own partials and (at most as many) received ones, output
    per_q = d * isz + cdiv(sk, nk) * np.dtype(sdt).itemsize + 2 * pw + dv * osz
    kv = cdiv(sk, nk) * (d + dv) * isz
    nq_mem = cdiv(sq * per_q, max(int(budget - kv), per_q))
    nq = max(1, min(sq, max(cx.T // (bh * nk), nq_mem)))
    per_round = cx.T // nk * nk  # whole groups of nk units
    nq = fill_rounds(nq, sq, bh * nk, per_round)
    return even_cuts(sq, nq), even_cuts(sk, nk), per_round


def lower_attention(cx: LoweringContext, node) -> None:
    q, k, v, mask, out, (qt, kt, vt, ot), (sq, d, sk, dv), lead, bh = _attention_operands(cx, node)
    isz = np.dtype(qt.dtype).itemsize
    nk = _key_blocks(cx, node)
    if nk > 1:
        return _attention_key_blocks(cx, node, nk)
    u_bh, u_q0, u_q1, rounds = _attention_units(cx, out, bh, sq)
    u_tile = np.zeros(len(u_bh), I64)
    for us in rounds:
        u_tile[us] = np.arange(len(us))
    used = np.unique(u_tile)
    maxq = int((u_q1 - u_q0).max())
    qbuf = cx.new_buffer(f"{q}@{out}", "buffers", used, maxq * d * isz)
    kbuf = cx.new_buffer(f"{k}@{out}", "buffers", used, sk * d * isz)
    vbuf = cx.new_buffer(f"{v}@{out}", "buffers", used, sk * dv * isz)
    lay, orel, value = _attention_output(cx, out, ot.dtype, u_bh, u_q0, u_tile)
    if mask is not None:
        midx, mrows_same = _mask_index(cx, mask, lead, sq, sk)
        mbuf = cx.new_buffer(f"{mask}@{out}", "buffers", used,
                               (1 if mrows_same else maxq) * sk * cx.types[mask].itemsize)
    scale = f2i(node.attrs["scale"])
    causal = int(node.attrs.get("causal", 0))
    group = group_of(node.attrs)  # half partials (passes/precision.with_partials), 0: float
    sdt = scores_dtype(group)  # each unit's [rows, keys] scores, held while its softmax and p @ v run
    sbuf = cx.new_buffer(f"{out}@scores", "buffers", used, maxq * sk * np.dtype(sdt).itemsize)
    for us in rounds:
        tl = u_tile[us]
        zero = np.zeros(len(us), I64)
        parts = [_gather_heads(cx, q, u_bh[us], u_q0[us], u_q1[us], tl, qbuf),
                 _gather_heads(cx, k, u_bh[us], zero, zero + sk, tl, kbuf),
                 _gather_heads(cx, v, u_bh[us], zero, zero + sk, tl, vbuf)]
        nrows = u_q1[us] - u_q0[us]
        ops = [(qbuf, 0, nrows, d), (kbuf, 0, sk, d), (vbuf, 0, sk, dv)]
        dtypes = [qt.dtype, kt.dtype, vt.dtype]
        if mask is not None:
            parts.append(_gather_mask(cx, mask, midx, mrows_same, u_bh[us], u_q0[us], u_q1[us], zero, zero + sk,
                                           tl, mbuf))
            ops.append((mbuf, 0, 1 if mrows_same else nrows, sk))
            dtypes.append(cx.types[mask].dtype)
        cx.exchange(SymTransfers.concat(parts))
        ops += [(sbuf, 0, nrows, sk), (lay.buf, orel[us], nrows, dv)]
        dtypes += [sdt, ot.dtype]
        params = np.stack([np.full(len(us), int(mask is not None)), np.full(len(us), causal), u_q0[us],
                           np.full(len(us), sq), np.full(len(us), sk), np.full(len(us), scale),
                           np.full(len(us), group)], axis=1)
        cx.compute([cx.group("attention", tuple(dtypes), tl, params, ops)], out)
    cx.set_output(value, lay)
    blocks = np.bincount(u_bh, minlength=bh)
    cut = f"{blocks[0]} query blocks" + (f" ({blocks[-1]} in the last round)" if blocks[-1] != blocks[0] else "")
    cx.strategies[node.name or out] = (f"attention, {bh} heads x {cut} over {len(used)} tiles"
                                         + (f" in {len(rounds)} rounds" if len(rounds) > 1 else ""))


def _mask_index(cx: LoweringContext, mask: str, lead, sq: int, sk: int) -> tuple[np.ndarray, bool]:
    """The mask's flat element index per (batch*head, query, key), a [*lead, sq, sk] broadcast view (not bh x sq x
    sk indices made: 25 M for bert-base at b128), and whether every query row reads the same elements: the query
    axis is broadcast (a padding mask: one row is delivered, not sq), since distinct elements have distinct
    indices."""
    mt = cx.types[mask]
    midx = np.broadcast_to(np.arange(mt.size, dtype=I64).reshape(mt.shape), tuple(lead) + (sq, sk))
    return midx, sq == 1 or midx.strides[-2] == 0


def _gather_mask(cx: LoweringContext, mask: str, midx, same: bool, b_, q0, q1, k0, k1, tl, mbuf: int) -> SymTransfers:
    """Deliver mask[b, q0:q1 (or one row when `same`), k0:k1] to each unit's tile, packed row-major at mbuf."""
    misz = cx.types[mask].itemsize
    heads = ([midx[ix] for ix in zip(*np.unravel_index(np.asarray(b_, I64), midx.shape[:-2]))] if midx.ndim > 2
             else [midx] * len(b_))
    el = [(m[:1, a:c] if same else m[r0:r1, a:c]).reshape(-1) for m, r0, r1, a, c in zip(heads, q0, q1, k0, k1)]
    cnt = np.array([len(x) for x in el], I64)
    return gather_elems(cx.layout_of(mask), np.concatenate(el), np.repeat(tl, cnt), mbuf,
                        np.concatenate([np.arange(c, dtype=I64) * misz for c in cnt]))


def _attention_key_blocks(cx: LoweringContext, node, nk: int) -> None:
    """Keys split in nk blocks: unit (head, query block, key block) per tile computes a partial (p @ v, row max,
    row sum); the nk units of a (head, query block) then each own a slice of its rows, receive the other units'
    partials of those rows and combine them (a reduce-scatter: the combine and its receives spread over the nk
    tiles, instead of one tile of the nk gathering every partial and combining all the rows alone).

    Query blocks are small enough that one unit's buffers stay within the op budget; when that makes more units
    than tiles they run in rounds of whole (head, query block) groups, reusing the buffers."""
    q, k, v, mask, out, (qt, kt, vt, ot), (sq, d, sk, dv), lead, bh = _attention_operands(cx, node)
    isz = np.dtype(qt.dtype).itemsize
    osz = np.dtype(ot.dtype).itemsize
    group = group_of(node.attrs)
    sdt = scores_dtype(group)
    qcuts, kcuts, per_round = _key_grid(cx, node, nk)
    nq, nk = len(qcuts) - 1, len(kcuts) - 1
    # unit index = (b * nq + i) * nk + j
    b_ = np.repeat(np.arange(bh, dtype=I64), nq * nk)
    i_ = np.tile(np.repeat(np.arange(nq, dtype=I64), nk), bh)
    j_ = np.tile(np.arange(nk, dtype=I64), bh * nq)
    q0, q1, k0, k1 = qcuts[i_], qcuts[i_ + 1], kcuts[j_], kcuts[j_ + 1]
    nu = len(b_)
    # Query block i's rows in s_i slices (one per unit j < s_i; fewer than nk only when the block has fewer rows):
    # slice j of block i is rows fine[base_i + j]:fine[base_i + j + 1] of the head.
    rows_i = np.diff(qcuts)
    s_i = np.minimum(nk, rows_i)
    base = np.concatenate([[0], np.cumsum(s_i)])
    fine = np.concatenate([np.concatenate([qcuts[i] + even_cuts(int(rows_i[i]), int(s_i[i]))[:-1]
                                           for i in range(nq)]), [sq]]).astype(I64)
    own = j_ < s_i[i_]
    fi = np.where(own, base[i_] + j_, 0)  # each owner's slice
    sub0 = np.where(own, fine[fi] - q0, 0)
    sub1 = np.where(own, fine[fi + 1] - q0, 0)
    # Rotating, like row layouts, and on through the rounds: each round's units are on distinct tiles, and the
    # output blocks spread over all tiles instead of piling up on one round's tiles.
    tl = (np.arange(nu, dtype=I64) + cx.row_cursor) % cx.T
    cx.row_cursor = (cx.row_cursor + nu) % cx.T
    used = np.unique(tl)
    maxq, maxk = int((q1 - q0).max()), int((k1 - k0).max())
    maxs = int((sub1 - sub0).max())
    qbuf = cx.new_buffer(f"{q}@{out}", "buffers", used, maxq * d * isz)
    kbuf = cx.new_buffer(f"{k}@{out}", "buffers", used, maxk * d * isz)
    vbuf = cx.new_buffer(f"{v}@{out}", "buffers", used, maxk * dv * isz)
    sbuf = cx.new_buffer(f"{out}@scores", "buffers", used, maxq * maxk * np.dtype(sdt).itemsize)
    # each unit's p @ v then its stats; an owner receives the others' rows of its slice in slots (key block j' in
    # slot j' below its own j, j' - 1 above), each a p @ v slice then a stats slice
    pvb, stb = cdiv(maxq * dv * osz, 8) * 8, maxq * 8
    pbuf = cx.new_buffer(f"{out}@partial", "buffers", used, pvb + stb)
    spv = cdiv(maxs * dv * osz, 8) * 8
    slot_bytes = spv + maxs * 8
    rbuf = cx.new_buffer(f"{out}@recv", "buffers", np.unique(tl[own]), (nk - 1) * slot_bytes)

    def slot(j_from, j_own):  # byte offset, in its owner's rbuf, of the slice a key block j_from sends it
        return np.where(j_from < j_own, j_from, j_from - 1) * slot_bytes

    o_idx = np.flatnonzero(own)
    lay, orel, value = _attention_output(cx, out, ot.dtype, b_[o_idx], fine[fi[o_idx]], tl[o_idx])
    if mask is not None:
        midx, same = _mask_index(cx, mask, lead, sq, sk)
        mbuf = cx.new_buffer(f"{mask}@{out}", "buffers", used,
                               (1 if same else maxq) * maxk * cx.types[mask].itemsize)
    nrows, nkeys = q1 - q0, k1 - k0
    causal, scale = int(node.attrs.get("causal", 0)), f2i(node.attrs["scale"])
    rounds = cdiv(nu, per_round)
    for r in range(rounds):
        us = np.arange(r * per_round, min(nu, (r + 1) * per_round))
        t_, b, q_0, q_1, k_0, k_1 = tl[us], b_[us], q0[us], q1[us], k0[us], k1[us]
        parts = [_gather_heads(cx, q, b, q_0, q_1, t_, qbuf), _gather_heads(cx, k, b, k_0, k_1, t_, kbuf),
                 _gather_heads(cx, v, b, k_0, k_1, t_, vbuf)]
        ops = [(qbuf, 0, nrows[us], d), (kbuf, 0, nkeys[us], d), (vbuf, 0, nkeys[us], dv)]
        dtypes = [qt.dtype, kt.dtype, vt.dtype]
        if mask is not None:
            parts.append(_gather_mask(cx, mask, midx, same, b, q_0, q_1, k_0, k_1, t_, mbuf))
            ops.append((mbuf, 0, 1 if same else nrows[us], nkeys[us]))
            dtypes.append(cx.types[mask].dtype)
        cx.exchange(SymTransfers.concat(parts))
        ops += [(sbuf, 0, nrows[us], nkeys[us]), (pbuf, 0, nrows[us], dv), (pbuf, pvb, nrows[us], 2)]
        dtypes += [sdt, ot.dtype, "float32"]
        n = len(us)
        params = np.stack([np.full(n, int(mask is not None)), np.full(n, causal), q_0, np.full(n, sq),
                           np.full(n, sk), np.full(n, scale), k_0, np.full(n, group)], axis=1)
        tag = f" ({r + 1}/{rounds})" if rounds > 1 else ""
        cx.compute([cx.group("attention_partial", tuple(dtypes), t_, params, ops)], out, "partials", tag)
        # Unit u sends each other owner w of its group the rows of w's slice, into w's slot for u's key block.
        snd = np.repeat(us, nk)
        w = snd - j_[snd] + np.tile(np.arange(nk, dtype=I64), len(us))
        keep = (w != snd) & own[w]
        snd, w = snd[keep], w[keep]
        at = slot(j_[snd], j_[w])
        r0, nr = sub0[w], sub1[w] - sub0[w]
        pv_n, st_n = nr * dv * osz, nr * 8
        cx.exchange(SymTransfers.concat([
            make_transfers(tl[snd], pbuf, r0 * dv * osz, 1, pv_n, pv_n, tl[w], rbuf, at, pv_n),
            make_transfers(tl[snd], pbuf, pvb + r0 * 8, 1, st_n, st_n, tl[w], rbuf, at + spv, st_n)]))
        oi = us[own[us]]
        ob = np.searchsorted(o_idx, oi)  # their blocks of the output layout
        r_, jo = sub1[oi] - sub0[oi], j_[oi]
        # operands in key-block order (the combine sums the blocks in that order): the owner's own block from its
        # partial, every other one from its slot
        mine = [jb == jo for jb in range(nk)]
        cops = ([(np.where(m, pbuf, rbuf), np.where(m, sub0[oi] * dv * osz, slot(jb, jo)), r_, dv)
                 for jb, m in enumerate(mine)]
                + [(np.where(m, pbuf, rbuf), np.where(m, pvb + sub0[oi] * 8, slot(jb, jo) + spv), r_, 2)
                   for jb, m in enumerate(mine)])
        cops.append((lay.buf, orel[ob], r_, dv))
        dts = (ot.dtype,) * nk + ("float32",) * nk + (ot.dtype,)
        cx.compute([cx.group("attention_combine", dts, tl[oi], [nk, group], cops)], out, "combine", tag)
    cx.set_output(value, lay)
    if nk > 1:
        cx.split_sums[node.outputs[0]] = ("keys", tuple(int(c) for c in kcuts))
    cx.strategies[node.name or out] = (f"attention, {bh} heads x {nq} query blocks x {nk} key blocks over "
                                         f"{len(used)} tiles" + (f" in {rounds} rounds" if rounds > 1 else ""))

"""The matmul rule: a Linear's strategy (strategies.choose_linear, or with the matmul after it), its weights placed,
then round after round its operand gathered and its products made, K split over tiles summed by reduce-scatter; a
fused projection's parts apart when cheaper."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from tremula.codelets.fp8 import format_id
from tremula.errors import TremulaError
from tremula.ir.graph import Node
from tremula.numerics.fp8 import fp8_format
from tremula.plan.context import (
    ELEMENTWISE,
    I64,
    MATMULS,
    PANEL_PARTS,
    LoweringContext,
    _last_axis,
)
from tremula.plan.exchange import gather_rects, make_transfers
from tremula.plan.layout import even_cuts, view2d
from tremula.plan.strategies import (
    SourceShape,
    cdiv,
    choose_linear,
    choose_linear_pair,
    operand_gather_cycles,
    weight_block_budget,
)


def lower_linear(cx: LoweringContext, node, col0: int = 0) -> None:
    """col0: the node is one part of a fused projection (_fused_apart), its output that part's value, its weight
    and bias columns from col0 on."""
    x = node.inputs[0]
    out = node.outputs[0]
    if not has_weights(cx, node):
        raise TremulaError(f"{node.op} {node.name}: the weight must be a 2-D constant")
    xt = cx.types[x]
    m, k = view2d(xt.shape)
    n = cx.types[out].shape[-1]
    src = cx.layout_of(x)
    # Column-block outputs suit only consumers that keep the layout (a unary op) or read K-slices (a matmul).
    # (A Split on block edges, a fused projection's, passes column blocks on to the head views.)
    out_rows = not all(c.op in MATMULS or _unary(c) or c.op == "Split" for c in cx.consumers.get(out, []))
    even = src.even_col_parts  # n when the K cuts a matmul with pk = n makes are the operand's column blocks
    shape = SourceShape(int(np.diff(src.row_cuts).max()), int(np.diff(src.col_cuts).min()), out_rows, cx.n_linear,
                        even)
    # K cut at the operand's own column blocks (attention heads, a LayerNorm kept in place): each tile's K slice
    # is then whole source blocks, contiguous on both sides, and its exchange code does not grow with the rows.
    # A LayerNorm's column blocks are only a preference, priced against a free cut, the cheaper kept: the cut
    # changes the code bytes, which the permanent budget counts (perm_fraction; the first, fastest plan has none),
    # not a gather's cycles (BERT-base fp16 batch 16: the fused QKV made whole on 4 K parts and fc1 on 8, not
    # apart and on the LayerNorm's 12: 5.13 M -> 4.90 M cycles). Head cuts stay: freed, the tiny models' goldens
    # came out 0.2-0.5 % slower, their out-projection estimated faster on 128 tiles with whole rows than on 1024
    # with 2 K parts, and running slower.
    head_k = cx.head_parts.get(_through_elementwise(cx, x), 0)
    pk_fix = head_k or (even if 1 < even <= cx.T else 0)
    cuts = (pk_fix, 0) if pk_fix and not head_k else (pk_fix,)
    nxt = _next_matmul(cx, out)
    if node.name in cx.paired:  # the second of a pair: its K parts are the first's column blocks
        st = cx.paired.pop(node.name)
    elif nxt is not None:
        n2 = cx.types[nxt.inputs[1]].shape[1]
        st, cx.paired[nxt.name] = _noting_lean(cx, lambda rounds: min(
            (choose_linear_pair(cx.chip, m, k, n, n2, xt.dtype, cx.types[nxt.inputs[0]].dtype, cx.pm_max,
                                cx.temp_fraction, shape, cx.perm_fraction, c, _panel_parts(cx, nxt.outputs[0]),
                                _partials(node), _partials(nxt), rounds, cx.fraction(nxt)) for c in cuts),
            key=lambda p: (p[0].over + p[1].over, p[0].cycles + p[1].cycles)))
    else:
        # Output columns cut at head boundaries when attention reads them per head (its head views), or in the
        # residual stream's panels.
        pn_fix = cx.head_parts.get(out, 0) or _panel_parts(cx, out)
        st, = _noting_lean(cx, lambda rounds: (_cheapest_linear(cx, m, k, n, xt.dtype, shape, pn_fix, cuts,
                                                                      _partials(node), rounds),))
        if not col0 and _fused_apart(cx, node, st, m, k, shape, cuts):
            return
    share = cx.shared_x
    if share is not None and share.setdefault("key", st) != st:
        share = None  # (the parts chose otherwise than the whole's estimate: each gathers its own x)
    assert share is None or not st.kchunk, "parts sharing a gathered x gather it whole (_fused_apart)"
    rounds = _linear_rounds(cx, node, col0, st, src, m, k, n, share)
    if share is not None:  # the parts' rounds are interleaved by _fused_apart: round u of every part, then u + 1
        share.setdefault("rounds", []).append(rounds)
    else:
        for _ in rounds:
            pass


def has_weights(cx: LoweringContext, node) -> bool:
    """Whether a matmul's right operand is a 2-D constant (a Linear's stored weights)."""
    w = node.inputs[1]
    return w in cx.graph.constants and len(cx.types[w].shape) == 2


def _cheapest_linear(cx: LoweringContext, m: int, k: int, n: int, dtype: str, shape: SourceShape, pn_fix: int,
                     cuts: tuple[int, ...], partials: str, k_rounds: str | None = None):
    """choose_linear at each K cut of `cuts` (0: a free one), the cheapest by choose_linear's own key (bytes over
    the budgets, then cycles; the first on a tie)."""
    return min((choose_linear(cx.chip, m, k, n, dtype, cx.pm_max, cx.temp_fraction, shape, cx.perm_fraction,
                              pn_fix=pn_fix, pk_fix=c, partials=partials, k_rounds=k_rounds or cx.thrift)
                for c in cuts), key=lambda s: (s.over, s.cycles))


def _noting_lean(cx: LoweringContext, choose: Callable[[str], tuple]) -> tuple:
    """choose(k_rounds) -> strategies, at this lowering's thrift; when free K rounds were taken, what lean ones
    would save on a tile goes into lean_saves."""
    got = choose(cx.thrift)
    if cx.thrift == "free" and any(s.kchunk for s in got):
        lean = choose("lean")
        cx.lean_saves = max(cx.lean_saves, *(a.bytes_per_tile - b.bytes_per_tile for a, b in zip(got, lean)))
    return got


def _linear_rounds(cx: LoweringContext, node, col0: int, st, src, m: int, k: int, n: int, share: dict | None):
    """The Linear as planned (st): its tiles, weights, and round after round the operand gather and the products
    (a generator yielding after each round; its tiles and weights are placed when it is first resumed). `share`:
    a fused projection's parts lowered apart on one gathered operand (the first part's tiles, x buffer,
    partials and receive buffers; the later parts gather nothing)."""
    x, w, out = node.inputs[0], node.inputs[1], node.outputs[0]
    fp8 = node.op == "LinearFp8"  # inputs (x codes, w codes, w scale, bias): the quarter->half AMP path
    nb = 3 if fp8 else 2
    b = node.inputs[nb] if len(node.inputs) > nb and node.inputs[nb] else None
    xt, wt = cx.types[x], cx.types[w]
    mcuts, ncuts, kcuts = even_cuts(m, st.pm), even_cuts(n, st.pn), even_cuts(k, st.pk)
    pm, pn, pk = len(mcuts) - 1, len(ncuts) - 1, len(kcuts) - 1
    # tile of (i, j, l) at index (i * pn + j) * pk + l
    if share is not None and share["tl"] is not None:  # a later part of a projection apart: the first's tiles
        tl = share["tl"]
    else:
        tl = cx.stream_tiles(pm, pn * pk) if st.stream else cx.take_tiles(pm * pn * pk)
    gi = np.repeat(np.arange(pm), pn * pk)
    gj = np.tile(np.repeat(np.arange(pn), pk), pm)
    gl = np.tile(np.arange(pk), pm * pn)
    nj, kl = ncuts[gj + 1] - ncuts[gj], kcuts[gl + 1] - kcuts[gl]
    home = (gi == 0) if st.stream else np.ones(len(tl), bool)
    src_i = gj * pk + gl  # the tile of the same (j, l) in row group 0

    def place(v, dtype, r0, r1, c0, c1):
        return cx.weight_operand(f"{v}@{out}", v, dtype, tl, home, src_i, r0, r1, c0, c1)

    wbuf, wrel = place(w, wt.dtype, kcuts[gl], kcuts[gl + 1], col0 + ncuts[gj], col0 + ncuts[gj + 1])
    bias = place(b, cx.types[b].dtype, 0, 1, col0 + ncuts[gj], col0 + ncuts[gj + 1]) if b is not None else None
    # The FP8 weight's scale (QUARTER metadata) is a one-byte operand next to each weight block.
    meta = place(node.inputs[2], "int8", 0, 1, 0, 1) if fp8 else None
    isz = np.dtype(xt.dtype).itemsize
    mi = mcuts[gi + 1] - mcuts[gi]
    chunk = cdiv(int(mi.max()), st.serial)
    kc = st.kchunk or int(kl.max())  # columns of x a K round gathers (all of the tile's K slice: one round)
    gather = share is None or share["xbuf"] is None  # (a later part reads the first part's gathered x)
    xbuf = cx.new_buffer(f"{x}@{out}", "buffers", tl, chunk * np.minimum(kl, kc) * isz) if gather else \
        share["xbuf"]
    if share is not None:
        share["tl"], share["xbuf"] = tl, xbuf
    if pk == 1:
        yield from _linear_direct(cx, node, st, src, tl, gi, mcuts, ncuts, nj, k, chunk, xbuf, wbuf, wrel, bias,
                                       meta, gather, kc)
    else:
        yield from _linear_split_k(cx, node, st, src, tl, gi, gj, gl, mcuts, ncuts, kcuts, nj, kl, chunk, xbuf,
                                        wbuf, wrel, bias, meta, gather, share, kc)
    cx.strategies[node.name or out] = str(st) + (" half partials" if _partials(node) == "half" else "")
    if pk > 1:
        cx.split_sums[node.outputs[0]] = ("k", tuple(int(c) for c in kcuts))


def _fused_apart(cx: LoweringContext, node, st, m: int, k: int, shape: SourceShape, cuts: tuple[int, ...]) -> bool:
    """A fused projection (passes/fuse_qkv.py) whose parts, each planned alone, cost fewer cycles than the whole:
    lower each part as a Linear of its own over its weight columns, straight into its Split output (the Split
    then moves nothing). The whole wins when its one gather and wider blocks pay (ViT-B/16 fp16 batch 8); under a
    tight operand budget its wider output cut into more rounds than the parts' (SigLIP so400m fp8 batch 8: 12
    against 2). The parts have equal shapes, so they make the same choice: the same K cuts, which the matched
    reference follows as the whole node's (split_sums). Parts that attention does not read per head are always
    made apart: the whole one's free column cuts need not fall on the Split's points, whose re-layout its price
    leaves out. True when lowered so."""
    out = node.outputs[0]
    users = cx.consumers.get(out, [])
    if len(users) != 1 or users[0].op != "Split" or out in cx.graph.outputs:
        return False
    parts = users[0].outputs
    widths = {cx.types[o].shape[-1] for o in parts}
    if not _last_axis(users[0], cx.types) or len(widths) != 1:
        return False
    n = widths.pop()
    headed = all(o in cx.head_parts for o in parts)
    dtype = cx.types[node.inputs[0]].dtype
    one = _cheapest_linear(cx, m, k, n, dtype, shape, cx.head_parts.get(parts[0], 0), cuts, _partials(node))
    # The parts can share one gathered x: the first part gathers each round's rows on its tiles, the others run
    # on the same tiles and read them (BERT-base fp16 batch 16 gathered its layer input three times a layer).
    # Each part's weights then sit on those tiles too, all at once. Lean, only when their blocks together are no
    # bigger than the weight-block budget or the whole projection's own block (the unevenness the budget
    # bounds); free, whenever the memory plan finds room (BERT-base fp16 batch 128: 5,900 -> 6,043 seq/s).
    isz = np.dtype(cx.types[node.inputs[1]].dtype).itemsize
    together = len(parts) * (k * n * isz // (one.pn * one.pk))
    bounded = together <= max(weight_block_budget(cx.chip, cx.temp_fraction),
                              k * n * len(parts) * isz // (st.pn * st.pk))
    # (not in K rounds: the parts' partials would take turns in one buffer between a round's chunks)
    shared = not one.kchunk and share_gather(bounded, cx.thrift)
    if shared and not bounded:  # apart, a tile would hold one part's block at a time
        cx.lean_saves = max(cx.lean_saves, together - together // len(parts))
    apart = len(parts) * one.cycles - (len(parts) - 1) * operand_gather_cycles(cx.chip, m, k, dtype, one) \
        if shared else len(parts) * one.cycles
    if headed and (one.over, apart) >= (st.over, st.cycles):
        return False
    name = node.name or out
    first = len(cx.steps)
    share = cx.shared_x = {"tl": None, "xbuf": None} if shared else None
    try:
        for j, value in enumerate(parts):
            lower_linear(cx, Node(node.op, list(node.inputs), [value], dict(node.attrs), f"{name}.{j}"), j * n)
    finally:
        cx.shared_x = None
    # Round by round: the first part gathers round u's rows of x, every part computes on them, then round u + 1
    # (each round's rows overwrite the last's). Parts that chose otherwise ran through on their own already.
    pending = share.get("rounds", []) if share is not None else []
    while pending:
        pending = [r for r in pending if next(r, StopIteration) is not StopIteration]
    for step in cx.steps[first:]:  # attributed to the fused node's output, as its steps when made whole
        if step.origin is not None and step.origin.value in parts:
            step.origin = dataclasses.replace(step.origin, value=out)
    cuts = {cx.split_sums.pop(v, None) for v in parts}
    assert len(cuts) == 1, cuts  # equal parts, equal choices
    cut = cuts.pop()
    if cut is not None:
        cx.split_sums[out] = cut
    cx.strategies[name] = (f"{len(parts)} projections apart{' on one gathered operand' if shared else ''} "
                             f"(~{apart} cycles against ~{st.cycles} as one)")
    return True


def _panel_parts(cx: LoweringContext, value: str) -> int:
    """Column parts for a matmul output that a residual Add reads, under a memory budget (0: free choice).

    Then the residual stream, the LayerNorms kept in place on it and every matmul around it share one cut of the
    model width into PANEL_PARTS column blocks: the Adds' re-layouts and the matmuls' K-slice gathers move
    whole blocks, and the exchange code stops growing with the rows (SigLIP so400m at batch 4: the LayerNorms'
    and residual Adds' re-layouts were 33 KB of code a tile)."""
    if cx.perm_fraction is None:
        return 0
    users = cx.consumers.get(value, [])
    return PANEL_PARTS if any(c.op in ("Add", "Sub") and len([i for i in c.inputs if i]) == 2 for c in users) else 0


def _through_elementwise(cx: LoweringContext, value: str) -> str:
    """The value that `value` is a chain of one-input element-wise ops of (itself when it is not)."""
    while True:
        p = cx.producers.get(value)
        if p is None or not _unary(p):
            return value
        value = p.inputs[0]


def _next_matmul(cx: LoweringContext, value: str):
    """The matmul (constant 2-D weight) that reads `value` as its x through a chain of one-input element-wise ops
    with no other readers (an MLP's fc1 -> Gelu -> [quantize] -> fc2), or None."""
    while True:
        users = cx.consumers.get(value, [])
        if len(users) != 1 or value in cx.graph.outputs:
            return None
        c = users[0]
        if c.op in MATMULS:
            w = c.inputs[1]
            ok = c.inputs[0] == value and w in cx.graph.constants and len(cx.types[w].shape) == 2
            return c if ok and c.name else None
        if not _unary(c):
            return None
        value = c.outputs[0]


def _matmul_codelet(cx: LoweringContext, node, meta, live, has_bias: int, acc: bool = False) -> tuple[str, list, list]:
    """(codelet, params, extra operands after x and w): the FP8 path adds the weight-scale operand; half partials
    add the AMP's group (codelets/matmul.py); `acc`: a later K round, which adds into the partials so far."""
    if meta is None:
        group = int(node.attrs.get("group", 0)) if _partials(node) == "half" else 0
        assert group or not acc, "K rounds need half partials"
        return "matmul", [has_bias] + ([group] if group else []) + ([1] if acc else []), []
    a, (x, w) = node.attrs, node.inputs[:2]
    params = [has_bias, format_id(fp8_format(cx.types[x].dtype)), format_id(fp8_format(cx.types[w].dtype)),
              int(a["x_scale"]), int(a["group"])]  # x_scale: column 3 (plan/replay.PER_LAYER_PARAMS)
    return "matmul_fp8", params + ([1] if acc else []), [(meta[0][live], meta[1][live], 1, 1)]


def _linear_direct(cx: LoweringContext, node, st, src, tl, gi, mcuts, ncuts, nj, k, chunk, xbuf, wbuf, wrel, bias,
                   meta=None, gather: bool = True, kc: int = 0) -> None:
    """Whole K on each tile; in K rounds of kc columns (st.kchunk) the half partials build up in the output's
    own bytes and the last round adds the bias."""
    x, w, out = node.inputs[0], node.inputs[1], node.outputs[0]
    xt, wt, ot = cx.types[x], cx.types[w], cx.types[out]
    isz, wsz, osz = (np.dtype(t.dtype).itemsize for t in (xt, wt, ot))
    pm, pn = len(mcuts) - 1, len(ncuts) - 1
    lay = cx.alloc_layout(out + "@mm", mcuts[-1], ncuts[-1], ot.dtype, mcuts, ncuts, tl.reshape(pm, pn))
    orel = lay.rel.reshape(-1)
    kc = kc or k
    ks = cdiv(k, kc)
    for u in range(st.serial):
        r0 = np.minimum(mcuts[gi] + u * chunk, mcuts[gi + 1])
        r1 = np.minimum(r0 + chunk, mcuts[gi + 1])
        live = r1 > r0
        rows = (r1 - r0)[live]
        res = (lay.buf, orel[live] + (r0 - mcuts[gi])[live] * nj[live] * osz, rows, nj[live])
        for v in range(ks):
            c0, c1 = v * kc, min(k, (v + 1) * kc)
            if gather:
                cx.exchange(gather_rects(src, r0[live], r1[live], c0, c1, tl[live], xbuf, 0, (c1 - c0) * isz))
            last = v == ks - 1
            codelet, params, extra = _matmul_codelet(cx, node, meta, live, int(bias is not None and last), v > 0)
            ops = [(xbuf, 0, rows, c1 - c0), (wbuf[live], wrel[live] + c0 * nj[live] * wsz, c1 - c0, nj[live])]
            ops += extra
            if bias and last:
                ops.append((bias[0][live], bias[1][live], 1, nj[live]))
            ops += [res] * (1 + (v > 0))  # a later round reads the partials so far, then writes them
            dtypes = (xt.dtype, wt.dtype) + (("int8",) if meta else ()) + ((ot.dtype,) if bias and last else ()) \
                + (ot.dtype,) * (1 + (v > 0))
            cx.compute([cx.group(codelet, dtypes, tl[live], params, ops)], out,
                         part=_round_label(u, st.serial, v, ks))
        yield
    cx.set_output(out, lay)


def _linear_split_k(cx: LoweringContext, node, st, src, tl, gi, gj, gl, mcuts, ncuts, kcuts, nj, kl, chunk, xbuf,
                    wbuf, wrel, bias, meta=None, gather: bool = True, share: dict | None = None, kc: int = 0):
    """K split over pk tiles: each computes a float32 partial; the owner of each row slice sums them (+ bias).
    A generator: it yields after each round (the caller runs it through, or interleaves a fused projection's
    parts round by round). gather False: a fused projection's first part gathers x into xbuf in every round;
    with `share`, the parts also use one partials and one receive buffer (they are used one part after the
    other). In K rounds of kc columns (st.kchunk) each tile's partials build up over its slice's rounds before
    the reduce."""
    x, w, out = node.inputs[0], node.inputs[1], node.outputs[0]
    xt, wt, ot = cx.types[x], cx.types[w], cx.types[out]
    isz, wsz = np.dtype(xt.dtype).itemsize, np.dtype(wt.dtype).itemsize
    pm, pn, pk = len(mcuts) - 1, len(ncuts) - 1, len(kcuts) - 1
    kc = kc or int(kl.max())
    ks = cdiv(int(kl.max()), kc)
    nt = len(tl)
    # Output row blocks: for each i, round u and owner l, a slice of the round's rows (empty slices dropped).
    blocks_ = []  # (i, u, l, r0, r1)
    for i in range(pm):
        for u in range(st.serial):
            a0 = min(int(mcuts[i]) + u * chunk, int(mcuts[i + 1]))
            a1 = min(a0 + chunk, int(mcuts[i + 1]))
            sc = _split(a1 - a0, pk) + a0
            for l_ in range(pk):
                if sc[l_ + 1] > sc[l_]:
                    blocks_.append((i, u, l_, int(sc[l_]), int(sc[l_ + 1])))
    bi = np.array([bb[0] for bb in blocks_])
    bl = np.array([bb[2] for bb in blocks_])
    row_cuts = np.array([bb[3] for bb in blocks_] + [int(mcuts[-1])], I64)
    owner = ((bi[:, None] * pn + np.arange(pn)[None, :]) * pk + bl[:, None])  # index into tl, per (block, j)
    lay = cx.alloc_layout(out + "@mm", int(mcuts[-1]), int(ncuts[-1]), ot.dtype, row_cuts, ncuts, tl[owner])
    block_of = np.full((pm, st.serial, pk), -1, I64)  # (i, u, l) -> its row block
    for r, bb in enumerate(blocks_):
        block_of[bb[0], bb[1], bb[2]] = r
    sub_max = cdiv(chunk, pk)
    nj_max = int(nj.max())
    # The quarter -> half AMP's partials are half values already (numerics/fp8.amp_fp8_matmul): kept as half, they
    # take half the bytes and exchange. With half partials (passes/precision.with_partials) the half matmuls' are
    # half too, and the owners sum them in half; otherwise partials are float32 and summed in float32.
    half = _partials(node) == "half"
    pdt = "float16" if meta is not None or half else "float32"
    psz = np.dtype(pdt).itemsize
    slot = sub_max * nj_max * psz
    if share is not None and "pbuf" in share:
        pbuf, rbuf = share["pbuf"], share["rbuf"]
    else:
        pbuf = cx.new_buffer(f"{out}@partial", "buffers", tl, chunk * nj * psz)
        rbuf = cx.new_buffer(f"{out}@recv", "buffers", tl, (pk - 1) * slot)
        if share is not None:
            share["pbuf"], share["rbuf"] = pbuf, rbuf
    idx = np.arange(nt)
    for u in range(st.serial):
        r0 = np.minimum(mcuts[gi] + u * chunk, mcuts[gi + 1])
        r1 = np.minimum(r0 + chunk, mcuts[gi + 1])
        live = r1 > r0
        if not live.any():
            yield
            continue
        for v in range(ks):
            a0 = kcuts[gl] + v * kc
            a1 = np.minimum(a0 + kc, kcuts[gl + 1])
            lv = live & (a1 > a0)  # (a tile's K slice may be a round shorter than the widest)
            cols = (a1 - a0)[lv]
            if gather:
                cx.exchange(gather_rects(src, r0[lv], r1[lv], a0[lv], a1[lv], tl[lv], xbuf, 0, cols * isz))
            rows = (r1 - r0)[lv]
            codelet, params, extra = _matmul_codelet(cx, node, meta, lv, 0, v > 0)
            if meta is None:  # (the FP8 AMP writes its half partials itself)
                assert half or ks == 1, "K rounds need half partials"
                codelet, params = "matmul_partial", ([int(node.attrs["group"])] if half else []) + [1] * (v > 0)
            ops = [(xbuf, 0, rows, cols), (wbuf[lv], wrel[lv] + v * kc * nj[lv] * wsz, cols, nj[lv]), *extra]
            ops += [(pbuf, 0, rows, nj[lv])] * (1 + (v > 0))  # a later round reads the partials so far
            dts = (xt.dtype, wt.dtype) + (("int8",) if meta else ()) + (pdt,) * (1 + (v > 0))
            cx.compute([cx.group(codelet, dts, tl[lv], params, ops)], out, "partials",
                         _round_label(u, st.serial, v, ks))
        # Reduce-scatter: the slice owned by l goes from every other (i, j, l') to (i, j, l).
        rows_all = r1 - r0
        snd = np.repeat(idx, pk)
        own = np.tile(np.arange(pk), nt)
        lp = gl[snd]
        s0, s1 = _cut(rows_all[snd], pk, own), _cut(rows_all[snd], pk, own + 1)
        keep = (own != lp) & live[snd] & (s1 > s0)
        snd, own, lp, s0, s1 = snd[keep], own[keep], lp[keep], s0[keep], s1[keep]
        if len(snd):
            recv = snd - lp + own  # the same (i, j), owner l
            slot_i = np.where(lp < own, lp, lp - 1)
            nb_ = (s1 - s0) * nj[snd] * psz
            # Slots packed at the slice's own size: the received partials are one [(pk - 1) * sub, nj] matrix,
            # one operand of the reduce vertex (a vertex field per partial made its state grow with pk).
            cx.exchange(make_transfers(tl[snd], pbuf, s0 * nj[snd] * psz, 1, nb_, nb_, tl[recv], rbuf,
                                         slot_i * nb_, nb_))
        # Owners sum their own slice of the partial with the received ones.
        c0, c1 = _cut(rows_all, pk, gl), _cut(rows_all, pk, gl + 1)
        o_idx = idx[live & (c1 > c0)]
        if not len(o_idx):
            yield
            continue
        s0, sub = c0[o_idx], (c1 - c0)[o_idx]
        rb = block_of[gi[o_idx], u, gl[o_idx]]
        orel = lay.rel[rb, gj[o_idx]]
        njo = nj[o_idx]
        ops = [(pbuf, s0 * njo * psz, sub, njo), (rbuf, 0, (pk - 1) * sub, njo)]
        if bias:
            ops.append((bias[0][o_idx], bias[1][o_idx], 1, njo))
        ops.append((lay.buf, orel, sub, njo))
        dtypes = (pdt, pdt) + ((ot.dtype,) if bias else ()) + (ot.dtype,)
        params = np.zeros((len(o_idx), 4 if half else 2), I64)  # (pk, bias[, half, own part index])
        params[:, 0], params[:, 1] = pk, int(bias is not None)
        if half:
            params[:, 2], params[:, 3] = 1, gl[o_idx]
        cx.compute([cx.group("reduce_partials", dtypes, tl[o_idx], params, ops)], out,
                     "reduce", f" ({u + 1}/{st.serial})" if st.serial > 1 else "")
        yield
    cx.set_output(out, lay)


def _round_label(u: int, serial: int, v: int, ks: int) -> str:
    """A matmul step's round in its label: row round u of serial, K round v of ks (nothing for one round)."""
    rows = f"{u + 1}/{serial}" if serial > 1 else ""
    k = f"K {v + 1}/{ks}" if ks > 1 else ""
    return f" ({rows}{', ' if rows and k else ''}{k})" if rows or k else ""


def share_gather(bounded: bool, thrift: str) -> bool:
    """Whether a fused projection's parts lowered apart share one gathered operand (_fused_apart): always
    when the plan takes its choices free, only within the weight-block budget (`bounded`) when lean. (A seam: a test
    makes every part gather its own.)"""
    return bounded or thrift == "free"


def _partials(node) -> str:
    """What a matmul node accumulates in: "half" when passes/precision.with_partials marked it, else "float"."""
    return "half" if node.attrs.get("partials") == "half" else "float"


def _unary(node) -> bool:
    """A one-input element-wise op: it keeps its input's layout block for block."""
    return node.op in ELEMENTWISE and sum(map(bool, node.inputs)) == 1


def _split(rows: int, parts: int) -> np.ndarray:
    """parts+1 cuts of range(rows) into nearly equal slices, empty slices at the end when rows < parts."""
    base, extra = divmod(rows, parts)
    sizes = base + (np.arange(parts) < extra)
    return np.concatenate([[0], np.cumsum(sizes)]).astype(I64)


def _cut(rows, parts: int, l_):
    """Cut l_ of _split(rows, parts), vectorised over rows (and l_)."""
    base, extra = np.divmod(np.asarray(rows, I64), parts)
    return l_ * base + np.minimum(l_, extra)

"""Plan -> Program: liveness of every buffer, the memory plan and address resolution (a step's cycles:
target/step_cost.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tremula.plan.exchange import SymTransfers
from tremula.plan.layout import blocks
from tremula.plan.elements import apart_pairs
from tremula.plan.memory import MemoryPlan, plan_memory
from tremula.target.overheads import reserved_bytes
from tremula.errors import TremulaError
from tremula.plan.share import check_weight_strides, find_sharing, patch_columns
from tremula.plan.state import LoweringState
from tremula.plan.stream import Streaming
from tremula.program import (BufferTable, Call, ConstImage, FieldPatch, HostStream, Program, Step, TransferTable,
                             VertexGroup)

I64 = np.int64


@dataclass
class Liveness:
    first: np.ndarray
    last: np.ndarray


class StreamConflict(TremulaError):
    """Streamed weights would be read before they arrive, or after the next layer's took their place."""


def liveness(state: LoweringState, streaming: Streaming | None = None) -> Liveness:
    """First and last half-step touching each buffer (host inputs at -1, outputs read at 2*steps, weights always;
    streamed weights from the compute of the step they arrive at, to their last reader)."""
    n = len(state.bufs)
    big = 2 * len(state.steps) + 1
    first = np.full(n, big, I64)
    last = np.full(n, -1, I64)

    def touch(bufs, t: int) -> None:
        bufs = np.asarray(bufs, I64).reshape(-1)
        if len(bufs) > 1:  # a group's or a transfer set's buffers come in runs: the first of each run is enough
            heads = np.empty(len(bufs), bool)
            heads[0] = True
            np.not_equal(bufs[1:], bufs[:-1], out=heads[1:])
            bufs = bufs[heads]
        if len(bufs):  # repeated buffers all get the same t, so a plain fancy assignment is enough
            first[bufs] = np.minimum(first[bufs], t)
            last[bufs] = np.maximum(last[bufs], t)

    for s in state.host_in:
        touch([s.layout.buf], -1)
    flat = lambda a: np.asarray(a, I64).reshape(-1)  # noqa: E731
    for k, st in enumerate(state.steps):  # a half-step's buffers in one touch (tens of thousands of calls less)
        if st.groups:
            touch(np.concatenate([flat(g.bufs) for g in st.groups]), 2 * k)
        if st.transfers:
            touch(np.concatenate([flat(t.src_buf) for t in st.transfers] + [flat(t.d_buf) for t in st.transfers]),
                  2 * k + 1)
    for s in state.host_out:
        touch([s.layout.buf], 2 * len(state.steps))
    streamed = np.zeros(n, bool) if streaming is None else streaming.arrive >= 0
    if streamed.any():
        at = 2 * streaming.arrive[streamed]
        if (first[streamed] < at).any():
            raise StreamConflict("a streamed weight is read before it arrives")
        first[streamed] = at
    for b, spec in enumerate(state.bufs):
        if spec.category == "weights" and not streamed[b]:
            first[b], last[b] = -1, big
    never = first > last  # allocated but unused (e.g. an empty serial round): give it a point life
    first[never], last[never] = 0, 0
    if streamed.any():
        b = np.flatnonzero(streaming.alias >= 0)
        if (last[streaming.alias[b]] >= first[b]).any():
            raise StreamConflict("a streamed layer's weights are still read when the next one takes their place")
    return Liveness(first, last)


def memory_plan(state: LoweringState, chip, streaming: Streaming | None = None, both_orders: bool = False
                ) -> tuple[MemoryPlan, Liveness, dict[str, np.ndarray]]:
    """The memory plan, with shared layer code where the lowering asked for it and the layers prove identical
    (state.sharing is set to what was shared, or None), and the weights of `streaming` streamed from the host
    (plan/stream.py; state.streaming is set to it, or None). StreamConflict: the streaming cannot be done.
    both_orders: buffers placed by first moment and largest first, the lower peak kept (plan/memory.py)."""
    if streaming is not None and not streaming.any:
        streaming = None
    live = liveness(state, streaming)
    state.streaming = streaming
    state.both_orders = both_orders  # (pipeline.relowered makes a plan's memory plan again the same way)
    memo = _memo(state)
    if "sharing" not in memo:
        sharing = find_sharing(state) if getattr(state, "share_layers", False) else None
        memo["sharing"] = sharing if sharing is not None and sharing.shared_layers else None
        memo["is_w"] = np.array([b.category == "weights" for b in state.bufs], bool)
        memo["apart"] = apart_pairs(state.steps)
    sharing, is_w, apart = memo["sharing"], memo["is_w"], memo["apart"]
    while True:
        key = ("reserved", sharing is not None)
        if key not in memo:
            counted = getattr(state, "exchange_code", None) if sharing is None else None  # (Lowerer's code_limit)
            memo[key] = reserved_bytes(state.T, state.steps, chip, sharing, is_w, counted)
        reserved = memo[key]
        mp = plan_memory([b.category for b in state.bufs], [b.tiles for b in state.bufs],
                         [b.sizes for b in state.bufs], live.first, live.last, state.T, reserved,
                         chip.sram_bytes_per_tile, sharing.runs if sharing is not None else (),
                         chip.operand_align_bytes, chip.non_interleaved_bytes_per_tile, apart, chip,
                         streaming.alias if streaming is not None else None, (False, True) if both_orders else (False,))
        if sharing is None or not check_weight_strides(sharing, mp):
            break
        sharing = None  # weights not at one distance per tile: the layers cannot share exchange code; plan without
    state.sharing = sharing
    return mp, live, reserved


def _memo(state: LoweringState) -> dict:
    """What memory_plan derives from a lowering alone (the layers it shares, the bytes their code and vertex state
    reserve, the operands kept apart), kept on the state (a lowering is for one chip and is not changed after):
    plan/stream tries several streamings of one lowering, and these do not depend on which weights are streamed
    (bert-base b128: 5 s of its 71 s compile a second try)."""
    return state.__dict__.setdefault("_plan_memo", {})


def _streams(state_streams, mp: MemoryPlan) -> list[HostStream]:
    out = []
    for s in state_streams:
        lay = s.layout
        tl, rel, r0, r1, c0, c1 = blocks(lay)
        rel = mp.resolve(np.full(len(tl), lay.buf), tl) + rel
        for t, r, a0, a1, b0, b1 in zip(tl.tolist(), rel.tolist(), r0.tolist(), r1.tolist(), c0.tolist(), c1.tolist()):
            if a1 > a0 and b1 > b0:
                out.append(HostStream(s.name, t, int(r), a0 * lay.cols + b0, a1 - a0, b1 - b0,
                                      lay.cols, lay.dtype))
    return out


def to_program(state: LoweringState, chip, mp: MemoryPlan, live: Liveness, reserved: dict[str, np.ndarray],
               dtype: str, batch: int, io_types: dict) -> Program:
    res = mp.resolve
    steps = []
    for st in state.steps:
        groups = [VertexGroup(g.codelet, g.dtypes, g.tiles.astype(np.int32), g.params.astype(I64),
                              (res(g.bufs, g.tiles[:, None]) + g.rels).astype(I64), g.shapes.astype(I64))
                  for g in st.groups]
        t = SymTransfers.concat(st.transfers, I64)
        table = TransferTable(t.src_tile.astype(np.int32), res(t.src_buf, t.src_tile) + t.src_rel, t.rows,
                              t.row_bytes, t.src_stride, t.dst_start, t.d_tile.astype(np.int32),
                              res(t.d_buf, t.d_tile) + t.d_rel, t.d_stride)
        steps.append(Step(groups, table, st.label, origin=st.origin))
    sharing = getattr(state, "sharing", None)
    if sharing is not None:
        steps = _calls(state, sharing, steps)
    consts = []
    streaming = getattr(state, "streaming", None)
    for c in state.consts:
        addrs = res(np.full(len(c.tiles), c.buf), c.tiles) + c.rels
        step = int(streaming.arrive[c.buf]) if streaming is not None else -1
        for t, a, a0, a1, b0, b1 in zip(c.tiles.tolist(), addrs.tolist(), c.r0.tolist(), c.r1.tolist(),
                                        c.c0.tolist(), c.c1.tolist()):
            consts.append(ConstImage(c.name, t, int(a), a0, a1, b0, b1, c.dtype, step))
    bufs = state.bufs
    counts = [len(b.tiles) for b in bufs]
    tile_start = np.concatenate([[0], np.cumsum(counts)]).astype(I64)
    b_tiles = np.concatenate([b.tiles for b in bufs]).astype(I64) if bufs else np.zeros(0, I64)
    b_ids = np.repeat(np.arange(len(bufs)), counts)
    bt = BufferTable([b.name for b in bufs], [b.category for b in bufs], live.first, live.last, tile_start,
                     b_tiles.astype(np.int32), res(b_ids, b_tiles).astype(I64),
                     np.concatenate([b.sizes for b in bufs]).astype(I64) if bufs else np.zeros(0, I64))
    program = Program(chip.name, chip.tiles, chip.sram_bytes_per_tile, dtype, batch, steps,
                      _streams(state.host_in, mp), _streams(state.host_out, mp), consts, bt, io_types,
                      sum(reserved.values()).astype(I64),
                      reserved_split={k: np.asarray(v, I64) for k, v in reserved.items()})
    _check_reserved(program, chip, reserved)
    return program


def _check_reserved(program: Program, chip, reserved: dict[str, np.ndarray]) -> None:
    """The code, vertex state and exchange code the Program holds, counted from its own steps, fit in what the memory
    plan reserved for them on every tile (receives into adjacent buffers can make the count smaller, never larger)."""
    counted = reserved_bytes(program.tiles, program.steps, chip)
    for cat, have in counted.items():
        over = np.flatnonzero(have > reserved[cat])
        if len(over):
            t = int(over[0])
            raise TremulaError(f"internal: the Program holds {int(have[t]):,} B of {cat.replace('_', ' ')} on tile "
                               f"{t}, the memory plan reserved {int(reserved[cat][t]):,} B; plan rejected")


def _calls(state: LoweringState, sharing, steps: list[Step]) -> list[Step]:
    """Each shared layer's step as a Call of its template step: the fields and weight base that differ, checked to
    give back exactly the step the layer was lowered to (matching is checked, never assumed)."""
    is_w = np.array([b.category == "weights" for b in state.bufs], bool)
    for t in set(sharing.calls.values()):
        src_buf = SymTransfers.concat(state.steps[t].transfers).src_buf
        steps[t].exchange.based = is_w[src_buf]
    out = list(steps)
    for k, t in sorted(sharing.calls.items()):
        tmpl, mine = steps[t], steps[k]
        fields = []
        for ga, gb, pa, pb in zip(state.steps[t].groups, state.steps[k].groups, tmpl.compute, mine.compute):
            ac, pc = patch_columns(ga, gb, is_w)
            fields.append(FieldPatch(ac, pb.addrs[:, ac], pc, pb.params[:, pc]))
        base_tiles, base = _weight_base(tmpl.exchange, mine.exchange, mine.label)
        call = Step([], TransferTable.empty(), mine.label, Call(t, fields, base_tiles, base), tmpl, mine.origin)
        for a, b in zip(call.compute, mine.compute):
            if not all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("tiles", "params", "addrs", "shapes")):
                raise TremulaError(f"internal: step {k} ({mine.label}) is not its template's code with its patch")
        a, b = call.exchange, mine.exchange
        if not all(np.array_equal(getattr(a, f), getattr(b, f)) for f in _TABLE_FIELDS):
            raise TremulaError(f"internal: step {k} ({mine.label}) does not exchange as its template with its base")
        out[k] = call
    return out


_TABLE_FIELDS = ("src_tile", "src_addr", "rows", "row_bytes", "src_stride", "dst_start", "d_tile", "d_addr",
                 "d_stride")


def _weight_base(tmpl: TransferTable, mine: TransferTable, label: str) -> tuple[np.ndarray, np.ndarray]:
    """(tiles, base): the distance of the layer's weights from the template's on each tile that sends from them."""
    based = tmpl.based if tmpl.based is not None else np.zeros(len(tmpl), bool)
    if len(tmpl) != len(mine):
        raise TremulaError(f"internal: step {label} has other transfers than its template")
    delta = np.asarray(mine.src_addr, I64) - np.asarray(tmpl.src_addr, I64)
    tiles = np.asarray(tmpl.src_tile, I64)[based]
    u, first = np.unique(tiles, return_index=True)
    base = delta[based][first]
    if not np.array_equal(delta[based], base[np.searchsorted(u, tiles)]):
        raise TremulaError(f"internal: step {label}'s weights are not at one distance per tile from its template's")
    return u.astype(I64), base.astype(I64)

"""Build a typed Profile (summary, per-op rows, per-step rows, per-tile memory, liveness) from a compiled Program.

Every number comes from the Program and the one cost model: a step's per-tile compute, exchange and sync cycles are
`target.step_cost.price_step`'s, the function the compile's totals charge (so the busiest tile here IS the step's
compute cost), and memory comes from the Program's BufferTable and reserved bytes. Nothing here is a second cost
model.

When the exchanges were scheduled (timing.program_schedule), each step's exchange is charged its timetable's makespan
instead of the planner's bound, the bound and the ratio are kept beside it, and the timetables' exchange code is set
against the memory plan's estimate (exchange_code.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import tremula.codelets  # noqa: F401  (registers each codelet's cycle estimate, which price_step charges)
from tremula.codelets.matmul import partials_of, stored_weights
from tremula.ir.graph import Graph, Node
from tremula.ir.ops import flops as op_flops
from tremula.numerics.fp8 import is_fp8
from tremula.program import Program, Step
from tremula.report.exchange_code import ExchangeCode, exchange_code
from tremula.target import cost, cost_terms
from tremula.target.step_cost import distinct_vertices, price_step
from tremula.timing.program_schedule import StepExchange, summarize

I64 = np.int64
# Memory categories in display order (the same six as the memory plan and the "does not fit" error).
CATEGORIES = ("weights", "activations", "buffers", "code", "vertex_state", "exchange_code")
RESERVED = ("code", "vertex_state", "exchange_code")
MATMUL_CODELETS = ("matmul", "matmul_partial", "matmul_fp8")
ATTENTION_CODELETS = ("attention", "attention_partial")


@dataclass
class Summary:
    chip: str
    model: str
    batch: int
    dtype: str
    fits: bool
    tiles: int
    sram_bytes_per_tile: int
    clock_hz: float
    steps: int
    cycles: int
    compute_cycles: int
    exchange_cycles: int
    sync_cycles: int
    latency_s: float  # one batch end to end: host in + the forward's `cycles` + host out
    throughput: float  # samples per second: batch / latency (host transfers do not overlap device work, CompileResult)
    model_flops: int  # FLOPs of one forward pass of the whole batch (the graph is built at this batch)
    peak_flops: float  # chip matmul peak FLOP/s for the dtype
    mfu: float  # model FLOPs / latency / peak
    compile_seconds: float
    fullest_tile: int
    peak_tile_bytes: int
    fullest_tile_bytes: dict[str, int]  # live bytes by category on the fullest tile at its peak
    # "timetables" when exchange_cycles (and cycles, latency, throughput, MFU) charge the scheduled makespans,
    # "cost model" when they charge the planner's bound (busiest tile's bytes / bandwidth + fixed cost).
    exchange_source: str = "cost model"
    priced_cycles: int = 0  # cycles with every exchange at the planner's bound (= cycles without timetables)
    priced_exchange_cycles: int = 0
    timetables: dict | None = None  # ScheduleSummary.to_json() when exchanges were scheduled
    host_in_cycles: int = 0  # the Program's input streams over the host link (CompileResult.host_in_cycles)
    host_out_cycles: int = 0


@dataclass
class StepRow:
    index: int
    label: str
    node: str  # graph node the step serves ("" when none)
    op: str
    start: int  # first cycle of the step from the start of the program
    compute: int  # busiest tile's compute cycles
    sync: int
    exchange: int
    tiles_used: int  # tiles with at least one vertex
    vertices: int
    mean_tile_cycles: float  # mean compute cycles over the tiles used
    balance: float  # max / mean compute cycles over the tiles used (1.0 = perfectly balanced)
    busiest_tile: int  # tile whose compute sets the step's compute cycles (-1: no compute)
    amp_cycles: int  # busiest tile's cycles in AMP matmuls (matmul codelets, attention's two products)
    amp_ideal_cycles: float  # the same MACs at the AMP's peak rate (0 when the tile runs no matmul)
    exchange_bytes: int  # bytes sent (a multicast counts once)
    max_tile_sent: int
    max_tile_received: int
    live_peak_tile_bytes: int  # max over tiles of live data + reserved bytes during the step
    live_total_bytes: int  # live data bytes summed over all tiles during the step
    codelets: tuple[str, ...]
    priced_exchange: int | None = None  # the planner's bound for this exchange (price_step); build_profile sets it
    exchange_makespan: int | None = None  # the scheduled timetable's cycles (None: not scheduled, or no exchange)
    exchange_lower_bound: int | None = None  # the timetable's lower bound (busiest port, bus groups counted)
    exchange_ratio: float | None = None  # makespan / lower bound

    @property
    def total(self) -> int:
        return self.compute + self.sync + self.exchange


@dataclass
class OpRow:
    node: str
    op: str
    steps: list[int]
    compute: int
    sync: int
    exchange: int
    pct: float  # % of the program's cycles
    flops: int
    utilisation: float  # flops / (cycles / clock) / peak
    tiles_used: int
    exchange_bytes: int
    weight_bytes: int  # constants the node reads
    activation_bytes: int  # bytes of the node's outputs

    @property
    def cycles(self) -> int:
        return self.compute + self.sync + self.exchange


@dataclass
class OpTypeRow:
    op: str
    count: int
    cycles: int
    pct: float
    flops: int
    utilisation: float
    exchange_bytes: int
    nodes: list[OpRow] = field(default_factory=list)


@dataclass
class Profile:
    summary: Summary
    ops: list[OpRow]  # per graph node, costliest first
    op_types: list[OpTypeRow]  # per op type, costliest first
    steps: list[StepRow]  # in program order
    tile_memory: dict[str, list[int]]  # category -> bytes per tile (live data at each tile's own peak + reserved)
    tile_compute: list[list[int]] | None = None  # per step, per tile compute cycles (kept for the trace)
    why: list[str] = field(default_factory=list)
    exchange_code: ExchangeCode | None = None  # timetables' exchange code vs the memory plan's estimate

    def to_json(self) -> dict:
        """Plain JSON-able dict (per-tile arrays included, per-step per-tile cycles left out)."""
        s = self.summary
        return {
            "summary": dict(s.__dict__),
            "why": list(self.why),
            "ops": [{**o.__dict__, "cycles": o.cycles} for o in self.ops],
            "op_types": [{k: v for k, v in t.__dict__.items() if k != "nodes"} for t in self.op_types],
            "steps": [{**{k: (list(v) if isinstance(v, tuple) else v) for k, v in r.__dict__.items()},
                       "total": r.total} for r in self.steps],
            "tile_memory": {k: list(v) for k, v in self.tile_memory.items()},
            "exchange_code": self.exchange_code.to_json() if self.exchange_code else None,
        }


# ------------------------------------------------------------------------------------------------ per-tile compute


def _amp_parts(chip, codelet_name: str, shapes, dtype: str, partials: str = "float") -> tuple[int, float]:
    """(modelled AMP cycles, ideal cycles at the AMP peak) of the matrix products inside one vertex, priced by the
    same cost_terms functions its codelet's cycle estimate uses; (0, 0) for vertices without matmuls."""
    if codelet_name in MATMUL_CODELETS:  # x [m,k] @ w [k,n]
        prods = [(shapes[0][0], shapes[0][1], shapes[1][1])]
    elif codelet_name in ATTENTION_CODELETS:  # q [r,d] @ k^T -> [r,sk], then @ v [sk,dv]
        (r, d), (sk, _), (_, dv) = shapes[0], shapes[1], shapes[2]
        prods = [(r, d, sk), (r, sk, dv)]
    else:
        return 0, 0.0
    weights = stored_weights(codelet_name, partials)  # (as its codelet prices them)
    amp = sum(cost_terms.matmul_cycles(chip, m, k, n, dtype, partials, weights=weights) for m, k, n in prods)
    # The ideal is at the rate of the AMP path the vertex runs on (FP8 codes: quarter->half; half inputs: half->half
    # with half partials, else half->float).
    acc = "fp16" if is_fp8(dtype) or (partials == "half" and dtype == "float16") else "fp32"
    ideal = sum(cost.amp_peak_cycles(chip, m, k, n, _amp_in(dtype), acc) for m, k, n in prods)
    return int(amp), float(ideal)


def tile_work(chip, step: Step, tiles: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(vertex count, AMP cycles, ideal AMP cycles) per tile of one step: what its compute cycles
    (target/step_cost.price_step) are made of."""
    nv = np.zeros(tiles, I64)
    amp = np.zeros(tiles, I64)
    ideal = np.zeros(tiles, np.float64)
    for g in step.compute:
        if not len(g):
            continue
        nv += np.bincount(g.tiles, minlength=tiles).astype(I64)
        if g.codelet in MATMUL_CODELETS + ATTENTION_CODELETS:
            _, shapes, inv = distinct_vertices(g)
            partials = partials_of(g.codelet, g.params[:1])
            parts = [_amp_parts(chip, g.codelet, sh, g.dtypes[0], partials) for sh in shapes]
            va = np.array([p[0] for p in parts], I64)
            vi = np.array([p[1] for p in parts], np.float64)
            amp += np.bincount(g.tiles, weights=va[inv], minlength=tiles).astype(I64)
            ideal += np.bincount(g.tiles, weights=vi[inv], minlength=tiles)
    return nv, amp, ideal


def _amp_in(dtype: str) -> str:
    return "fp8" if is_fp8(dtype) else "fp16" if "16" in dtype else "fp32"


# ------------------------------------------------------------------------------------------------ liveness


def live_bytes(program: Program) -> dict[str, np.ndarray]:
    """Live data bytes per half-step per tile, by buffer category: {cat: int64 [2*steps + 4, tiles]}.

    Row r is half-step r - 1 (host inputs and weights are live from half-step -1; outputs are read at 2*steps).
    """
    bt = program.buffers
    n_half = 2 * len(program.steps) + 4
    counts = np.diff(bt.tile_start)
    bid = np.repeat(np.arange(len(bt.names)), counts)
    out = {}
    cats = np.array(bt.category, dtype=object)
    for cat in ("weights", "activations", "buffers"):
        sel = cats[bid] == cat if len(bid) else np.zeros(0, bool)
        diff = np.zeros((n_half + 1, program.tiles), I64)
        lo = np.clip(bt.first[bid[sel]] + 1, 0, n_half)
        hi = np.clip(bt.last[bid[sel]] + 2, 0, n_half)
        t = bt.b_tiles[sel].astype(I64)
        np.add.at(diff, (lo, t), bt.b_size[sel])
        np.add.at(diff, (hi, t), -bt.b_size[sel])
        out[cat] = np.cumsum(diff, axis=0)[:n_half]
    return out


def tile_memory(program: Program, live: dict[str, np.ndarray], chip=None) -> dict[str, np.ndarray]:
    """Bytes per tile by category: the live data at that tile's own peak half-step, plus its reserved bytes."""
    total = sum(live.values())
    peak_row = np.argmax(total, axis=0)  # earliest half-step at which each tile holds the most live bytes
    cols = np.arange(program.tiles)
    mem = {cat: live[cat][peak_row, cols] for cat in ("weights", "activations", "buffers")}
    reserved = _reserved_split(program, chip)
    for cat in RESERVED:
        mem[cat] = reserved[cat]
    return {c: mem[c] for c in CATEGORIES}


def _reserved_split(program: Program, chip=None) -> dict[str, np.ndarray]:
    # What the memory plan reserved for code, vertex state and exchange code (the Program's own count of them is never
    # more: plan/finalize._check_reserved); counted from the Program's steps when no reservation was kept.
    if program.reserved_split:
        return {k: np.asarray(program.reserved_split[k], I64) for k in RESERVED}
    from tremula.target.overheads import reserved_bytes

    split = reserved_bytes(program.tiles, program.steps, chip)
    return {k: np.asarray(split[k], I64) for k in RESERVED}


# ------------------------------------------------------------------------------------------------ graph attribution


def _node_index(graph: Graph) -> dict[str, Node]:
    return {o: n for n in graph.nodes for o in n.outputs}


def _node_flops(graph: Graph, n: Node) -> int:
    ins = [graph.types[i] for i in n.inputs if i]
    outs = [graph.types[o] for o in n.outputs]
    return int(op_flops(n.op, ins, outs, n.attrs))


# ------------------------------------------------------------------------------------------------ build


def step_rows(program: Program, chip, keep_tile_cycles: bool = True,
              exchanges: list[StepExchange] | None = None) -> tuple[list[StepRow], list[list[int]],
                                                                    list[np.ndarray]]:
    """Per-step rows of a Program (no graph needed), the per-tile compute cycles of every step (if kept) and the
    tiles each step computes on. With `exchanges` (schedule_program's rows for this Program) a step's exchange is
    charged its timetable's makespan."""
    T = program.tiles
    scheduled = _by_step(program, exchanges)
    live_total = sum(live_bytes(program).values())
    reserved_total = np.asarray(program.reserved_bytes, I64)
    rows: list[StepRow] = []
    per_tile_steps: list[list[int]] = []
    step_tiles: list[np.ndarray] = []
    t0 = 0
    for k, s in enumerate(program.steps):
        price = price_step(chip, s, T)
        comp, priced, sync = price.cycles
        sx = scheduled.get(k)
        exch = sx.makespan if sx is not None else priced
        cyc = price.tile_compute
        nv, amp, ideal = tile_work(chip, s, T)
        used = nv > 0
        busiest = int(np.argmax(cyc)) if used.any() else -1
        mean = float(cyc[used].mean()) if used.any() else 0.0
        ex = s.exchange
        sent_total = int((ex.rows * ex.row_bytes).sum()) if len(ex) else 0
        max_sent, max_recv = price.max_sent, price.max_received
        lt = np.maximum(live_total[2 * k + 1], live_total[2 * k + 2])  # half-steps 2k and 2k+1 (rows shifted by 1)
        op, target = (s.origin.op, s.origin.value) if s.origin is not None else ("", "")
        rows.append(StepRow(
            index=k, label=s.label, node=target, op=op, start=t0, compute=comp, sync=sync, exchange=exch,
            tiles_used=int(used.sum()), vertices=int(nv.sum()), mean_tile_cycles=mean,
            balance=float(cyc.max() / mean) if mean > 0 else 1.0, busiest_tile=busiest,
            amp_cycles=int(amp[busiest]) if busiest >= 0 else 0,
            amp_ideal_cycles=float(ideal[busiest]) if busiest >= 0 else 0.0, exchange_bytes=sent_total,
            priced_exchange=priced, exchange_makespan=sx.makespan if sx else None,
            exchange_lower_bound=sx.lower_bound if sx else None, exchange_ratio=sx.ratio if sx else None,
            max_tile_sent=max_sent, max_tile_received=max_recv,
            live_peak_tile_bytes=int((lt + reserved_total).max()), live_total_bytes=int(lt.sum()),
            codelets=tuple(dict.fromkeys(g.codelet for g in s.compute))))
        t0 += comp + sync + exch
        step_tiles.append(np.flatnonzero(used))
        if keep_tile_cycles:
            per_tile_steps.append(cyc.tolist())

    return rows, per_tile_steps, step_tiles


def _by_step(program: Program, exchanges: list[StepExchange] | None) -> dict[int, StepExchange]:
    """Scheduled exchanges by step index, checked against the Program (timetables of another program are refused)."""
    out: dict[int, StepExchange] = {}
    for e in exchanges or []:
        if not 0 <= e.step < len(program.steps) or program.steps[e.step].label != e.label:
            raise ValueError(f"timetable for step {e.step} ({e.label!r}) does not belong to this program")
        out[e.step] = e
    return out


def build_profile(result, chip, model: str | None = None, keep_tile_cycles: bool = True,
                  exchanges: list[StepExchange] | None = None) -> Profile:
    """Profile of a CompileResult on `chip`, its steps attributed to the nodes of the graph it planned (`graph`: FP8
    storage ops included). `exchanges`: schedule_program's rows for result.program; when given, exchange cycles (and
    everything summed from them) are the timetables' makespans and the profile carries the bounds, the ratios and the
    exchange code."""
    program: Program = result.program
    graph: Graph | None = result.graph
    if graph is None:
        raise ValueError("a profile attributes steps to the planned graph: this result does not hold one")
    T = program.tiles
    rows, per_tile_steps, step_tiles = step_rows(program, chip, keep_tile_cycles, exchanges)

    # Exchange-only steps are the re-layout feeding the next compute step: charge them to its node.
    owner = [r.node for r in rows]
    nxt = ""
    for k in range(len(rows) - 1, -1, -1):
        if owner[k]:
            nxt = owner[k]
        else:
            owner[k] = nxt
    if rows and not owner[-1]:  # trailing exchanges (nothing after them) belong to the last compute step
        last = next((o for o in reversed([r.node for r in rows]) if o), "")
        owner = [o or last for o in owner]

    nodes = _node_index(graph)
    clock = chip.clock_hz
    peak = chip.peak_flops(result.dtype)
    total_cycles = sum(r.total for r in rows)
    model_flops = sum(_node_flops(graph, n) for n in graph.nodes)
    by_node: dict[str, OpRow] = {}
    tiles_by_node: dict[str, set[int]] = {}
    for r, o in zip(rows, owner):
        n = nodes.get(o)
        key = o or "(unattributed)"
        if key not in by_node:
            wb = sum(graph.types[i].nbytes for i in n.inputs if i and i in graph.constants) if n else 0
            ab = sum(graph.types[x].nbytes for x in n.outputs) if n else 0
            by_node[key] = OpRow(n.name if n and n.name else key, n.op if n else r.op or "exchange", [], 0, 0, 0,
                                 0.0, _node_flops(graph, n) if n else 0, 0.0, 0, 0, wb, ab)
            tiles_by_node[key] = set()
        row = by_node[key]
        row.steps.append(r.index)
        row.compute += r.compute
        row.sync += r.sync
        row.exchange += r.exchange
        row.exchange_bytes += r.exchange_bytes
        tiles_by_node[key].update(step_tiles[r.index].tolist())
    for key, row in by_node.items():
        row.pct = 100.0 * row.cycles / total_cycles if total_cycles else 0.0
        row.utilisation = row.flops / (row.cycles / clock) / peak if row.cycles else 0.0
        row.tiles_used = len(tiles_by_node[key])
    ops = sorted(by_node.values(), key=lambda o: (-o.cycles, o.steps[0]))

    types: dict[str, OpTypeRow] = {}
    for o in ops:
        t = types.setdefault(o.op, OpTypeRow(o.op, 0, 0, 0.0, 0, 0.0, 0))
        t.count += 1
        t.cycles += o.cycles
        t.flops += o.flops
        t.exchange_bytes += o.exchange_bytes
        t.nodes.append(o)
    for t in types.values():
        t.pct = 100.0 * t.cycles / total_cycles if total_cycles else 0.0
        t.utilisation = t.flops / (t.cycles / clock) / peak if t.cycles else 0.0
    op_types = sorted(types.values(), key=lambda t: (-t.cycles, t.op))

    mem = tile_memory(program, live_bytes(program), chip)
    host_in, host_out = int(result.host_in_cycles), int(result.host_out_cycles)
    latency = (host_in + total_cycles + host_out) / clock
    summary = Summary(
        chip=chip.name, model=model or str(program.meta.get("model", graph.name)), batch=result.batch,
        dtype=result.dtype, fits=bool(result.fits), tiles=T, sram_bytes_per_tile=program.sram_bytes_per_tile,
        clock_hz=clock, steps=len(rows), cycles=total_cycles, compute_cycles=sum(r.compute for r in rows),
        exchange_cycles=sum(r.exchange for r in rows), sync_cycles=sum(r.sync for r in rows), latency_s=latency,
        throughput=result.batch / latency if latency else 0.0, model_flops=model_flops, peak_flops=peak,
        mfu=model_flops / latency / peak if latency else 0.0, compile_seconds=float(result.seconds),
        fullest_tile=int(result.fullest_tile), peak_tile_bytes=int(result.peak_tile_bytes),
        fullest_tile_bytes={c: int(v) for c, v in result.memory_by_category.items()},
        exchange_source="timetables" if exchanges else "cost model",
        priced_cycles=sum(r.compute + r.sync + r.priced_exchange for r in rows),
        priced_exchange_cycles=sum(r.priced_exchange for r in rows),
        timetables=summarize(exchanges).to_json() if exchanges else None,
        host_in_cycles=host_in, host_out_cycles=host_out)
    prof = Profile(summary, ops, op_types, rows, {c: v.tolist() for c, v in mem.items()},
                   per_tile_steps if keep_tile_cycles else None)
    if exchanges:
        prof.exchange_code = exchange_code(exchanges, mem, program.shared_steps)
    from tremula.report.why import explain

    prof.why = explain(prof, chip)
    return prof

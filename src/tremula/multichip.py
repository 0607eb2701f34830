"""Models on several chips: a pipeline of stages, one per chip, joined by IPU-Links, and data-parallel replicas of it.

`compile_system` cuts the canonical graph between layers into the fewest stages that fit (counts that divide the
chips first; stages.py, balanced by FLOPs and weight bytes), compiles each stage for the system's chip as one
Program, and joins them with Links: the values a stage sends to a later one, byte for byte. `simulate_system` runs
the Programs in order and moves each Link's bytes; `check_system` compares the outputs with the whole model's float32
reference and each stage with its precision-matched reference.

Timing is Poplar's pipelining, modelled: in every pipeline cycle all chips run their stage on a different batch
(host input and output of each chip in series with its compute, as on one chip: compiler.CompileResult), then one
inter-chip exchange moves the Links' bytes while the chips wait, then the chips sync. The period is the slowest
stage plus that exchange plus a sync; a batch's latency is every stage and exchange in turn. Filling and draining
the pipeline are not charged (steady state). Chips the pipeline does not use run replicas of it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from tremula.batch_search import MAX_AUTO_BATCH
from tremula.compiler import CompileResult, DoesNotFit, ModelSpec, auto_batch_request, builder, compile_model
from tremula.errors import NoFit, TremulaError
from tremula.ir.graph import Graph, model_batch
from tremula.limits import chip_capacity, needs
from tremula.pipeline import Progress, canonical, resolve_dtype
from tremula.program import Program, host_stream_bytes
from tremula.stages import Stage, balanced_cuts, split
from tremula.target.system import System, load_system


@dataclass(frozen=True)
class Link:
    """Bytes [src_offset, src_offset + nbytes) of `value` as stage `src` outputs it, written to bytes [dst_offset,
    ...) of the same value as stage `dst` takes it in. Compiled Links carry whole values; a test may shift one."""

    value: str
    src: int
    dst: int
    dtype: str
    nbytes: int
    src_offset: int = 0
    dst_offset: int = 0


@dataclass
class SystemProgram:
    """What the system runs: one Program per pipeline stage (stage k on chip k of each replica) and the Links."""

    system: str
    programs: list[Program]
    links: list[Link]
    sources: list[dict[str, int]]  # per stage: each input -> the stage that makes it (-1: the host)


@dataclass
class SystemResult:
    system: System
    program: SystemProgram
    stages: list[CompileResult]
    cuts: list[int]  # node positions of the canonical graph the pipeline is cut before
    batch: int
    dtype: str
    replicas: int  # copies of the pipeline side by side (data parallel)
    stage_cycles: list[int]  # per stage: host in + device + host out
    link_bytes: list[int]  # per pair of neighbouring chips (k, k + 1): bytes one pipeline cycle moves over it
    link_hops: list[int]  # per pair: the most links a value crossing it travels (its latency is paid per link)
    link_cycles: int  # the inter-chip exchange of one pipeline cycle
    sync_cycles: int  # the sync after it (none for one stage)
    flops: int  # of one batch through the whole model
    nodes: int  # of the canonical graph (the last stage ends there)
    seconds: float = 0.0
    # --batch auto: {"largest": the largest batch that fits with these stages, "rates": {batch: samples/s}}
    auto: dict | None = None
    graph: Graph | None = field(default=None, repr=False)  # the canonical graph the stages were cut from
    source: Graph | None = field(default=None, repr=False)  # the graph as built (the check's reference)

    @property
    def period_cycles(self) -> int:
        return max(self.stage_cycles) + self.link_cycles + self.sync_cycles

    @property
    def latency_cycles(self) -> int:
        return sum(self.stage_cycles) + (len(self.stages) - 1) * (self.link_cycles + self.sync_cycles)

    @property
    def throughput(self) -> float:
        """Samples per second of the whole system in steady state."""
        return self.replicas * self.batch * self.system.chip.clock_hz / self.period_cycles

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over the peak of every chip of the system (idle chips count)."""
        chip = self.system.chip
        return self.flops * self.throughput / self.batch / (self.system.chips * chip.peak_flops(self.dtype))

    @property
    def bound_by(self) -> str:
        slowest = max(self.stage_cycles)
        return "the inter-chip links" if self.link_cycles > slowest else f"stage {self.stage_cycles.index(slowest)}"

    def on(self, system: System) -> SystemResult:
        """The same stages priced on another system of the same chip (other link figures): what the answer would be
        if a link constant were off."""
        assert system.chip == self.system.chip and system.chips >= len(self.stages)
        return replace(self, system=system, link_cycles=_link_phase(system, self.link_bytes, self.link_hops),
                       replicas=system.chips // len(self.stages))

    def summary(self) -> dict:
        clock = self.system.chip.clock_hz
        return {
            "system": self.system.name, "chip": self.system.chip.name, "chips": self.system.chips,
            "stages": len(self.stages), "replicas": self.replicas, "batch": self.batch, "dtype": self.dtype,
            "cuts": self.cuts,
            "per_stage": [{"stage": k, "nodes": [a, b], "fits": r.fits, "fullest_tile": r.fullest_tile,
                           "peak_tile_bytes": r.peak_tile_bytes, "cycles": r.cycles,
                           "compute_cycles": r.compute_cycles, "exchange_cycles": r.exchange_cycles,
                           "sync_cycles": r.sync_cycles, "host_in_cycles": r.host_in_cycles,
                           "host_out_cycles": r.host_out_cycles, "stage_cycles": c,
                           "weight_bytes": r.graph.param_bytes() if r.graph is not None else None}
                          for k, (r, c, a, b) in enumerate(zip(self.stages, self.stage_cycles, [0, *self.cuts],
                                                               [*self.cuts, self.nodes]))],
            "link_bytes": self.link_bytes, "link_cycles": self.link_cycles, "sync_cycles": self.sync_cycles,
            "period_cycles": self.period_cycles, "latency_cycles": self.latency_cycles,
            "latency_ms": 1e3 * self.latency_cycles / clock, "throughput": self.throughput, "mfu": self.mfu,
            "bound_by": self.bound_by,
            **({"auto": {"largest": self.auto["largest"], "rates": {str(b): r for b, r in self.auto["rates"].items()}}}
               if self.auto else {}),
        }


class SystemDoesNotFit(NoFit):
    """No pipeline over the system's chips fits at this batch."""


def compile_system(model: ModelSpec, system: System | str, batch: int | None = None, dtype: str = "fp32",
                   seq_len: int | None = None, progress: Progress | None = None, stages: int | None = None,
                   calibration: dict[str, np.ndarray] | None = None, partials: str = "half") -> SystemResult:
    """Compile `model` for a system: the fewest pipeline stages whose Programs all fit at `batch` among the counts that
    divide the system's chips, else among the others (up to the chips), or exactly `stages` when given; the chips left
    over run replicas. batch="auto": the fastest batch with the stages that batch 1 needs (_auto_batch)."""
    t0 = time.perf_counter()
    if isinstance(system, str):
        system = load_system(system)
    chip = system.chip
    if stages is not None and not 1 <= stages <= system.chips:
        raise TremulaError(f"--stages must be from 1 to the system's {system.chips} chips (got {stages})")
    dt = resolve_dtype(dtype)
    build = builder(model, seq_len)
    scales = None
    if dt == "fp8":  # once, on the whole model: a stage's inputs are activations only the stages before it make
        from tremula.fp8_calibration import calibrate

        scales = calibrate(build, model if isinstance(model, Graph) else None, calibration, chip)
    if batch == "auto":
        batch = auto_batch_request(model, build)
    if batch == "auto":
        res = _auto_batch(model, system, dtype, progress, stages, partials, scales, build)
    else:
        res = _compile_at(model, system, batch, dtype, progress, stages, partials, scales, build)
    res.seconds = time.perf_counter() - t0
    return res


def _auto_batch(model, system: System, dtype: str, progress, stages, partials, scales, build) -> SystemResult:
    """--batch auto on a system: the stages fixed by batch 1 (the fewest that fit, or `stages`), then batches
    doubled while every stage fits and bisected between the last that fit and the first that did not; the fastest
    of the batches that fit is the answer (SystemResult.auto lists them all, as compile_model's does)."""
    one = _compile_at(model, system, 1, dtype, progress, stages, partials, scales, build)
    k = len(one.stages)
    fits: dict[int, SystemResult] = {1: one}
    lo, hi = 1, None  # the largest batch known to fit, the smallest known not to
    while hi is None or hi - lo > 1:
        b = lo * 2 if hi is None else (lo + hi) // 2
        if b > MAX_AUTO_BATCH:
            break
        try:
            fits[b] = _compile_at(model, system, b, dtype, progress, k, partials, scales, build)
            lo = b
        except NoFit:
            hi = b
    best = max(fits, key=lambda b: (fits[b].throughput, b))
    res = fits[best]
    res.auto = {"largest": lo, "rates": {b: fits[b].throughput for b in sorted(fits)}}
    return res


def _compile_at(model, system: System, batch, dtype: str, progress, stages, partials, scales, build) -> SystemResult:
    chip = system.chip
    dt = resolve_dtype(dtype)
    source = model if isinstance(model, Graph) else build(batch)  # type: ignore[misc]
    if batch is not None and model_batch(source) not in (None, batch):
        raise TremulaError(f"the graph has batch {model_batch(source)}, not the batch {batch} asked")
    batch = model_batch(source) or 1
    graph = canonical(source)
    tried: list[str] = []
    # Stage counts that divide the chips first (replicas use every chip), fewest first: GPT-2 large fp16 b8 fits in 3
    # stages on 4 C600s, which leaves one chip idle (977 samples/s) where 4 stages run 2,087
    counts = sorted(range(1, system.chips + 1), key=lambda k: (system.chips % k != 0, k))
    for k in [stages] if stages is not None else counts:
        cuts = balanced_cuts(graph, k, dt)
        parts = split(graph, cuts)
        over = [(i, needs(p.graph, dt).total) for i, p in enumerate(parts)]
        over = [(i, n) for i, n in over if n > chip_capacity(chip)]
        if over:  # a lower bound already overflows a chip: do not plan
            i, n = over[0]
            tried.append(f"{k} stage(s): stage {i} needs at least {n:,} of {chip_capacity(chip):,} bytes")
            continue
        results = []
        for i, p in enumerate(parts):
            try:
                # every stage keeps its weights on its chip: the pipeline's period does not charge streamed ones
                results.append(compile_model(p.graph, chip, None, dtype, progress=progress, partials=partials,
                                             scales=scales, weights="resident"))
            except DoesNotFit as e:
                cats = ", ".join(f"{c} {v:,}" for c, v in e.by_category.items() if v)
                tried.append(f"{k} stage(s): stage {i} (nodes {p.first}..{p.end - 1}) needs {e.peak:,} of {e.sram:,} "
                             f"bytes on tile {e.tile} at step {e.step} ({cats})")
                break
            except NoFit as e:  # a lower bound (limits.TooBig: the host's memory too)
                tried.append(f"{k} stage(s): stage {i} (nodes {p.first}..{p.end - 1}): {e}")
                break
        if len(results) < len(parts):
            continue
        return _priced(system, parts, results, cuts, batch, dt, graph, source)
    raise SystemDoesNotFit(f"{graph.name} does not fit on {system.name} at batch {batch}: " + "; ".join(tried)
                           + ". Try a smaller batch or a system of more chips")


def _priced(system: System, parts: list[Stage], results: list[CompileResult], cuts: list[int], batch: int, dt: str,
            graph: Graph, source: Graph) -> SystemResult:
    from tremula.model_info import describe
    from tremula.target.cost import host_transfer_cycles

    chip = system.chip
    links: list[Link] = []
    stage_cycles = []
    for k, (p, r) in enumerate(zip(parts, results)):
        prog = r.program
        from_host = [s for s in prog.host_in if p.sources[s.name] == -1]
        to_host = [s for s in prog.host_out if s.name in graph.outputs]
        stage_cycles.append(host_transfer_cycles(chip, host_stream_bytes(from_host)) + r.cycles
                            + host_transfer_cycles(chip, host_stream_bytes(to_host)))
        for v, src in p.sources.items():
            if src < 0:
                continue
            s_shape, s_dtype = results[src].program.io_types[v]
            d_shape, d_dtype = prog.io_types[v]
            if (s_shape, s_dtype) != (d_shape, d_dtype):  # a Link moves bytes: both ends must hold the same ones
                raise TremulaError(f"stage {src} outputs {v!r} as {s_dtype}{list(s_shape)} but stage {k} takes it "
                                   f"in as {d_dtype}{list(d_shape)}")
            nbytes = math.prod(d_shape) * np.dtype(d_dtype).itemsize
            links.append(Link(v, src, k, d_dtype, nbytes))
    # Each tile that takes a value in receives its own copy over the links, as over the host link
    # (program.host_stream_bytes): bytes per pair of neighbours from the destination's streams.
    pair = [0] * max(len(parts) - 1, 0)
    hops = [0] * len(pair)
    for ln in links:
        sent = host_stream_bytes([s for s in results[ln.dst].program.host_in if s.name == ln.value])
        for i in range(ln.src, ln.dst):
            pair[i] += sent
            hops[i] = max(hops[i], ln.dst - ln.src)
    program = SystemProgram(system.name, [r.program for r in results], links, [dict(p.sources) for p in parts])
    return SystemResult(system, program, results, cuts, batch, dt, system.chips // len(parts), stage_cycles, pair,
                        hops, _link_phase(system, pair, hops), chip.sync_cycles if len(parts) > 1 else 0,
                        describe(graph).flops, len(graph.nodes), graph=graph, source=source)


def _link_phase(system: System, link_bytes: list[int], link_hops: list[int]) -> int:
    """The inter-chip exchange of a pipeline cycle: every pair of neighbours moves its bytes at once."""
    return max((system.link_cycles(b, h) for b, h in zip(link_bytes, link_hops)), default=0)


def simulate_system(program: SystemProgram, graphs: list[Graph], feeds: dict[str, np.ndarray], check: bool = True,
                    progress: Progress | None = None) -> tuple[dict[str, np.ndarray], list[dict], list[dict]]:
    """Run every stage's Program in pipeline order on `feeds` (the whole model's inputs), moving each Link's bytes
    from its source stage's outputs into its destination's inputs. Returns (every stage output by name, the model's
    outputs among them; each stage's inputs; each stage's outputs). A stage input with a byte no Link wrote, a Link
    outside its value, or two Links writing one byte fail with SimCheckError. `graphs`: each stage's planned graph (its weights)."""
    from tremula.sim.functional import SimCheckError, simulate

    arrived: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}  # (stage, value) -> (bytes, written)
    outputs: dict[str, np.ndarray] = {}
    stage_in: list[dict] = []
    stage_out: list[dict] = []
    for k, (prog, g) in enumerate(zip(program.programs, graphs)):
        fed: dict[str, np.ndarray] = {}
        for v, src in program.sources[k].items():
            if src < 0:
                fed[v] = feeds[v]
                continue
            shape, dtype = prog.io_types[v]
            got = arrived.get((k, v))
            if got is None:
                raise SimCheckError(f"stage {k} input {v!r}: no link from stage {src} delivers it")
            data, written = got
            if not written.all():
                first = int(np.flatnonzero(~written)[0])
                raise SimCheckError(f"stage {k} input {v!r}: byte {first} of {len(written)} never arrived over a link")
            fed[v] = data.view(dtype).reshape(shape)
        got_k = simulate(prog, g, fed, check=check, progress=progress)
        stage_in.append(fed)
        stage_out.append(got_k)
        for ln in (ln for ln in program.links if ln.src == k):
            src_bytes = np.ascontiguousarray(got_k[ln.value]).reshape(-1).view(np.uint8)
            shape, dtype = program.programs[ln.dst].io_types[ln.value]
            size = math.prod(shape) * np.dtype(dtype).itemsize
            data, written = arrived.setdefault((ln.dst, ln.value), (np.zeros(size, np.uint8), np.zeros(size, bool)))
            if min(ln.src_offset, ln.dst_offset, ln.nbytes) < 0 or ln.src_offset + ln.nbytes > len(src_bytes) \
                    or ln.dst_offset + ln.nbytes > size:
                raise SimCheckError(f"link of {ln.value!r} from stage {ln.src} to {ln.dst}: bytes outside the value")
            dst = slice(ln.dst_offset, ln.dst_offset + ln.nbytes)
            if check and written[dst].any():
                raise SimCheckError(f"link of {ln.value!r} to stage {ln.dst}: two links write the same bytes")
            data[dst] = src_bytes[ln.src_offset:ln.src_offset + ln.nbytes]
            written[dst] = True
        outputs.update({o: got_k[o] for o in g.outputs if o in got_k and o not in outputs})
    return outputs, stage_in, stage_out

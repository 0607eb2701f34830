"""The driver: model -> canonical Graph -> plan -> memory plan -> Program.

`compile_model` answers "does it fit, at which batch, how fast": a Program, the memory of the fullest tile by category
and the estimated cycles per forward pass. When the peak does not fit, it raises DoesNotFit naming the tile, the step,
bytes by category and the largest batch that fits (found by planning only, never simulating: batch_search.py).
`check_model` (check.py) runs the result in the simulator.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Union

import numpy as np

from tremula import cache, limits
from tremula.batch_search import (
    AUTO_GROWN,
    GrowthsBeside,
    find_max_batch,
    fits_at,
    growable,
    kept_whole,
    refuse_oversize,
    zero_scales,
)
from tremula.beside import beside, can_fork, usable_cores
from tremula.errors import NoFit, TremulaError, notice
from tremula.fp8_calibration import Stored, calibration_job
from tremula.frontends.rebatch import CannotRebatch, FixedBatch, rebatch
from tremula.ir.graph import Graph, make_values, model_batch
from tremula.pipeline import (
    GROW_STEPS,
    Progress,
    check_fp8,
    from_recipe,
    host_cycles,
    grown_on,
    plan_graph,
    plan_rate,
    priced_program,
    relowered,
    resolve_dtype,
)
from tremula.plan.plan import Plan, Recipe, recipe_of
from tremula.program import Program, streamed_weight_bytes

ModelSpec = Union[Graph, str, Callable[[int], Graph]]  # noqa: UP007 (a runtime alias)


class DoesNotFit(NoFit):
    """The program's peak memory on some tile exceeds its SRAM."""

    def __init__(self, tile: int, step: int, by_category: dict[str, int], peak: int, sram: int, batch: int,
                 max_batch: int | None, detail: str = "", region: str = ""):
        self.tile, self.step, self.by_category, self.peak, self.sram = tile, step, by_category, peak, sram
        self.batch, self.max_batch, self.detail = batch, max_batch, detail
        cats = ", ".join(f"{k} {v:,}" for k, v in by_category.items() if v)
        if max_batch is None:
            hint = "try a smaller batch, fp16, or a chip with more SRAM"
        elif max_batch == 0:
            hint = "even batch 1 does not fit: use a smaller precision, more IPUs, or a chip with more SRAM"
        else:
            hint = f"the largest batch that fits is {max_batch} (use --batch {max_batch} or --batch auto)"
        where = f" of its {region}" if region else ""
        super().__init__(f"does not fit at batch {batch}: tile {tile} needs {peak:,} of {sram:,} bytes{where} at step "
                         f"{step} ({cats}); {hint}" + (f". On tile {tile}: {detail}" if detail else ""))


def _does_not_fit(state, mp, live, chip, batch: int, max_batch: int | None) -> DoesNotFit:
    from tremula.plan.diagnose import fullest_tile

    over = mp.code_overflow() if mp.peak_bytes <= chip.sram_bytes_per_tile else None
    if over is not None:  # the tile's bytes fit its SRAM, but its instructions overflow the code region
        tile, used = over
        return DoesNotFit(tile, mp.peak_time // 2, mp.by_category, used, chip.non_interleaved_bytes_per_tile, batch,
                          max_batch, fullest_tile(state, mp, live, chip), region="code region (code + exchange code)")
    return DoesNotFit(mp.fullest_tile, mp.peak_time // 2, mp.by_category, mp.peak_bytes, chip.sram_bytes_per_tile,
                      batch, max_batch, fullest_tile(state, mp, live, chip))


@dataclass
class CompileResult:
    program: Program
    fits: bool
    batch: int
    dtype: str
    fullest_tile: int
    peak_tile_bytes: int
    peak_step: int
    memory_by_category: dict[str, int]
    steps: int
    cycles: int  # estimated cycles per forward pass
    compute_cycles: int
    exchange_cycles: int
    sync_cycles: int
    strategies: dict[str, str] = field(default_factory=dict)
    # node (its first output) -> (what, cuts) of the sums the plan splits (plan/state.py `split_sums`): what the
    # matched reference follows
    split_sums: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    shared_layers: int = 0  # layers that run a template layer's code (plan/share.py)
    # --batch auto: {"largest": the largest batch that fits, "rates": {batch: modelled samples/s} of every batch the
    # search planned that fits, its plan grown one step, or fully for the AUTO_GROWN fastest of them, "grown": those
    # grown fully (a compile of that batch alone gives their rate; the others' may be higher)}; the compiled batch is
    # the fastest, its rate the one compiled. None for any other batch.
    auto: dict | None = None
    partials: str = "float"  # what the fp16 / fp8 matmuls accumulate in ("half" or "float"; fp32: float)
    # Host link: the Program's input streams before the forward and its output streams after it
    # (cost.host_transfer_cycles of the bytes they carry); not part of `cycles`, which stays device cycles.
    host_in_bytes: int = 0
    host_out_bytes: int = 0
    host_in_cycles: int = 0
    host_out_cycles: int = 0
    # Of host_in_bytes: the weights streamed from host memory on every run (plan/stream.py), and the layers they
    # belong to ({run: number of its layers streamed}); 0 and {} when every weight is resident.
    streamed_bytes: int = 0
    streamed_layers: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0  # wall time of the compile (not stored in the Program, which must be deterministic)
    graph: Graph | None = field(default=None, repr=False)  # the graph as planned (after the precision passes)
    # the graph as built, before any pass: the check's float32 reference, which so shares the planned graph's
    # constants (their seeded values are made once)
    source: Graph | None = field(default=None, repr=False)

    @property
    def host_cycles(self) -> int:
        return self.host_in_cycles + self.host_out_cycles

    @property
    def latency_cycles(self) -> int:
        """One batch end to end: host in, then the device's forward, then host out."""
        return self.host_in_cycles + self.cycles + self.host_out_cycles

    @property
    def throughput_cycles(self) -> int:
        """Cycles charged per batch for throughput: the latency, as host transfers do not overlap device work.

        By default PopART streams data to and from the IPU serially to computation; overlapping needs tiles set
        aside as "IO tiles" (numIOTiles) that then do no compute (PopART user guide, "Overlapping IO with compute",
        docs.graphcore.ai/projects/popart-user-guide/en/latest/overlap_io.html; PopRT's IO tiles pass,
        ../shared/reference/prior-art.md). Prefetch only stages the next input near the IPU (host / streaming
        memory), not in tile SRAM (TensorFlow-IPU guide, "Efficient IPU I/O"). tremula plans every tile for compute,
        so it charges the transfers in series. A C600 stack's resident latency was likewise measured with upload and
        download in series with the forward (ipu-stack-facts §4.2 [M]).
        """
        return self.latency_cycles

    def summary(self) -> dict:
        return {"fits": self.fits, "batch": self.batch, "dtype": self.dtype, "fullest_tile": self.fullest_tile,
                "peak_tile_bytes": self.peak_tile_bytes, "peak_step": self.peak_step,
                "memory_by_category": self.memory_by_category, "steps": self.steps, "cycles": self.cycles,
                "compute_cycles": self.compute_cycles, "exchange_cycles": self.exchange_cycles,
                "sync_cycles": self.sync_cycles, "shared_layers": self.shared_layers, "partials": self.partials,
                "host_in_bytes": self.host_in_bytes, "host_out_bytes": self.host_out_bytes,
                "host_in_cycles": self.host_in_cycles, "host_out_cycles": self.host_out_cycles,
                "streamed_bytes": self.streamed_bytes, "streamed_layers": self.streamed_layers,
                "host_cycles": self.host_cycles, "latency_cycles": self.latency_cycles,
                "host_overlaps_device": False, "throughput_cycles": self.throughput_cycles,
                **({"auto": {"largest": self.auto["largest"],
                             "rates": {str(b): r for b, r in self.auto["rates"].items()},
                             "grown": list(self.auto.get("grown", ()))}} if self.auto else {})}


# ------------------------------------------------------------------------------------------------ graph preparation


def builder(model: ModelSpec, seq_len: int | None) -> Callable[[int | None], Graph] | None:
    """batch -> Graph; None is the model's own batch (an ONNX file's fixed one, else 1)."""
    if isinstance(model, Graph):
        return None
    if isinstance(model, str):
        from tremula.frontends import load_model
        from tremula.frontends.zoo import zoo_choice

        if zoo_choice(model) is not None:  # built from its config with lazy weights: building is free
            return lambda b: load_model(model, batch=b, seq_len=seq_len)
        return _Rebatching(lambda b: load_model(model, batch=b, seq_len=seq_len))
    return lambda b: model(1 if b is None else b)  # a user's builder has no batch of its own


class _Rebatching:
    """batch -> Graph for a model file or folder: loaded once (at batch 1, or the graph a compile at a fixed batch
    imported: `seed`), then re-shaped to each batch that the batch search, its bounds and the calibration probe
    (frontends/rebatch.py), instead of importing the file again for every probe (a 1.7 GB ONNX export); loaded at
    that batch when the rebatcher cannot prove the graph allows it. A rebatched graph computes what the file's own
    graph at that batch does (rebatch checks every value's shape) and differs in some value names only. The graph
    compiled in the end is the file's own (`exact`)."""

    def __init__(self, load: Callable[[int | None], Graph]):
        self.exact, self.base, self.base_batch = load, None, 1

    def __call__(self, batch: int | None) -> Graph:
        if batch is None:
            return self.exact(None)
        try:
            if self.base is None:
                self.base = self.exact(1)
            return self.base if batch == self.base_batch else rebatch(self.base, batch)
        except (CannotRebatch, FixedBatch):  # FixedBatch: the file cannot go to batch 1; perhaps to this batch
            return self.exact(batch)

    def seed(self, graph: Graph) -> None:
        """The file's own graph, imported at some batch for the compile (_exact): the base the probes are rebatched
        from when none is loaded yet, instead of importing the file again at batch 1 (SigLIP so400m's 1.7 GB legacy
        export, fp8 batch 8: the calibration's graph at four samples imported the file a second time, 6 s and a
        second copy of its weights)."""
        b = model_batch(graph)
        if self.base is None and b is not None:
            self.base, self.base_batch = graph, b


def _exact(build: Callable[[int | None], Graph], batch: int | None) -> Graph:
    """The graph to compile at `batch`: the model's own (a file imported at that batch, not a probe's rebatch);
    a model file's probes are rebatched from it after (_Rebatching.seed)."""
    graph = getattr(build, "exact", build)(batch)
    if isinstance(build, _Rebatching):
        build.seed(graph)
    return graph


def auto_batch_request(model: ModelSpec, build) -> str | None:
    """What --batch auto asks for: "auto" (search), or None (the model's own batch) for an ONNX file whose batch is
    fixed, whose other batches would be rebatched guesses of the user's intent (a notice says so)."""
    if build is None:
        raise TremulaError("--batch auto needs a model name or file, not an already built graph")
    own = _fixed_batch(model)
    if own is None:
        return "auto"
    notice(f"{model} was exported with a fixed batch of {own}: --batch auto answers for batch {own} without "
           "searching (re-export it with a dynamic batch, dynamic_axes= or dynamic_shapes=, to search)")
    return None


def _fixed_batch(model: ModelSpec) -> int | None:
    """The batch an ONNX file fixes (None for anything else, or a dynamic batch)."""
    if not isinstance(model, str):
        return None
    from pathlib import Path

    from tremula.frontends.zoo import zoo_choice

    if zoo_choice(model) is not None or not Path(model).is_file():
        return None
    from tremula.frontends.onnx_import import fixed_batch

    return fixed_batch(model)


def _shared_only(found: dict, largest: int, batch: int) -> bool:
    """Whether `batch` plans only with shared layers after a search (find_max_batch's `found`): at or above the
    smallest batch whose plans without them failed."""
    return found.get("shared_from", largest + 1) <= batch


def _largest_calibrated(build, chip, dt: str, fits: int, largest: int, found: dict, scales: dict[str, int],
                        partials: str, weights: str, progress: Progress | None, parallel: bool = False,
                        top: Callable[[], bool] | None = None) -> int:
    """The largest batch up to the `largest` a search with all-zero FP8 scales found that still fits with the
    calibrated `scales` (zeros patch no scale field of a shared layer, so a plan can fit with them and not with
    calibrated ones), knowing that batch `fits` does: `largest` first, then the one below it (a plan that tips over
    with the scales' patches was within a few KB of full), then halving the batches between. parallel: the first
    two are planned at once, `largest` in a forked process beside this one (beside.py; the calibration has ended,
    so a core is free): SigLIP so400m fp8, whose 11 does not fit with its scales (7.7 s, its budgets tried in turn)
    and 10 does (1.9 s), took 9.3 s one after the other, 7.9 s at once. top: `largest` planned so already
    (_confirm_beside, started before `fits` was known), its result to wait for (or cancel, when `fits` is `largest`)."""

    def ok(b: int, tell: bool = True) -> bool:
        if progress and tell:  # (not from the forked process: one progress bar)
            progress("confirm", 0, 1)
        return _fits_calibrated(build, chip, dt, b, found, largest, scales, partials, weights)

    if fits >= largest:
        if top is not None:
            top.cancel()  # type: ignore[attr-defined]
        return fits
    lo, hi, b = fits, largest + 1, largest
    if top is None and parallel and largest - 1 > fits:
        top = _confirm_beside(build, chip, dt, found, largest, scales, partials, weights)
    if top is not None:
        below = ok(largest - 1) if largest - 1 > fits else None
        if top():
            return largest
        lo, hi = (fits, largest) if below is None else (largest - 1, largest) if below else (fits, largest - 1)
        b = (lo + hi) // 2
    while hi - lo > 1:
        fit = ok(b)
        lo, hi = (b, hi) if fit else (lo, b)
        b = hi - 1 if not fit and b == largest else (lo + hi) // 2
    return lo


def _fits_calibrated(build, chip, dt: str, b: int, found: dict, largest: int, scales: dict[str, int], partials: str,
                     weights: str) -> bool:
    """Whether batch b fits with the calibrated FP8 `scales` (after a search that found `largest`)."""
    return fits_at(build, chip, dt, b, scales, shared_only=_shared_only(found, largest, b), partials=partials,
                   weights=weights)[0]


def _confirm_beside(build, chip, dt: str, found: dict, largest: int, scales: dict[str, int], partials: str,
                    weights: str) -> Callable[[], bool]:
    """Batch `largest` planned with the calibrated FP8 `scales` in a forked process (beside.py), started as soon as
    the scales are at hand, while this process grows the search's other fastest batches (_fastest_grown's `between`):
    _largest_calibrated waits for it. SigLIP so400m fp8 --batch auto: its 11, which does not fit with the scales
    (8.3 s), ran after the growths and beside the lowering of batch 8 with the scales and the confirm of 10; now
    beside the growth of 4 too."""
    return beside(_fits_calibrated, build, chip, dt, largest, found, largest, scales, partials, weights,
                  name="tremula-confirm", process=True)


def _calibration_beside(job: Callable[..., dict[str, int]]) -> Callable[[], dict[str, int]]:
    """The calibration `job` (calibration_job's) started beside the planning (beside.py), and a function that waits
    for its scales. While the planner runs (Python on one thread) the calibration's matmuls take every core this
    process may use but that one; once the planner waits for the scales, every core (at its next matmul). Its scales
    are the same either way (ir/blocked.py; it takes 27.3 s alone on two threads, 39.3 on one). Until they were, its
    BLAS threads were raised instead, and the same compile could give two Programs. Measured then, on two cores:
    OpenBLAS's two threads and the planner took turns on both, and SigLIP so400m fp8 --batch auto took 54.6 s (its
    search done at about 40 s, the scales at about 48), 47.5 s with one BLAS thread (the search done at 25 s, the
    scales at 42: the calibration took 29 s alone on two threads, 38 on one), while a fixed batch 1, whose planning
    is short, went from 34.9 to 45.0 s on one thread. Raised to two when the planner waits: batch 1 33.2 s, batch 8
    36.6 s (46.8 on two threads throughout)."""
    ctx = multiprocessing.get_context("fork") if can_fork() else None
    waiting = ctx.Event() if ctx is not None else threading.Event()
    cores = usable_cores()
    result = beside(job, lambda: cores if waiting.is_set() else max(1, cores - 1), name="tremula-calibrate",
                    process=True)

    def scales() -> dict[str, int]:
        waiting.set()
        return result()

    return scales


def _plan_beside(graph: Graph, chip, dt: str, progress: Progress | None, calibrating: Callable[[], dict[str, int]],
                 partials: str, weights: str) -> Plan:
    """plan_graph at a fixed batch (while the FP8 calibration runs beside it, when it does: `calibrating` waits for its
    scales): planned (and grown) with all-zero scales, then lowered again with the calibrated ones (_calibrated).
    SigLIP so400m fp8 on two cores, one compile a process:
    batch 1 50.4 -> 34.9 s, batch 8 55.0 -> 46.8 s, the same cycles (the calibration, 29 s alone, is the longer of
    the two; beside the planning it took about 40, and with the cores shared as _calibration_beside shares them batch
    1 takes 33.2 s, batch 8 36.6 s)."""
    plan = _grown_plan(graph, chip, dt, progress, zero_scales(graph), False, partials, weights)
    return _calibrated(graph, chip, dt, plan, calibrating(), partials, weights, False, progress)


PLAN_ENTRY, PLAN_VERSION = "plans", 1  # the cache's entries of the plans compiles grew (cache.py): their Recipes


def _grown_plan(graph: Graph, chip, dt: str, progress: Progress | None, scales: dict[str, int] | None,
                shared_only: bool, partials: str, weights: str) -> Plan:
    """plan_graph's plan of a compile at a fixed batch (grown GROW_STEPS), or the plan an earlier run grew from the
    same inputs (the graph and its weights, chip, options, scales and tremula's code: cache.py), lowered again from
    its Recipe: the same plan, in one lowering instead of the budgets tried and the growth's. Plans that stream
    weights have no recipe and are made each time."""
    k = cache.key(PLAN_ENTRY, PLAN_VERSION, graph, {"chip": repr(chip), "dtype": dt, "scales": scales,
                                                    "shared_only": shared_only, "partials": partials,
                                                    "weights": weights, "grow": GROW_STEPS})
    recipe = _stored_recipe(cache.load(PLAN_ENTRY, k))
    if recipe is not None:
        plan = from_recipe(graph, chip, dt, recipe, scales, partials, progress)
        if plan.fits:
            notice(f"the plan's choices from the cache (an earlier run grew it: {cache.cache_dir()}; "
                   f"{cache.ENV}=off plans again)")
            return plan
        plan = None
    plan = plan_graph(graph, chip, dt, progress, scales, shared_only, partials, weights, grow=GROW_STEPS)
    recipe = recipe_of(plan.state) if plan.fits else None
    if recipe is not None:
        cache.store(PLAN_ENTRY, k, {"recipe": asdict(recipe), "graph": graph.name})
    return plan


def _stored_recipe(entry: dict | None) -> Recipe | None:
    """The Recipe a cache entry holds, or None (no entry, or not one this code wrote)."""
    try:
        r = entry["recipe"]  # type: ignore[index]
        frac, perm, share, thrift = r["budget"]
        return Recipe((float(frac), None if perm is None else float(perm), bool(share), str(thrift)),
                      bool(r["level_weights"]), tuple((str(a), float(b)) for a, b in r["op_scale"]),
                      bool(r["both_orders"]))
    except (KeyError, TypeError, ValueError):
        return None


def _calibrated(graph: Graph, chip, dt: str, plan: Plan, scales: dict[str, int], partials: str, weights: str,
                shared_only: bool, progress: Progress | None) -> Plan:
    """A plan of `graph` made with all-zero FP8 scales (plan_graph's), lowered again with the calibrated
    `scales` at the choices made (pipeline.relowered), and kept when that still fits. Scales change no choice of a
    plan; in shared layers they decide which scale fields a call patches (vertex state, call cycles), and zeros patch
    none, so a plan fits with zeros whenever it fits with calibrated scales and the choices are those planning with
    them would make, except where a budget fits only without the patches (the growth may then stop elsewhere; the
    plan kept still fits, by its own memory plan). When it does not fit, or its weights stream (the layers streamed
    are chosen by their bytes), it is planned again with the calibrated scales."""
    if plan.fits:
        state, plan = plan.state, None  # (one lowering alive at a time)
        plan = relowered(graph, chip, dt, state, scales, partials, progress)
        state = None
        if plan is not None and plan.fits:
            return plan
    plan = None
    return plan_graph(graph, chip, dt, progress, scales, shared_only, partials, weights, grow=GROW_STEPS)


def _fastest_grown(build, chip, dt: str, progress: Progress | None, found: dict, largest: int,
                   scales: dict[str, int] | None, zeros: bool, partials: str, weights: str, parallel: bool = False,
                   between: Callable[[], None] | None = None):
    """--batch auto's choice among the batches a search planned (`found`, find_max_batch's): the AUTO_GROWN it ranks
    fastest (their plans grown one step) each grown fully, as a compile at that batch grows its plan (the search's
    kept plan, or the plan made again from its recipe, grown on: pipeline.grown_on; else planned again), and the
    faster of them (on a tie the larger batch): (batch, its graph as built, its Plan), or None. Their rates in
    found["rates"] become the grown plans', and the batches go into found["grown"].
    `scales`: the FP8 scales to plan with, or all zeros (`zeros`: planning beside the calibration). parallel: the
    second is grown in a forked process beside the first (beside.py) and, when it is the faster, made again here
    from its recipe: the same plan (BERT-base fp16 batches 128 and 148: 7.9 s one after the other, from the plans
    the search kept, 5.6-5.9 s side by side, from their recipes). between: called once the first is grown, before
    any other (beside the FP8 calibration: it waits for the scales, then starts work that needs them beside the
    growths left)."""
    rates, kept, made = found["rates"], found.pop("plans", {}), found.pop("made", {})
    plan_scales = zero_scales if zeros else (lambda graph: scales)

    def grown(b: int, progress: Progress | None) -> tuple[Graph, Plan]:
        graph, plan = _exact(build, b), kept.pop(b, None)
        recipe, growth = made.get(b, (None, None))
        if plan is None and recipe is not None:  # (a plan kept whole has no recipe: batch_search.kept_whole)
            plan = from_recipe(graph, chip, dt, recipe, plan_scales(graph), partials, progress)
            plan.state.growth = growth  # where its growth (beside the search, or none) stopped
        if plan is not None:
            return graph, grown_on(plan, chip, progress)
        return graph, plan_graph(graph, chip, dt, progress, plan_scales(graph), _shared_only(found, largest, b),
                                 partials, weights, grow=GROW_STEPS)

    def ranked(b: int, plan: Plan) -> float | None:  # its rate, when it fits
        return plan_rate(plan, chip, dt, b) if plan.fits else None

    def grown_beside(b: int) -> tuple[float | None, Recipe | None]:  # (in the forked process)
        plan = grown(b, None)[1]
        return ranked(b, plan), recipe_of(plan.state)

    best = None

    def faster(b: int, rate: float | None) -> bool:  # records a candidate grown fully; whether it is the fastest yet
        if rate is None:
            return False
        rates[b] = rate
        found.setdefault("grown", []).append(b)
        return best is None or (rate, b) > (rates[best[0]], best[0])

    order = sorted(rates, key=lambda b: (rates[b], b), reverse=True)[:AUTO_GROWN]
    second = None  # (batch, the result of its growth beside)
    if parallel and len(order) > 1:
        b2 = order.pop()
        second = (b2, beside(grown_beside, b2, name="tremula-grow", process=True))
    for i, b in enumerate(order):
        graph, plan = grown(b, progress)
        if faster(b, ranked(b, plan)):
            best = (b, graph, plan)
        plan = None
        if i == 0 and between is not None:
            between()
    if second is not None:
        b, result = second
        rate, recipe = result()
        if faster(b, rate):
            best = None  # (one plan alive at a time)
            graph = _exact(build, b)
            plan = None if recipe is None else from_recipe(graph, chip, dt, recipe, plan_scales(graph), partials,
                                                            progress)
            best = (b, graph, plan if plan is not None else grown(b, progress)[1])
    return best


def _auto(build, chip, dt: str, dtype: str, progress: Progress | None,
          calibrating: Callable[[], dict[str, int]] | None, scales: dict[str, int] | None, partials: str, weights: str):
    """compile_model's --batch auto: (the batch to compile, its graph as built, its Plan or None, the `auto` record
    (largest, rates, grown), shared_only, the FP8 scales). The answer an earlier run found from the same inputs
    (cache.py; FP8: with the same calibrated scales, so only once they are at hand) is taken from the cache: its
    batch planned again from its Recipe, the same plan."""
    planned = None
    # Batch 1 first: when it does not fit, its plan is what the error reports.
    one = build(1)
    refuse_oversize(build, one, chip, dt, weights=weights)
    known = calibrating() if isinstance(calibrating, Stored) else scales
    digest = cache.graph_digest(one)  # (now: the search makes some of its seeded weights)
    asked = weights  # (the search may keep every weight on the chip: below)
    k = _auto_key(digest, chip, dt, known, partials, asked)
    hit = _stored_auto(cache.load(AUTO_ENTRY, k), build, chip, dt, known, partials, progress)
    if hit is not None:
        notice(f"--batch auto: the search's answer from the cache (an earlier run searched: {cache.cache_dir()}; "
               f"{cache.ENV}=off searches again)")
        return (*hit, known)
    # FP8: the search plans with all-zero scales while the calibration runs. Scales change no choice of a plan;
    # zeros make a shared layer's scale fields equal to its template's, so it patches none of them, and a plan
    # holds at most the bytes it holds with calibrated scales (SigLIP so400m fp8 b10's fullest tile: 7.7 KB of
    # vertex state against 12.1 KB). The batch compiled and the largest are then planned with the calibrated
    # scales.
    search_scales = scales if calibrating is None else zero_scales(one)
    # On two cores, with no calibration beside, the search's growths (batch 1's too) run beside it and its plans
    # come back as recipes (batch_search.GrowthsBeside), made again where they are grown on.
    forks = usable_cores() > 1 and can_fork()  # a second core, for work in a forked process
    parallel = (calibrating is None or isinstance(calibrating, Stored)) and forks
    found: dict = {"rates": {}}
    growths = GrowthsBeside(chip, dt, found) if parallel else None
    p1 = plan_graph(one, chip, dt, scales=search_scales, partials=partials, weights=weights, grow=1,
                    grow_ops=False, grow_when=growable(chip),
                    grow_beside=growths.start(1) if growths is not None else None)
    if not p1.fits and calibrating is not None:  # the error reports the bytes of the calibrated plan
        p1 = None
        p1 = plan_graph(one, chip, dt, scales=calibrating(), partials=partials, weights=weights)
    if not p1.fits:
        raise _does_not_fit(p1.state, p1.memory, p1.liveness, chip, 1, 0)
    if growths is None or not growths.keep(1, p1):
        found["rates"][1] = plan_rate(p1, chip, dt, 1)
    if getattr(p1.state, "share_layers", False):  # plans without shared layers failed at batch 1 already
        found["shared_from"] = 1
    # The fastest plans the search makes are kept whole (fits_at), and growing them fully grows them on instead
    # of planning them again, when a probe's graph is the one compiled: a model file's probes are rebatched
    # graphs, whose value names may differ from the file's own at that batch (_Rebatching), so those are planned
    # again (their recipes, made beside, are dropped below). With growths beside, only plans without a recipe
    # are kept so (kept_whole). (FP8: kept planned with all-zero scales, lowered again with the calibrated ones
    # at the end.)
    if not hasattr(build, "exact") and kept_whole(p1, growths):
        found["plans"] = {1: p1}
    # When batch 1 fits with every weight on the chip, the search keeps them there: streaming is how a model too
    # big for the chip runs at all, and larger batches that fit only by streaming were slower where measured
    # (SigLIP so400m fp8: 205.0 samples/s at batch 16 with 15 layers streamed, 221.6 resident at 9), while each
    # such probe plans for minutes.
    if weights == "auto" and getattr(p1.state, "streaming", None) is None:
        weights = "resident"
    p1 = one = None
    largest = find_max_batch(build, chip, dtype, progress=progress, scales=search_scales, one_fits=True,
                             found=found, partials=partials, weights=weights, grow=True, growths=growths)
    if hasattr(build, "exact"):  # (a rebatched probe's recipe may name other values: planned again)
        found.pop("made", None)
    # The fastest of the batches planned, each ranked by its plan grown one step (a larger batch can be slower:
    # more rounds, tighter budgets), the AUTO_GROWN fastest then grown fully as a compile at their batch grows
    # its plan: the faster is compiled, the same Program as a compile of that batch alone.
    rates = found["rates"]
    # (side by side only with every weight resident: a plan that streams has no recipe, and is priced from its
    # Program, gigabytes made in a forked process and in one whose pages it shares: SigLIP so400m fp16's two took
    # 10.2 and 16.0 s so, its whole choice 9.4 s one after the other)
    # FP8: once the first is grown, the scales are waited for, and the largest is planned with them (_confirm_beside)
    # beside the growth of the others, when a core is free for it.
    confirm = None

    def between() -> None:
        nonlocal confirm
        if forks and largest > 1:
            confirm = _confirm_beside(build, chip, dt, found, largest, calibrating(), partials, weights)

    chosen = _fastest_grown(build, chip, dt, progress, found, largest, scales, calibrating is not None,
                            partials, weights, parallel and weights == "resident",
                            between if calibrating is not None and not isinstance(calibrating, Stored) else None)
    batch, graph, planned = chosen if chosen is not None else (max(rates, key=lambda b: (rates[b], b)), None, None)
    chosen = None
    graph = graph if graph is not None else _exact(build, batch)
    shared_only = _shared_only(found, largest, batch)
    if calibrating is not None:
        # grown with all-zero scales while the calibration ends, then lowered again with the calibrated ones
        scales = calibrating()
        if planned is not None:
            planned = _calibrated(graph, chip, dt, planned, scales, partials, weights, shared_only, progress)
        if planned is not None and planned.fits:  # the largest then is at least the batch compiled
            largest = _largest_calibrated(build, chip, dt, batch, largest, found, scales, partials, weights,
                                          progress, forks, confirm)  # (the calibration has ended)
            rates = {b: r for b, r in rates.items() if b <= largest}
        else:
            # the plan chosen no longer fits with the calibrated scales: search again with them (slower, and not
            # seen on the zoo models)
            if confirm is not None:
                confirm.cancel()  # type: ignore[attr-defined]
            planned = None
            found = {"rates": {}}
            largest = find_max_batch(build, chip, dt, progress=progress, scales=scales, found=found,
                                     partials=partials, weights=weights, grow=True)
            rates = found["rates"] or {1: 0.0}  # none: batch 1 does not fit; its plan says so
            batch = max(rates, key=lambda b: (rates[b], b))
            graph = _exact(build, batch)
            shared_only = _shared_only(found, largest, batch)
    auto = {"largest": largest, "rates": dict(sorted(rates.items())),
            "grown": sorted({b for b in found.get("grown", ()) if b in rates} | {batch})}
    recipe = recipe_of(planned.state) if planned is not None and planned.fits else None
    if recipe is not None:
        k = k if dt != "fp8" or known is not None else _auto_key(digest, chip, dt, scales, partials, asked)
        cache.store(AUTO_ENTRY, k, {"batch": batch, "auto": auto, "shared_only": shared_only,
                                    "recipe": asdict(recipe), "graph": graph.name})
    return batch, graph, planned, auto, shared_only, scales


AUTO_ENTRY, AUTO_VERSION = "batch-auto", 1  # the cache's entries of --batch auto's answers (cache.py)


def _auto_key(digest: str | None, chip, dt: str, scales: dict[str, int] | None, partials: str, weights: str
              ) -> str | None:
    """The cache key of --batch auto's answer for the model built at batch 1 (its cache.graph_digest): None at fp8
    without its calibrated scales. The host's memory is in it: the search refuses batches that would not plan within
    it."""
    if dt == "fp8" and scales is None:
        return None
    return cache.key(AUTO_ENTRY, AUTO_VERSION, digest, {"chip": repr(chip), "dtype": dt, "scales": scales,
                                                     "partials": partials, "weights": weights,
                                                     "host": limits.host_memory_budget()})


def _stored_auto(entry: dict | None, build, chip, dt: str, scales: dict[str, int] | None, partials: str,
                 progress: Progress | None):
    """(batch, graph, plan, auto, shared_only) of a stored --batch auto answer, its plan lowered again from its
    Recipe, or None (no entry, one this code did not write, or a plan that does not fit)."""
    recipe = _stored_recipe(entry)
    if recipe is None:
        return None
    try:
        batch, shared_only = int(entry["batch"]), bool(entry["shared_only"])  # type: ignore[index]
        a = entry["auto"]  # type: ignore[index]
        auto = {"largest": int(a["largest"]), "rates": {int(b): float(r) for b, r in a["rates"].items()},
                "grown": [int(b) for b in a["grown"]]}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    graph = _exact(build, batch)
    plan = from_recipe(graph, chip, dt, recipe, scales, partials, progress)
    return (batch, graph, plan, auto, shared_only) if plan.fits else None


def compile_model(model: ModelSpec, chip, batch: int | str | None = None, dtype: str = "fp32",
                  seq_len: int | None = None, progress: Progress | None = None, require_fit: bool = True,
                  calibration: dict[str, np.ndarray] | None = None, partials: str = "half",
                  scales: dict[str, int] | None = None, weights: str = "auto",
                  weights_ahead: bool = False) -> CompileResult:
    """Compile a model (a Graph, a model spec for load_model, or a batch -> Graph builder) for `chip`.

    batch=None is the model's own batch (an ONNX file's fixed one, else 1; a Graph's own); the result's `batch` is
    always the batch of the graph actually planned. batch="auto" searches up to the largest batch that fits and
    compiles the fastest of the batches it planned that fit (modelled samples/s, host I/O included; `auto` on the
    result holds both and the rates; needs a spec or a builder; an ONNX file with a fixed batch answers for that
    batch, with a notice). A batch over the lower bound
    of limits.py is refused before planning (limits.TooBig). With require_fit, a plan that does not fit raises
    DoesNotFit (with the largest batch that fits when the model can be rebuilt at other batches). dtype="fp8"
    calibrates activation scales on `calibration` (input name -> array) or on CALIBRATION_SAMPLES seeded samples.
    partials: what fp16 and fp8 matmuls accumulate in, "half" (PopRT's choice, twice the fp16 AMP rate) or "float"
    (passes/precision.with_partials); fp32 ignores it. `scales` (fp8): activation scales calibrated already, used
    instead of calibrating (a pipeline stage takes the whole model's: multichip.py). weights: "auto" streams the
    weights of the fewest layers from host memory that make a plan fit when keeping them all on the chip does not,
    "resident" never streams, "streamed" streams every repeated layer (pipeline.plan_graph, plan/stream.py); with
    batch="auto", "auto" streams only when batch 1 needs it. weights_ahead: the caller reads the seeded weights after
    (check_model, inside a sharing_weights block): at a fixed batch, once the model is known not to be refused, they
    are made on every core before the FP8 calibration is forked, which then reads them instead of making them again.
    """
    t0 = time.perf_counter()
    if isinstance(chip, str):
        from tremula.target.chip import load_chip

        chip = load_chip(chip)
    dt = resolve_dtype(dtype)
    check_fp8(chip, dt)
    build = builder(model, seq_len)
    if batch == "auto":
        batch = auto_batch_request(model, build)
    elif batch is not None:
        batch = int(batch)
        if batch < 1:
            raise TremulaError(f"batch must be >= 1 (got {batch})")
    graph: Graph | None = None
    auto: dict | None = None
    planned: tuple | None = None  # --batch auto: the chosen batch planned (grown on from the search's plan)
    if batch != "auto":
        graph = model if isinstance(model, Graph) else _exact(build, batch)  # type: ignore[arg-type]
        real = model_batch(graph)
        if batch is not None and real is not None and real != batch:
            raise TremulaError(f"the graph has batch {real}, not the batch {batch} asked; build it at that batch or "
                               "pass batch=None")
        refuse_oversize(build, graph, chip, dt, weights=weights)
    shared_only = False
    calibrating: Callable[[], dict[str, int]] | None = None  # the calibration's result, when it runs beside
    if dt == "fp8" and scales is None:
        if progress:
            progress("calibrate", 0, 1)
        job = calibration_job(build, model if isinstance(model, Graph) else None, calibration, chip)
        if isinstance(job, Stored):
            # scales an earlier run calibrated (cache.py): planned exactly as beside a calibration (the same
            # Program), with the core it would take free
            calibrating = job
        elif batch == "auto" or can_fork():
            # beside the batch search or the plan (see below), in a forked process: on a thread the two shared one
            # interpreter lock, and the search ended waiting for the calibration (SigLIP so400m fp8: the last probe
            # done at 42.1 s, the scales at 48.7 s; in a process at 45.8 s, 54.8 -> 51.2 s in all). Also when the
            # caller keeps the seeded weights the calibration makes (check_model simulates with them): made in the
            # forked process they are made again in this one (5 s for SigLIP so400m), but a check plans as a compile
            # does (zero scales first, _plan_beside) and calibrating first left the plan waiting on it: SigLIP so400m
            # fp8 b1's check 104.7 -> 96.6 s. With weights_ahead they are made here first, on every core, and the
            # forked calibration reads them: that check 115.5 -> 92.5 s (the calibration drew 428 M values on one
            # core, 8.4 s, and the check again after the compile).
            if weights_ahead and graph is not None:
                make_values(graph.constants.values(), usable_cores())
            calibrating = _calibration_beside(job)
        else:
            scales = job()
    if batch == "auto":
        assert build is not None
        batch, graph, planned, auto, shared_only, scales = _auto(build, chip, dt, dtype, progress, calibrating, scales,
                                                                  partials, weights)
    assert graph is not None
    real = model_batch(graph)
    batch = real if real is not None else (batch if isinstance(batch, int) else 1)
    if planned is not None:
        plan = planned
    elif dt == "fp8":
        # Planned with all-zero scales, then lowered again with the calibrated ones, however they were had: beside
        # the plan, first (where the platform cannot fork), or given (a pipeline stage's). Near full the two ways of
        # planning differ (zeros patch no scale field, so the growth has more room): SigLIP so400m fp8 b8 306.0 img/s
        # planned so, 300.3 planned with its scales, which `check` and `--system 1xc600` compiled while `compile`
        # gave the other. (With --batch auto: the batch a search with the calibrated scales chose, as --batch N.)
        if calibrating is None:
            calibrating = lambda had=scales: had  # noqa: E731
        plan = _plan_beside(graph, chip, dt, progress, calibrating, partials, weights)
        scales = calibrating()
    else:
        plan = _grown_plan(graph, chip, dt, progress, scales, shared_only, partials, weights)
    planned = None
    g, state, mp = plan.graph, plan.state, plan.memory
    if require_fit and not mp.fits:
        # Batch 1 not fitting answers the search already; otherwise search below this batch.
        max_b = 0 if batch == 1 else None
        if build is not None and batch > 1:
            try:
                max_b = find_max_batch(build, chip, dtype, limit=batch - 1, scales=scales, partials=partials,
                                       weights=weights)
            except FixedBatch:  # fixed at this batch and not rebatchable: no other batch to offer
                max_b = None
        raise _does_not_fit(state, mp, plan.liveness, chip, batch, max_b)
    program, comp, exch, sync = priced_program(plan, chip, dt, batch, progress)
    res = CompileResult(program, mp.fits, batch, dt, mp.fullest_tile, mp.peak_bytes, mp.peak_time // 2,
                        dict(mp.by_category), len(program.steps), comp + exch + sync, comp, exch, sync,
                        dict(state.strategies), dict(state.split_sums), graph=g, source=graph)
    res.shared_layers = state.sharing.shared_layers if getattr(state, "sharing", None) is not None else 0
    res.partials = partials if dt in ("float16", "fp8") else "float"
    res.host_in_bytes, res.host_out_bytes, res.host_in_cycles, res.host_out_cycles = host_cycles(program, chip)
    if auto is not None:  # the batch compiled at the rate compiled
        res.auto = auto
        rates = auto["rates"]
        rates[batch] = batch * chip.clock_hz / res.throughput_cycles
        largest = auto["largest"]
        if largest and batch != largest:
            notice(f"--batch auto: batch {largest} is the largest that fits, but batch {batch} is faster "
                   f"({rates[batch]:,.1f} against {rates[largest]:,.1f} samples/s modelled): compiling batch {batch}")
    res.streamed_bytes = streamed_weight_bytes(program.consts)
    streaming = getattr(state, "streaming", None)
    for run, _ in streaming.layers if streaming is not None else ():
        res.streamed_layers[run] = res.streamed_layers.get(run, 0) + 1
    program.meta = {"summary": res.summary(), "model": graph.name}
    res.seconds = time.perf_counter() - t0
    return res

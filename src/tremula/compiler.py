"""The driver: model -> canonical Graph -> plan -> memory plan -> Program; `check_model` runs it in the simulator.

`compile_model` answers "does it fit, at which batch, how fast": a Program, the memory of the fullest tile by category
and the estimated cycles per forward pass. When the peak does not fit, it raises DoesNotFit naming the tile, the step,
bytes by category and the largest batch that fits (found by planning only, never simulating).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Union

import numpy as np

from tremula.errors import TremulaError
from tremula.ir.graph import Constant, Graph, Node
from tremula.ir.interp import infer_types, run
from tremula.plan.finalize import memory_plan, step_cycles, to_program
from tremula.plan.lower_ops import Lowerer
from tremula.program import Program

Progress = Callable[[str, int, int], None]
ModelSpec = Union[Graph, str, Callable[[int], Graph]]  # noqa: UP007 (a runtime alias)
DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16"}
MAX_AUTO_BATCH = 4096
# Planner budgets tried in turn until a plan fits: (operand block, permanent bytes of the matmuls), as fractions of a
# tile's SRAM (see plan/strategies.py). The first leaves permanent bytes unbudgeted (fastest plans); tighter budgets
# trade cycles for memory.
PLAN_BUDGETS = ((0.12, None), (0.12, 0.4), (0.12, 0.3), (0.12, 0.2), (0.04, 0.2))


class DoesNotFit(TremulaError):
    """The program's peak memory on some tile exceeds its SRAM."""

    def __init__(self, tile: int, step: int, by_category: dict[str, int], peak: int, sram: int, batch: int,
                 max_batch: int | None):
        self.tile, self.step, self.by_category, self.peak, self.sram = tile, step, by_category, peak, sram
        self.batch, self.max_batch = batch, max_batch
        cats = ", ".join(f"{k} {v:,}" for k, v in by_category.items() if v)
        if max_batch is None:
            hint = "try a smaller batch, fp16, or a chip with more SRAM"
        elif max_batch == 0:
            hint = "even batch 1 does not fit: use a smaller precision, more IPUs, or a chip with more SRAM"
        else:
            hint = f"the largest batch that fits is {max_batch} (use --batch {max_batch} or --batch auto)"
        super().__init__(f"does not fit at batch {batch}: tile {tile} needs {peak:,} of {sram:,} bytes at step {step} "
                         f"({cats}); {hint}")


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
    seconds: float = 0.0  # wall time of the compile (not stored in the Program, which must be deterministic)

    def summary(self) -> dict:
        return {"fits": self.fits, "batch": self.batch, "dtype": self.dtype, "fullest_tile": self.fullest_tile,
                "peak_tile_bytes": self.peak_tile_bytes, "peak_step": self.peak_step,
                "memory_by_category": self.memory_by_category, "steps": self.steps, "cycles": self.cycles,
                "compute_cycles": self.compute_cycles, "exchange_cycles": self.exchange_cycles,
                "sync_cycles": self.sync_cycles}


# ------------------------------------------------------------------------------------------------ graph preparation


def _builder(model: ModelSpec, seq_len: int | None) -> Callable[[int], Graph] | None:
    if isinstance(model, Graph):
        return None
    if isinstance(model, str):
        from tremula.frontends import load_model

        return lambda b: load_model(model, batch=b, seq_len=seq_len)
    return model


def canonical(graph: Graph) -> Graph:
    try:
        from tremula.passes import canonicalize
    except ImportError:  # passes not installed in this build: the graph must already be canonical
        return infer_types(graph.copy())
    return canonicalize(graph)


def cast_graph(graph: Graph, dtype: str) -> Graph:
    """The graph with every float32 tensor (constants, inputs, casts) in `dtype`; float32 returns it unchanged."""
    if dtype == "float32":
        return graph
    g = graph.copy()
    for name, c in list(g.constants.items()):
        if c.type.dtype == "float32":
            t = type(c.type)(c.type.shape, dtype)
            if c.is_lazy:
                g.constants[name] = Constant(name, t, init=c.init)
            else:  # saturate like the hardware's float->half conversion (a -3.4e38 mask fill becomes -65504, not -inf)
                fmax = float(np.finfo(dtype).max)
                g.constants[name] = Constant(name, t, data=np.clip(c.data, -fmax, fmax).astype(dtype))
            g.types[name] = t
    for name in g.inputs:
        t = g.types[name]
        if t.dtype == "float32":
            g.types[name] = type(t)(t.shape, dtype)
    g.nodes = [Node(n.op, n.inputs, n.outputs, {**n.attrs, "to": dtype} if n.op == "Cast" and n.attrs.get("to") ==
                    "float32" else n.attrs, n.name) for n in g.nodes]
    return infer_types(g)


def _resolve_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise TremulaError(f"unsupported --dtype {dtype!r}: use fp32 or fp16")
    return DTYPES[dtype]


# ------------------------------------------------------------------------------------------------ planning


def plan_graph(graph: Graph, chip, dtype: str, progress: Progress | None = None):
    """Plan + memory plan (no Program): (lowering state, memory plan, liveness, reserved bytes)."""
    g = cast_graph(canonical(graph), dtype)
    # Tighter budgets mean more rounds or fewer tiles per matmul: the first plan that fits is kept, else the one with
    # the lowest peak.
    best = None
    for frac, perm in PLAN_BUDGETS:
        state = Lowerer(g, chip, progress, temp_fraction=frac, perm_fraction=perm).lower()
        mp, live, reserved = memory_plan(state, chip)
        if best is None or mp.peak_bytes < best[1].peak_bytes:
            best = (state, mp, live, reserved)
        # Budgets shrink only buffers, vertex state and exchange code: when the rest alone overflows, stop.
        fixed = mp.peak_bytes - sum(mp.by_category.get(c, 0) for c in ("buffers", "vertex_state", "exchange_code"))
        if mp.fits or fixed > chip.sram_bytes_per_tile:
            break
    state, mp, live, reserved = best
    return g, state, mp, live, reserved


def fits_at(build: Callable[[int], Graph], chip, dtype: str, batch: int) -> bool:
    _, _, mp, _, _ = plan_graph(build(batch), chip, dtype)
    return mp.fits


def find_max_batch(build: Callable[[int], Graph], chip, dtype: str = "fp32", limit: int = MAX_AUTO_BATCH,
                   progress: Progress | None = None) -> int:
    """The largest batch whose plan fits (0 if batch 1 does not), by doubling then bisection; planner only."""
    dt = _resolve_dtype(dtype)
    probes = 0

    def ok(b: int) -> bool:
        nonlocal probes
        probes += 1
        if progress:
            progress("batch search", probes, probes + 1)
        return fits_at(build, chip, dt, b)

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def compile_model(model: ModelSpec, chip, batch: int | str = 1, dtype: str = "fp32", seq_len: int | None = None,
                  progress: Progress | None = None, require_fit: bool = True) -> CompileResult:
    """Compile a model (a Graph, a model spec for load_model, or a batch -> Graph builder) for `chip`.

    batch="auto" picks the largest batch that fits (needs a spec or a builder). With require_fit, a plan that does
    not fit raises DoesNotFit (with the largest batch that fits when the model can be rebuilt at other batches).
    """
    t0 = time.perf_counter()
    if isinstance(chip, str):
        from tremula.chip import load_chip

        chip = load_chip(chip)
    dt = _resolve_dtype(dtype)
    build = _builder(model, seq_len)
    if batch == "auto":
        if build is None:
            raise TremulaError("--batch auto needs a model name or file, not an already built graph")
        b = find_max_batch(build, chip, dtype, progress=progress)
        if b == 0:
            _, state, mp, _, _ = plan_graph(build(1), chip, dt)
            raise DoesNotFit(mp.fullest_tile, mp.peak_time // 2, mp.by_category, mp.peak_bytes,
                             chip.sram_bytes_per_tile, 1, 0)
        batch = b
    batch = int(batch)
    if batch < 1:
        raise TremulaError(f"batch must be >= 1 (got {batch})")
    graph = model if isinstance(model, Graph) else build(batch)  # type: ignore[misc]
    g, state, mp, live, reserved = plan_graph(graph, chip, dt, progress)
    if require_fit and not mp.fits:
        # Batch 1 not fitting answers the search already; otherwise search below this batch.
        max_b = 0 if batch == 1 else (find_max_batch(build, chip, dtype, limit=batch - 1) if build else None)
        raise DoesNotFit(mp.fullest_tile, mp.peak_time // 2, mp.by_category, mp.peak_bytes,
                         chip.sram_bytes_per_tile, batch, max_b)
    io = {n: (g.types[n].shape, g.types[n].dtype) for n in list(g.inputs) + list(g.outputs)}
    program = to_program(state, chip, mp, live, reserved, dt, batch, io)
    comp = exch = sync = 0
    for i, s in enumerate(program.steps):
        if progress:
            progress("estimate", i, len(program.steps))
        c, e, y = step_cycles(chip, s)
        comp, exch, sync = comp + c, exch + e, sync + y
    res = CompileResult(program, mp.fits, batch, dt, mp.fullest_tile, mp.peak_bytes, mp.peak_time // 2,
                        dict(mp.by_category), len(program.steps), comp + exch + sync, comp, exch, sync,
                        dict(state.strategies))
    program.meta = {"summary": res.summary(), "model": graph.name}
    res.seconds = time.perf_counter() - t0
    return res


# ------------------------------------------------------------------------------------------------ check


def make_feeds(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs: token ids below the vocabulary of the table they index, attention masks with some padding,
    normal floats elsewhere."""
    rng = np.random.default_rng(seed)
    tables: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "Gather" and n.inputs[0] in graph.constants and n.inputs[1] in graph.inputs:
            tables[n.inputs[1]] = graph.types[n.inputs[0]].shape[n.attrs.get("axis", 0)]
    feeds = {}
    for name in graph.inputs:
        t = graph.types[name]
        if t.dtype.startswith("float"):
            feeds[name] = rng.standard_normal(t.shape).astype(t.dtype)
        elif "mask" in name.lower():
            m = np.ones(t.shape, t.dtype)
            if len(t.shape) >= 2 and t.shape[-1] > 2:
                for b in range(t.shape[0]):  # row b pads its last b % 3 positions (row 0 has none)
                    pad = (b + 1) % 3
                    if pad:
                        m[b, ..., t.shape[-1] - pad:] = 0
            feeds[name] = m
        else:
            feeds[name] = rng.integers(0, tables.get(name, 2), t.shape).astype(t.dtype)
    return feeds


@dataclass
class OutputCheck:
    name: str
    metric: str  # "max_rel_err" (fp32) or "cosine" (fp16)
    value: float
    threshold: float
    passed: bool


@dataclass
class CheckResult:
    compile: CompileResult
    outputs: list[OutputCheck]

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)


FP32_MAX_REL_ERR = 1e-4
FP16_MIN_COSINE = 0.9995


def compare(name: str, got: np.ndarray, ref: np.ndarray, dtype: str) -> OutputCheck:
    g, r = got.astype(np.float64).reshape(-1), ref.astype(np.float64).reshape(-1)
    if dtype == "float32" or not np.issubdtype(ref.dtype, np.floating):
        scale = np.max(np.abs(r)) if r.size else 0.0
        err = float(np.max(np.abs(g - r)) / scale) if scale > 0 else float(np.max(np.abs(g - r), initial=0.0))
        if not np.all(np.isfinite(g)):
            err = float("inf")
        return OutputCheck(name, "max_rel_err", err, FP32_MAX_REL_ERR, err <= FP32_MAX_REL_ERR)
    denom = np.linalg.norm(g) * np.linalg.norm(r)
    cos = float(g @ r / denom) if denom > 0 else float(np.array_equal(g, r))
    if not np.all(np.isfinite(g)):
        cos = float("-inf")
    return OutputCheck(name, "cosine", cos, FP16_MIN_COSINE, cos >= FP16_MIN_COSINE)


def check_model(model: ModelSpec, chip, batch: int | str = 1, dtype: str = "fp32", seq_len: int | None = None,
                seed: int = 0, progress: Progress | None = None, check: bool = True) -> CheckResult:
    """Compile, run the Program in the functional simulator on seeded inputs, compare with the reference interpreter.

    The reference is always the float32 graph, so fp16 is judged against the model it approximates.
    """
    from tremula.sim.functional import simulate

    if isinstance(chip, str):
        from tremula.chip import load_chip

        chip = load_chip(chip)
    res = compile_model(model, chip, batch, dtype, seq_len, progress)
    build = _builder(model, seq_len)
    graph = model if isinstance(model, Graph) else build(res.batch)  # type: ignore[misc]
    ref_graph = canonical(graph)
    feeds = make_feeds(ref_graph, seed)
    sim_graph = cast_graph(ref_graph, res.dtype)
    got = simulate(res.program, sim_graph, feeds, check=check, progress=progress)
    ref = run(ref_graph, feeds)
    outs = [compare(o, got[o], ref[o], res.dtype) for o in ref_graph.outputs]
    return CheckResult(res, outs)

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

from tremula import limits
from tremula.errors import NoFit, TremulaError, notice
from tremula.frontends.rebatch import FixedBatch
from tremula.ir.graph import Constant, DerivedInit, Graph, Node
from tremula.ir.interp import infer_types, run
from tremula.model_info import model_batch
from tremula.plan.finalize import memory_plan, to_program
from tremula.plan.layers import layer_key
from tremula.plan.lower_ops import Lowerer
from tremula.program import Program, host_stream_bytes
from tremula.target.cost import host_transfer_cycles
from tremula.target.step_cost import step_cycles

Progress = Callable[[str, int, int], None]
ModelSpec = Union[Graph, str, Callable[[int], Graph]]  # noqa: UP007 (a runtime alias)
DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16", "fp8": "fp8"}
CALIBRATION_SEED = 1  # seeded calibration inputs differ from check's inputs (seed 0): scales are not fit to the test
# Seeded samples calibrated together by default (max-abs over all of them). One sample set the scales of SigLIP's
# attention-pooling head too low for other inputs (siglip-tiny's pooler: cosine 0.987 at batch 8, seed 1, below the
# 0.99 bar); from four samples on the scales stopped changing.
CALIBRATION_SAMPLES = 4
MAX_AUTO_BATCH = 4096
# Planner budgets tried in turn until a plan fits: (operand block, permanent bytes of the matmuls), as fractions of a
# tile's SRAM (see plan/strategies.py), and whether identical layers share one copy of their code (plan/share.py).
# The first leaves permanent bytes unbudgeted (fastest plans); tighter budgets trade cycles for memory. Sharing streams
# every layer's weights to all its tiles, which cost SigLIP so400m 0.1 % of its cycles at batch 4, and holds one
# layer's vertex state and exchange code instead of one per layer (91 KB a tile less there). A graph without
# numbered layers skips the shared budget; a graph with them stops after it: once layers share, the permanent budgets
# change nothing, and a tighter operand budget at batch 16 took SigLIP so400m over 9 GB of host memory to plan.
PLAN_BUDGETS = ((0.12, None, False), (0.12, 0.4, False), (0.12, 0.4, True), (0.12, 0.3, False), (0.12, 0.2, False),
                (0.04, 0.2, False))


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
    shared_layers: int = 0  # layers that run a template layer's code (plan/share.py)
    # Host link: the Program's input streams before the forward and its output streams after it
    # (cost.host_transfer_cycles of the bytes they carry); not part of `cycles`, which stays device cycles.
    host_in_bytes: int = 0
    host_out_bytes: int = 0
    host_in_cycles: int = 0
    host_out_cycles: int = 0
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
                "sync_cycles": self.sync_cycles, "shared_layers": self.shared_layers,
                "host_in_bytes": self.host_in_bytes, "host_out_bytes": self.host_out_bytes,
                "host_in_cycles": self.host_in_cycles, "host_out_cycles": self.host_out_cycles,
                "host_cycles": self.host_cycles, "latency_cycles": self.latency_cycles,
                "host_overlaps_device": False, "throughput_cycles": self.throughput_cycles}


# ------------------------------------------------------------------------------------------------ graph preparation


def _builder(model: ModelSpec, seq_len: int | None) -> Callable[[int | None], Graph] | None:
    """batch -> Graph; None is the model's own batch (an ONNX file's fixed one, else 1)."""
    if isinstance(model, Graph):
        return None
    if isinstance(model, str):
        from tremula.frontends import load_model

        return lambda b: load_model(model, batch=b, seq_len=seq_len)
    return lambda b: model(1 if b is None else b)  # a user's builder has no batch of its own


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


# ------------------------------------------------------------------------------------------------ size limits


def _needs(graph: Graph, dt: str) -> tuple[limits.Need, limits.Need]:
    """The lower bounds (limits.py) of `graph` on the chip at `dt` and on the host."""
    g = canonical(graph)
    b = model_batch(graph)
    return limits.needs(g, dt, b), limits.needs(g, None, b)


def _caps(chip) -> tuple[int, int | None]:
    return limits.chip_capacity(chip), limits.host_memory_budget()


def _memory_names(chip) -> tuple[str, str]:
    return (f"the {chip.tiles} x {chip.sram_bytes_per_tile:,} bytes of SRAM of {chip.name}",
            f"the {limits.HOST_FRACTION:.0%} of this host's memory tremula allows itself")


def bound_limit(build: Callable[[int | None], Graph], chip, dt: str, host_only: bool = False) -> int:
    """The largest batch the lower bound allows on the chip and the host (0: not batch 1), from the model built
    at batches 1 and 2; a model that cannot be built at another batch gives no limit."""
    try:
        g1, g2 = build(1), build(2)
    except FixedBatch:
        return limits.UNBOUNDED
    (c1, h1), (c2, h2) = _needs(g1, dt), _needs(g2, dt)
    cap, host = _caps(chip)
    best = limits.largest_batch(c1, c2, cap) if not host_only else limits.UNBOUNDED
    if host is not None:
        best = min(best, limits.largest_batch(h1, h2, host))
    return best


def refuse_oversize(build, graph: Graph, chip, dt: str, what: str | None = None, host_only: bool = False) -> None:
    """Raise limits.TooBig when `graph` cannot fit by the lower bound, with the largest batch that could; planning
    a batch that cannot fit took minutes and gigabytes before failing (issue #11)."""
    chip_need, host_need = _needs(graph, dt)
    cap, host = _caps(chip)
    on_chip, on_host = _memory_names(chip)
    if not host_only and chip_need.total > cap:
        need, limit, memory = chip_need, cap, on_chip
    elif host is not None and host_need.total > host:
        need, limit, memory = host_need, host, on_host
    else:
        return
    b = model_batch(graph)
    max_b = None
    if b == 1:
        max_b = 0
    elif build is not None and b is not None:
        max_b = bound_limit(build, chip, dt, host_only=host_only)
        max_b = min(max_b, b - 1)
    raise limits.refusal(need, limit, what or f"{graph.name} at batch {b}", max_b, memory, samples=host_only)


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
            if c.is_lazy:  # made from the float32 constant, so a graph that shares it makes the values once
                g.constants[name] = Constant(name, t, init=DerivedInit(c, _to_dtype(dtype), f"{dtype} cast"))
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


def _to_dtype(dtype: str) -> Callable[[np.ndarray], np.ndarray]:
    return lambda v: v.astype(dtype)  # as LazyInit.make rounds its float32 draws: the same values


def _resolve_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise TremulaError(f"unsupported --dtype {dtype!r}: use fp32, fp16 or fp8")
    return DTYPES[dtype]


def lower_precision(graph: Graph, dtype: str, chip=None, scales: dict[str, int] | None = None) -> Graph:
    """The canonical graph in `dtype`. fp8 is the mixed policy (passes/precision.py): FP8 operands for every Linear
    with calibrated activation scales, stored as codes for the AMP's quarter path; FP16 everywhere else."""
    g = canonical(graph)
    if dtype != "fp8":
        return cast_graph(g, dtype)
    from tremula.passes.precision import fp8_linear_casts, fp8_storage, with_scales

    g = cast_graph(with_scales(fp8_linear_casts(g), scales or {}), "float16")
    return fp8_storage(g, chip.amp_pair("fp8", "fp16").weights_per_conv_unit)


def fp8_scales(graph: Graph, feeds: dict[str, np.ndarray] | None = None) -> dict[str, int]:
    """Activation scales for the fp8 policy, calibrated on `feeds` (seeded inputs when None), in float32."""
    from tremula.passes.precision import calibration_scales, fp8_linear_casts

    g = fp8_linear_casts(canonical(graph))
    return calibration_scales(g, feeds if feeds is not None else make_feeds(g, CALIBRATION_SEED))


def _check_fp8(chip, dtype: str) -> None:
    if dtype == "fp8" and not chip.supports("fp8"):
        raise TremulaError(f"chip {chip.name} has no FP8 matmul unit (FP8 needs an ipu21 such as c600); "
                           "use --dtype fp16")


def _calibrate(build, graph: Graph | None, calibration: dict[str, np.ndarray] | None, chip) -> dict[str, int]:
    """Scales from the user's inputs or from CALIBRATION_SAMPLES seeded samples. The user's arrays are checked
    against the model at its own batch first (names, shapes, samples), then the model at their number of samples
    against the host's memory (types only), and only then are their values read (kinds, finiteness, ids)."""
    if not calibration:
        if build is None:
            assert graph is not None
            return fp8_scales(graph)
        try:
            g = build(CALIBRATION_SAMPLES)
        except FixedBatch:  # a fixed batch that cannot be rebatched: its own samples
            g = build(None)
        return fp8_scales(g)
    small = graph if build is None else build(None)
    assert small is not None
    arrays, n = _calibration_arrays(small, calibration)
    if n == model_batch(small):
        g = small
    elif build is None:
        raise TremulaError(f"calibration inputs hold {n} samples; this graph was built for {model_batch(small)}: "
                           "give that many")
    else:
        try:
            g = build(n)
        except FixedBatch as e:
            raise TremulaError(f"calibration inputs hold {n} samples, and the model cannot take them: {e}") from None
    refuse_oversize(build, g, chip, "float32", what=f"calibrating {g.name} on {n} samples", host_only=True)
    feeds = _calibration_values(canonical(small), arrays)
    return fp8_scales(g, feeds)


def _calibration_arrays(g: Graph, calibration: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
    """The user's calibration arrays by input name and their number of samples, refused (naming the input) unless
    every one is a non-empty batch of the model's samples."""
    if "" in calibration:  # an .npy file: the model's only input
        if len(g.inputs) != 1:
            raise TremulaError(f"the model has inputs {', '.join(g.inputs)}: give calibration inputs as an .npz "
                               "with one array per input name")
        calibration = {g.inputs[0]: calibration[""]}
    if set(calibration) != set(g.inputs):
        raise TremulaError(f"calibration inputs {sorted(calibration)} do not match the model's inputs "
                           f"{sorted(g.inputs)}")
    arrays: dict[str, np.ndarray] = {}
    for name in g.inputs:
        arr = np.asarray(calibration[name])
        rest = list(g.types[name].shape[1:])
        if arr.ndim != len(rest) + 1 or list(arr.shape[1:]) != rest:
            raise TremulaError(f"calibration input {name!r} has shape {list(arr.shape)}, the model takes "
                               f"[{', '.join(['N', *map(str, rest)])}] (N samples)")
        if arr.size == 0:
            raise TremulaError(f"calibration input {name!r} is empty (shape {list(arr.shape)}): give at least one "
                               "sample")
        arrays[name] = arr
    counts = {len(v) for v in arrays.values()}
    if len(counts) > 1:
        raise TremulaError("calibration inputs hold different numbers of samples: "
                           f"{', '.join(f'{k} {len(v)}' for k, v in arrays.items())}")
    return arrays, counts.pop()


def _calibration_values(g: Graph, arrays: dict[str, np.ndarray], what: str = "calibration input"
                        ) -> dict[str, np.ndarray]:
    """The arrays in the model's input dtypes, refused (naming the input) unless of the right kind of number,
    finite, and (token ids, by the tables of canonical graph `g`) within the vocabulary: a NaN poisons every scale
    after it and a negative id would silently wrap around."""
    tables = index_tables(g)
    feeds: dict[str, np.ndarray] = {}
    for name, arr in arrays.items():
        t = g.types[name]
        kind = arr.dtype.kind
        if t.dtype.startswith("float"):
            if kind not in "biuf":
                raise TremulaError(f"{what} {name!r} holds {arr.dtype} values; the model takes {t.dtype}")
            arr = arr.astype(t.dtype)
            bad = ~np.isfinite(arr)
            if bad.any():
                first = [int(i) for i in np.argwhere(bad)[0]]
                raise TremulaError(f"{what} {name!r} holds {int(bad.sum()):,} NaN or infinite value(s) "
                                   f"(the first at index {first}); {what}s must be finite numbers")
        else:
            if kind not in "biu":
                ints = "token ids" if name in tables else "integers"
                raise TremulaError(f"{what} {name!r} holds {arr.dtype} values; the model takes "
                                   f"{t.dtype} ({ints}): save integers")
            lo, hi = int(arr.min()), int(arr.max())
            vocab = tables.get(name)
            if vocab is not None and (lo < 0 or hi >= vocab):
                raise TremulaError(f"{what} {name!r} holds ids from {lo} to {hi}, outside [0, {vocab}) "
                                   f"of the {vocab}-row table it indexes")
            if t.dtype != "bool" and not (np.iinfo(t.dtype).min <= lo and hi <= np.iinfo(t.dtype).max):
                raise TremulaError(f"{what} {name!r} holds values from {lo} to {hi}, outside "
                                   f"{t.dtype}'s range")
            arr = arr.astype(t.dtype)
        feeds[name] = arr
    return feeds


# ------------------------------------------------------------------------------------------------ planning


def plan_graph(graph: Graph, chip, dtype: str, progress: Progress | None = None,
               scales: dict[str, int] | None = None, shared_only: bool = False):
    """Plan + memory plan (no Program): (graph as planned, lowering state, memory plan, liveness, reserved bytes).
    shared_only: skip the budgets without shared layers (the caller knows they do not fit)."""
    g = lower_precision(graph, dtype, chip, scales)
    # Tighter budgets mean more rounds or fewer tiles per matmul: the first plan that fits is kept, else the one with
    # the lowest peak. Only one lowering is alive at a time (a base model's is gigabytes at large batches): when the
    # lowest peak was not the last one tried, it is lowered again.
    best: tuple | None = None  # (peak bytes, budget index)
    futile: dict[bool, float] = {}  # share mode -> the budget below which its tighter budgets cannot help
    layered = len({layer_key(n.name or n.outputs[0]) for n in g.nodes} - {None}) > 1  # identical layers to share, maybe
    tried_shared = False
    for i, (frac, perm, share) in enumerate(PLAN_BUDGETS):
        if frac < futile.get(share, 0.0) or (share and not layered) or (layered and not share and
                                                                         (shared_only or tried_shared)):
            continue
        tried_shared = tried_shared or share
        plan = state = live = None  # drop the previous lowering before making the next
        state = Lowerer(g, chip, progress, temp_fraction=frac, perm_fraction=perm, share_layers=share).lower()
        mp, live, reserved = memory_plan(state, chip)
        plan = (state, mp, live, reserved)
        if best is None or mp.peak_bytes < best[0]:
            best = (mp.peak_bytes, i)
        # Budgets shrink only buffers, vertex state and exchange code: when the rest alone overflows, stop. A tighter
        # temporary budget shrinks buffers by cutting ops into more rounds, each with its own vertex state and exchange
        # code: it cannot help when the buffers are less than the overflow, nor when those per-round bytes already
        # outweigh the buffers (SigLIP so400m at batch 6 and 8: such plans took over 18 GB to lower and were larger).
        # (The rest is the categories' bytes: the free bytes below the peak, e.g. matmul operands kept in separate
        # memory elements, move with the buffers.)
        cat = mp.by_category
        fixed = sum(v for c, v in cat.items() if c not in ("buffers", "vertex_state", "exchange_code"))
        if mp.fits or fixed > chip.sram_bytes_per_tile:
            break
        if cat.get("buffers", 0) < max(mp.peak_bytes - chip.sram_bytes_per_tile,
                                       cat.get("vertex_state", 0) + cat.get("exchange_code", 0)):
            futile[share] = frac  # judged on the last plan of this mode before a tighter one
        else:
            futile.pop(share, None)
    assert best is not None and plan is not None
    if best[1] != i:
        plan = state = live = None
        frac, perm, share = PLAN_BUDGETS[best[1]]
        state = Lowerer(g, chip, progress, temp_fraction=frac, perm_fraction=perm, share_layers=share).lower()
        plan = (state, *memory_plan(state, chip))
    return (g, *plan)


def fits_at(build: Callable[[int], Graph], chip, dtype: str, batch: int,
            scales: dict[str, int] | None = None, shared_only: bool = False) -> tuple[bool, bool]:
    """(whether a plan fits, whether only shared-layer plans can: none fitting, or the one that fits shares).
    A batch over the lower bound (limits.py) is answered without planning."""
    graph = build(batch)
    (on_chip, on_host), (cap, host) = _needs(graph, dtype), _caps(chip)
    if on_chip.total > cap or (host is not None and on_host.total > host):
        return False, True
    _, state, mp, _, _ = plan_graph(graph, chip, dtype, scales=scales, shared_only=shared_only)
    return mp.fits, shared_only or not mp.fits or getattr(state, "share_layers", False)


def find_max_batch(build: Callable[[int], Graph], chip, dtype: str = "fp32", limit: int = MAX_AUTO_BATCH,
                   progress: Progress | None = None, scales: dict[str, int] | None = None,
                   one_fits: bool | None = None, found: dict | None = None) -> int:
    """The largest batch whose plan fits (0 if batch 1 does not), by doubling then bisection; planner only. Fitting
    is not strictly monotone in the batch (splits and budgets change with it), so this is the largest the search
    finds, and every batch it returns has a plan that fits.

    Once plans without shared layers fail at some batch, larger batches try only shared-layer plans: the others
    grow with the batch (SigLIP so400m's reached 23 GB of host memory at batch 16) and did not fit at a smaller one.
    `found["shared_from"]` is then that batch.

    FP8 scales change no byte or cycle of a plan, so the search plans with `scales` (or placeholders). `one_fits`:
    the caller already planned batch 1. The search goes no higher than the lower bound allows (limits.py), so an
    impossible batch is never planned."""
    dt = _resolve_dtype(dtype)
    if dt == "fp8" and scales is None:
        from tremula.passes.precision import activation_casts, fp8_linear_casts

        scales = {n.name: 0 for n in activation_casts(fp8_linear_casts(canonical(build(1))))}
    limit = min(limit, bound_limit(build, chip, dt))
    if limit < 1:
        return 0
    probes = 0

    shared_from = limit + 1  # smallest batch at which plans without shared layers failed

    def ok(b: int) -> bool:
        nonlocal probes, shared_from
        probes += 1
        if progress:
            progress("batch search", probes, probes + 1)
        fits, shared = fits_at(build, chip, dt, b, scales, shared_only=b >= shared_from)
        if shared:
            shared_from = min(shared_from, b)
        return fits

    if not (one_fits if one_fits is not None else ok(1)):
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
    if found is not None and shared_from <= lo:
        found["shared_from"] = shared_from
    return lo


def compile_model(model: ModelSpec, chip, batch: int | str | None = None, dtype: str = "fp32",
                  seq_len: int | None = None, progress: Progress | None = None, require_fit: bool = True,
                  calibration: dict[str, np.ndarray] | None = None) -> CompileResult:
    """Compile a model (a Graph, a model spec for load_model, or a batch -> Graph builder) for `chip`.

    batch=None is the model's own batch (an ONNX file's fixed one, else 1; a Graph's own); the result's `batch` is
    always the batch of the graph actually planned. batch="auto" picks the largest batch that fits (needs a spec or
    a builder; an ONNX file with a fixed batch answers for that batch, with a notice). A batch over the lower bound
    of limits.py is refused before planning (limits.TooBig). With require_fit, a plan that does not fit raises
    DoesNotFit (with the largest batch that fits when the model can be rebuilt at other batches). dtype="fp8"
    calibrates activation scales on `calibration` (input name -> array) or on CALIBRATION_SAMPLES seeded samples.
    """
    t0 = time.perf_counter()
    if isinstance(chip, str):
        from tremula.target.chip import load_chip

        chip = load_chip(chip)
    dt = _resolve_dtype(dtype)
    _check_fp8(chip, dt)
    build = _builder(model, seq_len)
    if batch == "auto":
        if build is None:
            raise TremulaError("--batch auto needs a model name or file, not an already built graph")
        own = _fixed_batch(model)
        if own is not None:  # its other batches would be rebatched guesses of the user's intent: answer for its own
            notice(f"{model} was exported with a fixed batch of {own}: --batch auto answers for batch {own} without "
                   "searching (re-export it with a dynamic batch, dynamic_axes= or dynamic_shapes=, to search)")
            batch = None
    elif batch is not None:
        batch = int(batch)
        if batch < 1:
            raise TremulaError(f"batch must be >= 1 (got {batch})")
    graph: Graph | None = None
    if batch != "auto":
        graph = model if isinstance(model, Graph) else build(batch)  # type: ignore[misc]
        real = model_batch(graph)
        if batch is not None and real is not None and real != batch:
            raise TremulaError(f"the graph has batch {real}, not the batch {batch} asked; build it at that batch or "
                               "pass batch=None")
        refuse_oversize(build, graph, chip, dt)
    scales = None
    shared_only = False
    if dt == "fp8":
        if progress:
            progress("calibrate", 0, 1)
        scales = _calibrate(build, model if isinstance(model, Graph) else None, calibration, chip)
    if batch == "auto":
        assert build is not None
        # Batch 1 first: when it does not fit, its plan is what the error reports.
        one = build(1)
        refuse_oversize(build, one, chip, dt)
        _, state, mp, live, _ = plan_graph(one, chip, dt, scales=scales)
        if not mp.fits:
            raise _does_not_fit(state, mp, live, chip, 1, 0)
        state = live = one = None
        found: dict = {}
        batch = find_max_batch(build, chip, dtype, progress=progress, scales=scales, one_fits=True, found=found)
        shared_only = "shared_from" in found
        graph = build(batch)
    assert graph is not None
    real = model_batch(graph)
    batch = real if real is not None else (batch if isinstance(batch, int) else 1)
    g, state, mp, live, reserved = plan_graph(graph, chip, dt, progress, scales, shared_only)
    if require_fit and not mp.fits:
        # Batch 1 not fitting answers the search already; otherwise search below this batch.
        max_b = 0 if batch == 1 else None
        if build is not None and batch > 1:
            try:
                max_b = find_max_batch(build, chip, dtype, limit=batch - 1, scales=scales)
            except FixedBatch:  # fixed at this batch and not rebatchable: no other batch to offer
                max_b = None
        raise _does_not_fit(state, mp, live, chip, batch, max_b)
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
                        dict(state.strategies), graph=g, source=graph)
    res.shared_layers = state.sharing.shared_layers if getattr(state, "sharing", None) is not None else 0
    res.host_in_bytes, res.host_out_bytes = host_stream_bytes(program.host_in), host_stream_bytes(program.host_out)
    res.host_in_cycles = host_transfer_cycles(chip, res.host_in_bytes)
    res.host_out_cycles = host_transfer_cycles(chip, res.host_out_bytes)
    program.meta = {"summary": res.summary(), "model": graph.name}
    res.seconds = time.perf_counter() - t0
    return res


# ------------------------------------------------------------------------------------------------ check


def index_tables(graph: Graph) -> dict[str, int]:
    """Integer inputs that index a constant table (token ids), with the number of rows each may pick from."""
    tables: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "Gather" and n.inputs[0] in graph.constants and n.inputs[1] in graph.inputs:
            rows = graph.types[n.inputs[0]].shape[n.attrs.get("axis", 0)]
            tables[n.inputs[1]] = min(rows, tables.get(n.inputs[1], rows))
    return tables


def make_feeds(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs: token ids below the vocabulary of the table they index, attention masks with some padding,
    normal floats elsewhere."""
    rng = np.random.default_rng(seed)
    tables = index_tables(graph)
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
    metric: str  # what decides: "max_rel_err" (fp32) or "cosine" (fp16, fp8)
    value: float
    threshold: float
    passed: bool
    cosine: float = float("nan")  # both measures are always reported
    rel_err: float = float("nan")  # max |got - ref| / max |ref|


@dataclass
class CheckResult:
    compile: CompileResult
    outputs: list[OutputCheck]
    layers: list = field(default_factory=list)  # fp8: passes.precision.LayerLoss per FP8 Linear, worst first
    sim_seconds: float = 0.0  # wall time of the functional simulation
    # fp16 / fp8: each output against the precision-matched reference (sim/reference.py), with a tight tolerance:
    # did the simulator run the right Program? `outputs` (against float32) says how accurate that Program is.
    matched: list[OutputCheck] = field(default_factory=list)
    # check --inputs: the user's expected outputs and onnxruntime on the same inputs (an ONNX file), when they apply
    oracles: list[OracleCheck] = field(default_factory=list)
    inputs: str = "seeded"  # where the inputs came from: "seeded" (make_feeds) or "user"

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs) and all(o.passed for o in self.matched) and \
            all(o.passed for c in self.oracles for o in c.outputs)


@dataclass
class OracleCheck:
    """The simulated outputs against one more oracle: the user's expected outputs, or onnxruntime on the ONNX file.
    Its outputs compare as `compare` does against the float32 reference (the oracle is taken to be float32)."""

    name: str  # "expected" or "onnxruntime"
    note: str  # where its outputs came from, or why none was compared
    outputs: list[OutputCheck] = field(default_factory=list)
    not_compared: list[str] = field(default_factory=list)  # outputs of the program this oracle did not give


FP32_MAX_REL_ERR = 1e-4
MIN_COSINE = {"float16": 0.9995, "fp8": 0.99}  # against the float32 reference (issue #5)
FP16_MIN_COSINE = MIN_COSINE["float16"]
# Against the precision-matched reference (max |got - ref| / max |ref|): the larger of the output's resolution (half a
# unit in the last place of a half at the output's largest value, 2**-11) and REORDER_MARGIN x how far one legal
# reordering of the float32 sums moves this model's outputs (the largest of sim/reference.py's REORDERINGS).
# Measured (issue #12 report): the simulator equals the reference bit for bit wherever no matmul sums 512 or more
# terms (BLAS orders long sums by the block's shape); elsewhere (ViT/SigLIP/CLIP patch embeddings, bert-base, ViT-B)
# its distance was at most 1.2 x the reorderings' largest, so REORDER_MARGIN leaves 3x to spare.
MATCHED_MIN_REL_ERR = 2.0**-11
REORDER_MARGIN = 4.0


def compare(name: str, got: np.ndarray, ref: np.ndarray, dtype: str) -> OutputCheck:
    """`got` against the float32 reference: max relative error at fp32, cosine at fp16 / fp8 (their accuracy)."""
    err, cos = _errors(got, ref)
    if dtype == "float32" or not np.issubdtype(ref.dtype, np.floating):
        return OutputCheck(name, "max_rel_err", err, FP32_MAX_REL_ERR, err <= FP32_MAX_REL_ERR, cos, err)
    need = MIN_COSINE.get(dtype, FP16_MIN_COSINE)
    return OutputCheck(name, "cosine", cos, need, cos >= need, cos, err)


def compare_matched(name: str, got: np.ndarray, ref: np.ndarray, reordered: list[np.ndarray]) -> OutputCheck:
    """`got` against the precision-matched reference `ref`: max relative error within the output's resolution or
    REORDER_MARGIN x the largest distance of `reordered` (the same reference with its float sums in other orders)."""
    err, cos = _errors(got, ref)
    spread = max((_errors(r, ref)[0] for r in reordered), default=0.0)
    need = max(MATCHED_MIN_REL_ERR, REORDER_MARGIN * spread)
    return OutputCheck(name, "max_rel_err", err, need, err <= need, cos, err)


def check_matched(res: CompileResult, feeds: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> list[OutputCheck]:
    """Each output of a simulated fp16 / fp8 Program against the precision-matched reference (sim/reference.py)."""
    from tremula.sim.reference import REORDERINGS, matched_reference

    assert res.graph is not None
    ref = matched_reference(res.graph, res.strategies, feeds)
    # The reorderings (two more runs of the reference) only matter where the error is above the resolution floor.
    need = any(_errors(got[o], ref[o])[0] > MATCHED_MIN_REL_ERR for o in res.graph.outputs)
    alts = [matched_reference(res.graph, res.strategies, feeds, reorder=r) for r in REORDERINGS] if need else []
    return [compare_matched(o, got[o], ref[o], [a[o] for a in alts]) for o in res.graph.outputs]


def _errors(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max |got - ref| / max |ref|, cosine); (inf, -inf) when got has a NaN or an infinity ref does not have."""
    g, r = got.astype(np.float64).reshape(-1), ref.astype(np.float64).reshape(-1)
    # Infinities the reference itself makes (a -inf mask fill read as an output) must be the same in the result;
    # the error and cosine are measured on the rest (they were inf / -inf: a right answer reported as wrong).
    fin = np.isfinite(r)
    same_inf = bool(np.array_equal(g[~fin], r[~fin]))  # NaN is never equal, so a NaN still fails
    g, r = g[fin], r[fin]
    finite = same_inf and bool(np.all(np.isfinite(g)))
    scale = np.max(np.abs(r)) if r.size else 0.0
    err = float(np.max(np.abs(g - r)) / scale) if scale > 0 else float(np.max(np.abs(g - r), initial=0.0))
    denom = np.linalg.norm(g) * np.linalg.norm(r)
    cos = float(g @ r / denom) if denom > 0 else float(np.array_equal(g, r))
    if not finite:
        err, cos = float("inf"), float("-inf")
    return err, cos


def check_model(model: ModelSpec, chip, batch: int | str | None = None, dtype: str = "fp32",
                seq_len: int | None = None, seed: int = 0, progress: Progress | None = None, check: bool = True,
                calibration: dict[str, np.ndarray] | None = None, inputs: dict[str, np.ndarray] | None = None,
                expected: dict[str, np.ndarray] | None = None) -> CheckResult:
    """Compile, run the Program in the functional simulator on seeded inputs, compare with the reference interpreter.
    `batch` as in compile_model (None: the model's own); the check runs at the batch compiled.

    `inputs` (input name -> array, checked by user_inputs.py before anything is compiled) replaces the seeded inputs;
    without `batch` the batch is theirs, with one it must be theirs. Then `expected` (output name -> array; some
    outputs may be left out) is one more oracle, and for an ONNX file onnxruntime on the same inputs is another
    (ort_oracle.py). `calibration` still only sets FP8 scales: the inputs checked are never calibrated on.

    `outputs` compares with the float32 graph, so fp16 and fp8 are judged against the model they approximate (their
    accuracy, a loose cosine). fp16 and fp8 are also compared with the precision-matched reference (`matched`: the
    graph as planned, with the Program's accumulation; sim/reference.py) within a tight tolerance, which is what sees
    a wrong address or a missing transfer; `passed` needs both. For fp8 the result also lists, per FP8 Linear, the
    error its own operand rounding adds (which layers lose most).
    """
    from tremula.sim.functional import simulate

    if isinstance(chip, str):
        from tremula.target.chip import load_chip

        chip = load_chip(chip)
    build = _builder(model, seq_len)
    user: dict[str, np.ndarray] | None = None
    if expected is not None and inputs is None:
        raise TremulaError("--expected needs --inputs: expected outputs are for the inputs you give")
    if inputs is not None:  # every check of the user's arrays before the compile, which can take minutes
        batch, graph, user, expected = _user_arrays(model, build, batch, inputs, expected)
    res = compile_model(model, chip, batch, dtype, seq_len, progress, calibration=calibration)
    if inputs is None:
        graph = res.source if res.source is not None else build(res.batch)  # type: ignore[misc]
    ref_graph = canonical(graph)
    feeds = user if user is not None else make_feeds(ref_graph, seed)
    t0 = time.perf_counter()
    got = simulate(res.program, res.graph, feeds, check=check, progress=progress)  # host streams cast the inputs
    sim_seconds = time.perf_counter() - t0
    ref = run(ref_graph, feeds)
    outs = [compare(o, got[o], ref[o], res.dtype) for o in ref_graph.outputs]
    # at fp32 the float32 reference is the matched one
    matched = check_matched(res, feeds, got) if res.dtype != "float32" and res.graph is not None else []
    layers = []
    if res.dtype == "fp8":
        from tremula.passes.precision import layer_losses

        layers = layer_losses(_qdq_graph(ref_graph, res.graph), feeds)  # type: ignore[arg-type]
    oracles = []
    if expected is not None:
        oracles.append(_against("expected", "your expected outputs", expected, got, res.dtype))
    if inputs is not None:
        from tremula.ort_oracle import is_onnx_file, run_ort

        if is_onnx_file(model):
            o = run_ort(model, feeds, res.batch)  # type: ignore[arg-type]
            oracles.append(_against("onnxruntime", o.note, o.outputs, got, res.dtype))
    return CheckResult(res, outs, layers, sim_seconds, matched, oracles, "user" if inputs is not None else "seeded")


def _user_arrays(model: ModelSpec, build, batch, inputs: dict[str, np.ndarray],
                 expected: dict[str, np.ndarray] | None):
    """(batch, graph at that batch, feeds, expected outputs) from the user's arrays, refused in one line unless they
    fit the model: the batch is the inputs' (or must be when --batch is given)."""
    from tremula.user_inputs import expected_outputs, input_batch, input_feeds

    if batch == "auto":
        raise TremulaError("--batch auto searches for a batch, but --inputs fixes it: drop --batch (the inputs' "
                           "number of samples is the batch)")
    own = model if isinstance(model, Graph) else build(None)
    n = input_batch(canonical(own), inputs)
    if batch is not None and int(batch) != n:
        raise TremulaError(f"the inputs hold {n} samples, but --batch is {batch}: give {batch} samples or drop --batch")
    if isinstance(model, Graph):
        if model_batch(model) not in (None, n):
            raise TremulaError(f"the inputs hold {n} samples; this graph was built for {model_batch(model)}")
        graph = model
    else:
        graph = own if model_batch(own) == n else build(n)
    ref = canonical(graph)
    feeds = input_feeds(ref, inputs)
    return n, graph, feeds, (expected_outputs(ref, expected) if expected is not None else None)


def _against(name: str, note: str, want: dict[str, np.ndarray] | None, got: dict[str, np.ndarray],
             dtype: str) -> OracleCheck:
    if want is None:
        return OracleCheck(name, note)
    outs = []
    for o in (o for o in got if o in want):
        w = np.asarray(want[o])
        if w.shape != got[o].shape:  # (expected outputs are checked before; another runtime may disagree)
            nan = float("nan")
            outs.append(OutputCheck(o, f"shape {list(w.shape)} vs {list(got[o].shape)}", nan, nan, False))
        else:
            outs.append(compare(o, got[o], w, dtype))
    return OracleCheck(name, note, outs, [o for o in got if o not in want])


def _qdq_graph(ref_graph: Graph, planned: Graph) -> Graph:
    """The float32 graph with the planned FP8 casts (scales read back from the planned Fp8Quantize nodes)."""
    from tremula.passes.precision import fp8_linear_casts, with_scales

    q = fp8_linear_casts(ref_graph)
    scales = {n.name.removesuffix(".quantize"): int(n.attrs["scale"]) for n in planned.nodes if n.op == "Fp8Quantize"}
    return with_scales(q, scales)

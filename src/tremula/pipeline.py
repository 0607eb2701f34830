"""The graph stages the driver chains: canonical form, the precision policy, and planning under memory budgets.

`plan_graph` turns a graph into a plan and its memory plan (no Program yet); compile_model (compiler.py), the batch
search (batch_search.py) and the FP8 calibration (fp8_calibration.py) all go through these functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tremula import limits
from tremula.errors import TremulaError
from tremula.ir.graph import Constant, DerivedInit, Graph, Node
from tremula.ir.array_memo import ArrayMemo
from tremula.ir.interp import infer_types
from tremula.ir.layers import find_layers, layer_roles, node_key
from tremula.plan.finalize import StreamConflict, memory_plan, to_program
from tremula.plan.layers import untie_layer_vectors
from tremula.plan.context import MATMULS, free_temp_fraction
from tremula.plan.lower_ops import CodeOverflow, Lowerer
from tremula.plan.plan import Plan, Recipe, recipe_of
from tremula.plan.price import host_bytes, node_cycles, state_cycles
from tremula.plan.stream import MIN_RUN, plan_streaming, streamable_runs, trailing_layers
from tremula.plan.strategies import BUFFER_FRACTION, TEMP_FRACTION
from tremula.program import host_stream_bytes, streamed_weight_bytes
from tremula.target.cost import host_transfer_cycles
from tremula.target.step_cost import step_cycles

Progress = Callable[[str, int, int], None]
DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16", "fp8": "fp8"}
# Planner budgets tried in turn until a plan fits: (operand block, permanent bytes of the matmuls), as fractions of a
# tile's SRAM (see plan/strategies.py), and whether identical layers share one copy of their code (plan/share.py).
# The first two leave permanent bytes unbudgeted (fastest plans), the very first with an operand budget from what the
# tiles have left (FREE); tighter budgets trade cycles for memory. Sharing streams
# every layer's weights to all its tiles, which cost SigLIP so400m 0.1 % of its cycles at batch 4, and holds one
# layer's vertex state and exchange code instead of one per layer (91 KB a tile less there). Shared layers are tried
# first with the FREE operand budget (spread weights leave each tile its share of the free bytes), then with the fixed
# one: the fixed one alone cut SigLIP so400m fp16's fc2 into 12 rounds at batch 2 (half the model on a chip: 20.0 M
# cycles, 12.1 M with FREE) and its fp8 plan at batch 8 took 58.2 M cycles (56.8 M). Without the permanent budget
# (no residual panels, rows over all tiles) the shared plan is faster at batch 8 (53.3 M) and slower at batch 1
# (10.3 M against 8.8 M): choosing between them needs both priced, which costs a lowering more. A graph without
# repeated layers (ir/layers.py) skips the shared budgets; a graph with them stops after them: once layers share,
# tighter permanent budgets change little, and a tighter operand budget at batch 16 took SigLIP so400m over 9 GB of
# host memory to plan. A shared plan that does not fit may stream the weights of its last layers from host memory
# (--weights, plan/stream.py) before a tighter budget is tried; when every weight on the chip cannot fit at all, only
# shared plans are tried.
FREE = None  # a budget's operand fraction derived from the tile's free bytes (see plan_graph)
PLAN_BUDGETS = ((FREE, None, False), (0.12, None, False), (0.12, 0.4, False), (FREE, 0.4, True), (0.12, 0.4, True),
                (0.12, 0.3, False), (0.12, 0.2, False), (0.04, 0.2, False))
# Lowerings a compile at a fixed batch spends growing the operand budget of a plan that fits into the bytes it left
# free (plan_graph's `grow`; a batch search's probes do not). FREE's share of a tile is a rule of thumb made before any
# plan exists; the plan that fits says what is left. BERT-base fp16 batch 128 left 20 KB of its fullest tile at the
# FREE budget (0.233, 5,447 samples/s modelled); 0.252 overflowed, 0.243 too, 0.238 fit with 4.5 KB to spare at 5,663.
GROW_STEPS = 3
# After that, each of the costliest roles (a layer's op, the same in every layer of its run) may take more than the
# plan-wide operand budget where its own steps leave bytes free (_grown_ops): these multiples of it, the larger first,
# on the GROW_OP_ROLES matmuls and attentions that take the most cycles. The peak does not grow monotonically with a
# budget (blocks and rounds change in steps): BERT-base fp16 b128's fc1 overflowed at 1.4x and 2x and fit at 1.5x
# (32.14 M -> 31.32 M cycles); SigLIP so400m fp8 b8's attention fit at 2x (41.51 M -> 40.45 M), then its fc1
# (-> 38.67 M), while fc2, whose steps hold the peak, overflowed at both. Each try is a lowering (1-2 s on these).
GROW_OP_SCALES = (2.0, 1.5)
GROW_OP_ROLES = 3


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
            else:
                g.constants[name] = Constant(name, t, data=_saturated(c.data, dtype))
            g.types[name] = t
    for name in g.inputs:
        t = g.types[name]
        if t.dtype == "float32":
            g.types[name] = type(t)(t.shape, dtype)
    g.nodes = [Node(n.op, n.inputs, n.outputs, {**n.attrs, "to": dtype} if n.op == "Cast" and n.attrs.get("to") ==
                    "float32" else n.attrs, n.name) for n in g.nodes]
    return infer_types(g)


_SATURATED = ArrayMemo(weak_values=True)  # a read-only array's cast (_saturated)


def _saturated(a: np.ndarray, dtype: str) -> np.ndarray:
    """a in `dtype`, saturated like the hardware's float->half conversion (a -3.4e38 mask fill becomes -65504, not
    -inf). The cast of a read-only array is read-only too, and kept while both live (ArrayMemo): a compile plans a
    model file's graph more than once (with all-zero FP8 scales, then the calibrated ones), and each cast SigLIP
    so400m's 1.7 GB of weights anew (1.2 s)."""

    def cast(a: np.ndarray) -> np.ndarray:
        fmax = float(np.finfo(dtype).max)
        out = np.asarray(np.clip(a, -fmax, fmax).astype(dtype))  # (of a 0-d array, clip gives a scalar)
        out.flags.writeable = a.flags.writeable  # (a read-only array's is shared by the graphs cast from it)
        return out

    return _SATURATED.get(a, cast, dtype)


def _to_dtype(dtype: str) -> Callable[[np.ndarray], np.ndarray]:
    return lambda v: v.astype(dtype)  # as LazyInit.make rounds its float32 draws: the same values


def resolve_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise TremulaError(f"unsupported --dtype {dtype!r}: use fp32, fp16 or fp8")
    return DTYPES[dtype]


def lower_precision(graph: Graph, dtype: str, chip=None, scales: dict[str, int] | None = None,
                    partials: str = "float") -> Graph:
    """The canonical graph in `dtype`. fp8 is the mixed policy (passes/precision.py): FP8 operands for every Linear
    with calibrated activation scales, stored as codes for the AMP's quarter path; FP16 everywhere else. partials
    "half" (fp16 and fp8 only; needs the chip) marks the matmuls to accumulate in half partials
    (passes/precision.with_partials); float32 graphs always accumulate in float32."""
    from tremula.passes.int32 import narrow_int64
    from tremula.passes.precision import PARTIALS, with_partials

    if partials not in PARTIALS:
        raise TremulaError(f"unsupported --partials {partials!r}: use half or float")
    g = narrow_int64(canonical(graph))  # the chip has no 64-bit integers (passes/int32.py)
    if dtype == "fp8":
        from tremula.passes.precision import fp8_linear_casts, fp8_storage, with_scales

        g = cast_graph(with_scales(fp8_linear_casts(g), scales or {}), "float16")
        g = fp8_storage(g, chip.amp_pair("fp8", "fp16").weights_per_conv_unit)
    else:
        g = cast_graph(g, dtype)
    if partials == "half" and dtype in ("float16", "fp8"):
        g = with_partials(g, "half", chip.amp_pair("fp16", "fp16").weights_per_conv_unit)
    return g


def priced_program(plan: Plan, chip, dt: str, batch: int, progress: Progress | None = None):
    """(Program, compute, exchange, sync cycles of one forward) of a plan: the Program the plan lowers to, each step
    priced by target.step_cost (the same price the profile charges)."""
    g = plan.graph
    io = {n: (g.types[n].shape, g.types[n].dtype) for n in list(g.inputs) + list(g.outputs)}
    program = to_program(plan.state, chip, plan.memory, plan.liveness, plan.reserved, dt, batch, io)
    comp = exch = sync = 0
    for i, s in enumerate(program.steps):
        if progress:
            progress("estimate", i, len(program.steps))
        c, e, y = step_cycles(chip, s)
        comp, exch, sync = comp + c, exch + e, sync + y
    return program, comp, exch, sync


def host_cycles(program, chip) -> tuple[int, int, int, int]:
    """(bytes in, bytes out, cycles in, cycles out) of a Program's host streams over the chip's host link. Bytes in
    are the inputs and the weights streamed from host memory (plan/stream.py), which cross the link in the same
    direction on every run."""
    b_in = host_stream_bytes(program.host_in) + streamed_weight_bytes(program.consts)
    b_out = host_stream_bytes(program.host_out)
    return b_in, b_out, host_transfer_cycles(chip, b_in), host_transfer_cycles(chip, b_out)


def plan_rate(plan: Plan, chip, dt: str, batch: int) -> float:
    """Modelled samples/s of a plan: batch / (host in + forward + host out), as CompileResult.throughput_cycles
    charges it (host transfers in series with the forward). Priced from its lowering state (plan/price.py: the
    numbers its Program is priced at), or from its Program when its weights stream (their bytes are counted from
    the Program's constants)."""
    cycles = state_cycles(plan.state, chip)
    if cycles is None:
        program, *cycles = priced_program(plan, chip, dt, batch)
        _, _, c_in, c_out = host_cycles(program, chip)
    else:
        c_in, c_out = (host_transfer_cycles(chip, b) for b in host_bytes(plan.state))
    return batch * chip.clock_hz / (c_in + sum(cycles) + c_out)


def check_fp8(chip, dtype: str) -> None:
    if dtype == "fp8" and not chip.supports("fp8"):
        raise TremulaError(f"chip {chip.name} has no FP8 matmul unit (FP8 needs an ipu21 such as c600); "
                           "use --dtype fp16")


@dataclass
class Growth:
    """Where _grown stopped, kept on the state of the plan it returns, so that a plan a batch search grew a step can be
    grown on by the compile as if in one go (grown_on). `steps`: the lowerings spent (the loop's turns); `done`: the
    plan-wide growth ended (the same plan again, or no room), with `unchanged_at` as _grown returns it."""

    lo: float  # the largest operand budget that fitted
    failed: float  # the smallest that did not
    last: tuple[int, int]  # cycles and peak of the last plan that fitted
    hi: float  # the next budget to try
    steps: int = 0
    done: bool = False
    unchanged_at: float = 0.0


def _grown(lower: Callable[..., Any], chip, plan: Plan, budget: tuple, steps: int,
           resume: Growth | None = None) -> tuple[Plan, float]:
    """The fastest of `plan` (it fits, at operand budget `budget`; `lower` is
    plan_graph's: a budget and levelling -> a lowered state) and the plans that fit at larger operand budgets, `steps`
    lowerings at most: each tries the budget that gives the bytes the last plan that fitted left free to the
    temporaries (whose budget is BUFFER_FRACTION / TEMP_FRACTION times the operand budget), halving the step towards
    the last that fitted when one does not; a plan the same as the last that fitted (cycles and peak) ends the
    growth. Two plans are alive at once. Returns the plan kept and the budget at which the plan stayed the same (0.0
    when it did not), when that plan is the one kept: every op had that budget there and none changed. The plan kept
    gets where the growth stopped (Growth, as `.growth`); `resume`, such a record of `plan`, carries it on."""
    frac, perm, share, thrift = budget
    best = (sum(state_cycles(plan.state, chip)), plan)

    def step(mp) -> float:  # the next budget to try after a plan that fits
        up = at.lo + (1.0 - plan_fullness(mp, chip)) * TEMP_FRACTION / BUFFER_FRACTION
        return up if up < at.failed else (at.lo + at.failed) / 2

    if resume is None:  # (lo: the largest budget that fitted; failed: the smallest that did not)
        at = Growth(frac, float("inf"), (best[0], plan.memory.peak_bytes), 0.0)
        at.hi = step(plan.memory)
    else:
        at = Growth(**vars(resume))
    for _ in range(steps):
        if at.done or at.hi - at.lo < 1e-3:
            at.done = True
            break
        at.steps += 1
        state = lower((at.hi, perm, share, thrift), plan.state.level_weights)
        mp, live, reserved = memory_plan(state, chip, both_orders=True)  # packed tighter where it can be
        if mp.fits:
            cycles = sum(state_cycles(state, chip))
            if (cycles, mp.peak_bytes) == at.last:
                # the same plan: the operand budget is not what limits it (ViT-B fp16 batch 8, BERT-base b16)
                at.done, at.unchanged_at = True, (at.hi if cycles == best[0] else 0.0)
                break
            if cycles < best[0]:
                best = (cycles, Plan(plan.graph, state, mp, live, reserved))
            at.lo, at.last = at.hi, (cycles, mp.peak_bytes)
        else:
            at.failed = at.hi
        state = live = None
        at.hi = step(mp) if mp.fits else (at.lo + at.failed) / 2
    best[1].state.growth = at
    return best[1], at.unchanged_at


def _growth(lower: Callable[..., Any], chip, layers: dict, plan: Plan, budget: tuple, steps: int, ops: bool,
            resume: Growth | None = None) -> Plan:
    """_grown's `steps` (carrying on `resume`), then, with `ops`, the costliest roles' own budgets (_grown_ops)."""
    plan, unchanged_at = _grown(lower, chip, plan, budget, steps, resume)
    if ops:
        kept = (plan.state.plan_fraction, *budget[1:]), plan.state.level_weights  # the budget the growth kept
        growth = plan.state.growth
        plan = _grown_ops(lambda sc: lower(*kept, sc), chip, plan, _budget_roles(plan.graph, layers, plan.state, chip),
                          GROW_OP_ROLES * len(GROW_OP_SCALES), unchanged_at)
        plan.state.growth = growth
    return plan


def grown_on(plan: Plan, chip, progress: Progress | None = None) -> Plan:
    """A plan (plan_graph's) grown as plan_graph(grow=GROW_STEPS) grows one: a batch search
    grows its probes a step (grow=1, grow_ops=False, maybe not at all: grow_when), and the compile carries the plan it
    chose on from there (Growth), instead of planning it again. A plan plan_graph would not grow (not at the free
    budget, or its weights stream) is returned as it is."""
    g, state = plan.graph, plan.state
    growth: Growth | None = getattr(state, "growth", None)
    if growth is None:
        return plan
    layers = find_layers(g)

    def lower(budget: tuple, level: bool, op_scale: dict[str, float] | None = None):
        return _lowered(g, chip, progress, layers, budget, level, op_scale)

    budget = (growth.lo, state.perm_fraction, state.share_layers, state.thrift)
    fresh = growth.steps == 0 and not growth.done
    return _growth(lower, chip, layers, plan, budget, GROW_STEPS - growth.steps, True, None if fresh else growth)


def _grown_ops(lower: Callable[..., Any], chip, plan: Plan, roles: list[str], steps: int,
               unchanged_at: float = 0.0) -> Plan:
    """The fastest of `plan` (it fits; `lower`: an operand-budget scale per role -> a lowered state) and the plans
    where one role after another (in the order given) takes a larger operand budget than the plan-wide one
    (GROW_OP_SCALES, the first that fits; a scale kept when its plan fits and is faster), `steps` lowerings at most.
    Every try lowers the whole graph again (the roles kept so far included) and is checked by its own memory plan.
    A scale whose budget is at most `unchanged_at` is not tried: the plan-wide growth gave every op that budget and
    the plan stayed the same (_grown; ViT-B fp16 b8 and BERT-base b16 try none)."""
    best = (sum(state_cycles(plan.state, chip)), plan)
    scale: dict[str, float] = {}
    tries = iter(range(steps))
    for role in roles:
        for s in GROW_OP_SCALES:
            if s * plan.state.plan_fraction <= unchanged_at:
                continue
            if next(tries, None) is None:
                return best[1]
            state = lower({**scale, role: s})
            mp, live, reserved = memory_plan(state, chip, both_orders=True)
            if not mp.fits:
                state = live = None
                continue
            cycles = sum(state_cycles(state, chip))
            if cycles < best[0]:
                best, scale = (cycles, Plan(plan.graph, state, mp, live, reserved)), {**scale, role: s}
            state = live = None
            break  # the largest scale that fits ends the role's tries
    return best[1]


def _budget_roles(g: Graph, layers: dict, state, chip) -> list[str]:
    """The roles (ir/layers.layer_roles) of the ops that take an operand budget (matmuls, attention), the
    GROW_OP_ROLES whose steps take the most cycles in `state` first."""
    role = layer_roles(g, layers)
    cycles: dict[str, int] = {}
    for key, c in node_cycles(state, chip).items():
        r = role.get(key, key)
        cycles[r] = cycles.get(r, 0) + c
    keys = (node_key(n) for n in g.nodes if n.op in MATMULS or n.op == "Attention")
    ops = dict.fromkeys(role.get(k, k) for k in keys)
    return sorted(ops, key=lambda r: -cycles.get(r, 0))[:GROW_OP_ROLES]  # (ties in node order)


def _streamed_plan(state, chip, mp, everything: bool):
    """(memory plan, liveness, reserved) of the lowered `state` with the fewest trailing layers of each run
    streamed from host memory that make it fit (plan/stream.py), or with all of them when `everything`. When
    streaming them all does not make it fit either, that plan if its peak is lower than `mp`'s (what the "does not
    fit" error then reports); None when the layers cannot be streamed or that helps nothing (the state is left as
    it was).

    Every streamed byte crosses the host link on every forward, in series with the compute, so the fewest layers
    that fit is also the fastest choice of k for this plan: fewer bytes, same steps."""
    runs = streamable_runs(state)
    if not runs or getattr(state, "sharing", None) is None:
        return None
    saved = state.sharing, getattr(state, "streaming", None)
    longest = max(len(js) for js in runs.values())
    # one layer's weights on the fullest tile (spread storage puts about as much on every tile)
    run, js = next(iter(runs.items()))
    per_tile = np.zeros(state.T, np.int64)
    for b, key in state.weight_layer.items():
        if key == (run, js[0]):
            np.add.at(per_tile, state.bufs[b].tiles, state.bufs[b].sizes)
    layer = max(1, int(per_tile[mp.fullest_tile]) or int(per_tile.mean()))

    def layers_over(m) -> int:  # how many layers' weights the plan's peak is over the tile
        return -(-(m.peak_bytes - chip.sram_bytes_per_tile) // layer)

    k = longest if everything else min(longest, max(MIN_RUN, 2 + layers_over(mp)))
    made = None  # (memory plan, liveness, reserved)
    while True:
        streaming = plan_streaming(state, trailing_layers(state, k))
        if isinstance(streaming, str):
            break
        try:
            made = memory_plan(state, chip, streaming)
        except StreamConflict:
            made = None
            break
        if made[0].fits or everything or k == longest:
            break
        k = min(longest, k + max(1, layers_over(made[0])))
    if made is not None and (made[0].fits or everything):
        return made
    if made is not None and made[0].peak_bytes < mp.peak_bytes:
        return made  # the least it can do: streaming every layer (state.streaming says so)
    state.sharing, state.streaming = saved
    return None


def relowered(graph: Graph, chip, dtype: str, state, scales: dict[str, int] | None, partials: str = "float",
              progress: Progress | None = None) -> Plan | None:
    """plan_graph's result for the plan `state` (a lowering of `graph` made with other FP8 scales) lowered again with
    `scales`: the same operand budget, permanent budget, shared layers, K rounds, levelled storage and op budgets,
    its memory plan made the same way. Scales change no choice the lowering makes, only the values of the vertex
    fields that hold them and, in shared layers, which of those fields a call patches (vertex state and call cycles:
    the memory plan says whether it still fits). None for a plan that streams weights (how many layers stream was
    chosen by its bytes)."""
    recipe = recipe_of(state)
    return None if recipe is None else from_recipe(graph, chip, dtype, recipe, scales, partials, progress)


def from_recipe(graph: Graph, chip, dtype: str, recipe: Recipe, scales: dict[str, int] | None = None,
                partials: str = "float", progress: Progress | None = None) -> Plan:
    """The plan of `graph` lowered from `recipe` (plan/plan.recipe_of), its memory plan made the same way: the plan
    the recipe was taken from when `scales` and `partials` are those it was planned with."""
    g = _planned_graph(graph, dtype, chip, scales, partials)
    state = _lowered(g, chip, progress, find_layers(g), recipe.budget, recipe.level_weights,
                     dict(recipe.op_scale) or None)
    return Plan(g, state, *memory_plan(state, chip, both_orders=recipe.both_orders))


def _planned_graph(graph: Graph, dtype: str, chip, scales: dict[str, int] | None, partials: str) -> Graph:
    """The graph plan_graph lowers: in the plan's precision, each layer's vectors its own (plan/layers.py)."""
    return untie_layer_vectors(lower_precision(graph, dtype, chip, scales, partials))


def _lowered(g: Graph, chip, progress: Progress | None, layers: dict, budget: tuple, level: bool,
             op_scale: dict[str, float] | None = None, code_limit: int | None = None):
    """One lowering of the planned graph `g`: budget = (operand fraction, permanent fraction, share, thrift).
    code_limit: stop with CodeOverflow once exchange code overflows that many bytes on a tile (Lowerer)."""
    frac, perm, share, thrift = budget
    return Lowerer(g, chip, progress, temp_fraction=frac, perm_fraction=perm, share_layers=share, layers=layers,
                   thrift=thrift, level_weights=level, op_scale=op_scale, code_limit=code_limit).lower()


WEIGHTS = ("auto", "resident", "streamed")


def plan_fullness(mp, chip) -> float:
    """How full a memory plan is: its fullest tile over the tile's SRAM, or its code over the code region where the
    chip has one and that is more; a plan fits when this is at most 1."""
    full = mp.peak_bytes / chip.sram_bytes_per_tile
    if mp.code_region_used is not None and mp.code_region_bytes:
        full = max(full, float(mp.code_region_used.max()) / mp.code_region_bytes)
    return full


def plan_graph(graph: Graph, chip, dtype: str, progress: Progress | None = None,
               scales: dict[str, int] | None = None, shared_only: bool = False, partials: str = "float",
               weights: str = "auto", lowest_peak: bool = True, fullness: list[float] | None = None,
               from_budget: int = 0, budget: list[int] | None = None, grow: int = 0,
               grow_ops: bool = True, grow_when: Callable[[Any, Any], bool] | None = None,
               level_from: bool = False, grow_beside: Callable[[Callable[[], Plan]], None] | None = None) -> Plan:
    """The Plan of `graph` (plan/plan.py: the graph as planned, its lowering and memory plan; no Program yet).
    shared_only: skip the budgets without shared layers (the caller knows they do not fit). lowest_peak: when no
    plan fits, return the one with the lowest peak (lowered again if it was not the last tried) rather than the last
    one, whose memory plan still says it does not fit (a batch search needs no more); `fullness`, when given, gets
    how full each plan tried is (plan_fullness). from_budget: the first budget to try (an index into this model's
    budgets, which `budget`, when given, gets for the plan returned, then 1 when its shared layers' storage is
    levelled, else 0: a batch search starts a larger batch at the budget that fitted a smaller one, levelled when
    that one was: `level_from`). weights: "resident"
    keeps every weight on the chip; "auto" streams the fewest layers' weights from host memory that make a
    shared-layer plan fit when it does not (before a tighter budget is tried); "streamed" streams every layer of
    each run of identical layers (plan/stream.py). grow: lowerings to spend growing the operand budget of a plan
    that fits at the FREE budget into the bytes it leaves free (_grown), then (with grow) the costliest ops' own
    budgets (_grown_ops; not without grow_ops); the fastest plan that fits is kept. grow_when: (lowering state,
    memory plan) of the plan that fits -> whether to grow it. grow_beside: the growth is handed to it (a function
    that grows the plan and returns the plan grown) instead of made here, and the plan is returned as it is."""
    if weights not in WEIGHTS:
        raise TremulaError(f"unsupported --weights {weights!r}: use {', '.join(WEIGHTS)}")
    shared_only = shared_only or weights == "streamed"
    # Tighter budgets mean more rounds or fewer tiles per matmul: the first plan that fits is kept, else the one with
    # the lowest peak. Only one lowering is alive at a time (a base model's is gigabytes at large batches): when the
    # lowest peak was not the last one tried, it is lowered again.
    best: tuple | None = None  # (peak bytes, budget index)
    futile: dict[bool, float] = {}  # share mode -> the budget below which its tighter budgets cannot help
    g = _planned_graph(graph, dtype, chip, scales, partials)
    layers = find_layers(g)

    def lower(budget: tuple, level: bool, op_scale: dict[str, float] | None = None, code_limit: int | None = None):
        return _lowered(g, chip, progress, layers, budget, level, op_scale, code_limit=code_limit)

    layered = len(set(layers.values())) > 1  # identical layers to share, maybe
    if layered:
        if weights != "resident" and limits.needs(g, dtype).total > limits.chip_capacity(chip):
            shared_only = True  # every weight on the chip cannot fit: only shared plans, which can stream, may
    tried_shared = False
    # An unshared plan of a graph with shared layers to fall back on stops lowering once its exchange code overflows
    # the code region (a plan cannot fit then, and every layer lowered apart adds its own): shared plans are tried
    # instead, as when an unshared plan's fixed bytes overflow (below). Whether or not weights may stream: shared
    # plans keep every weight on the chip too (BERT-base fp16 at batch 64, a --batch auto probe, whose weights stay
    # resident: its unshared plan stops after 181 of 241 nodes, 1.9 s, where it was lowered whole and planned, 2.7 s).
    code_limit = getattr(chip, "non_interleaved_bytes_per_tile", None) if layered else None
    overflowed = -1  # the budget whose lowering stopped so
    # FREE: the operand budget of what the tiles have left (lower_ops.free_temp_fraction); a budget equal to the one
    # before it is not tried twice
    free = free_temp_fraction(g, chip) if any(b[0] is FREE for b in PLAN_BUDGETS) else 0.0
    # Thrift (lower_ops.Lowerer): the first budget of each share mode takes the choices that buy cycles with bytes
    # (K rounds, a fused projection's parts on one gathered operand) as the cost model likes them; when that plan
    # does not fit, the same budget again and every later one take them lean: only the K rounds that need no more
    # bytes than the plan without them, and one gathered operand only when the parts' weight blocks fit the weight-block
    # budget together (the retry made only when they could save the overflow).
    budgets: list[tuple[float, float | None, bool, str]] = []
    for frac, perm, share in PLAN_BUDGETS:
        b = (free if frac is FREE else frac, perm, share)
        first = not any(x[2] == share for x in budgets)
        if first or b != budgets[-1][:3]:
            budgets += [(*b, "free"), (*b, "lean")] if first else [(*b, "lean")]
    last = -1  # the budget of the plan in hand
    level = level_from  # shared layers' storage levelled (below)
    retry_lean = False  # the plan in hand took free choices, does not fit, and lean ones might
    for i, (frac, perm, share, thrift) in enumerate(budgets):
        if i < from_budget or frac < futile.get(share, 0.0) or (share and not layered) or (layered and not share and
                                                                         (shared_only or tried_shared)):
            continue
        if thrift == "lean" and last == i - 1 and budgets[last][:3] == (frac, perm, share) and not retry_lean:
            continue
        tried_shared = tried_shared or share
        plan = state = live = None  # drop the previous lowering before making the next
        try:
            state = lower(budgets[i], level, code_limit=None if share else code_limit)
        except CodeOverflow:  # its code alone overflows: as when its fixed bytes do (below), only shared plans (how
            overflowed = i  # full it is stays unknown: `fullness` gets nothing for it)
            shared_only = True
            continue
        last = i
        mp, live, reserved = memory_plan(state, chip)
        # Shared layers' storage levelled (plan/layers.spread_caps) when the fullest tile overflows by less than its
        # weights exceed the mean tile's, and kept levelled for the budgets after it when that lowers the peak
        if share and not level and not mp.fits and \
                0 < mp.peak_bytes - chip.sram_bytes_per_tile <= mp.by_category.get("weights", 0) - state.placed.mean():
            even = (state, mp, live, reserved)
            state = lower(budgets[i], True)
            mp, live, reserved = memory_plan(state, chip)
            level = mp.peak_bytes < even[1].peak_bytes
            if not level:
                state, mp, live, reserved = even
            even = None
        # Retried lean (before any weights are streamed) unless the lean plan would be this one, or cannot fit either:
        # lean choices change only one op's buffers at a time, no help when the overflow is more than the most they
        # save (SigLIP so400m fp8 at batch 16: 70 KB over, 16 KB saved at most).
        retry_lean = thrift == "free" and not mp.fits and \
            0 < mp.peak_bytes - chip.sram_bytes_per_tile <= getattr(state, "lean_saves", 0)
        if share and weights != "resident" and (weights == "streamed" or not (mp.fits or retry_lean)):
            mp, live, reserved = _streamed_plan(state, chip, mp, weights == "streamed") or (mp, live, reserved)
        plan = Plan(g, state, mp, live, reserved)
        if fullness is not None:
            fullness.append(plan_fullness(mp, chip))
        if best is None or mp.peak_bytes < best[0]:
            best = (mp.peak_bytes, i, getattr(state, "streaming", None), state.level_weights)
        # Budgets shrink only buffers, vertex state and exchange code: when the rest alone overflows, stop. A tighter
        # temporary budget shrinks buffers by cutting ops into more rounds, each with its own vertex state and exchange
        # code: it cannot help when the buffers are less than the overflow, nor when those per-round bytes already
        # outweigh the buffers (SigLIP so400m at batch 6 and 8: such plans took over 18 GB to lower and were larger).
        # (The rest is the categories' bytes: the free bytes below the peak, e.g. matmul operands kept in separate
        # memory elements, move with the buffers.)
        cat = mp.by_category
        fixed = sum(v for c, v in cat.items() if c not in ("buffers", "vertex_state", "exchange_code"))
        if mp.fits:
            break
        if fixed > chip.sram_bytes_per_tile:
            if share or not layered or weights == "resident":
                break
            shared_only = True  # resident weights overflow: only shared plans, whose weights can stream, may fit
            continue
        if cat.get("buffers", 0) < max(mp.peak_bytes - chip.sram_bytes_per_tile,
                                       cat.get("vertex_state", 0) + cat.get("exchange_code", 0)):
            futile[share] = frac  # judged on the last plan of this mode before a tighter one
        else:
            futile.pop(share, None)
    if best is None:  # every budget tried stopped early: one of them lowered whole, for what the error reports
        state = lower(budgets[overflowed], level)
        plan, last = Plan(g, state, *memory_plan(state, chip)), overflowed
        best = (plan.memory.peak_bytes, last, None, state.level_weights)
        if fullness is not None:
            fullness.append(plan_fullness(plan.memory, chip))
    # (plan None: the last lowering tried stopped early. A plan that fits is kept although an earlier one may have a
    # lower peak: one whose instructions overflowed the code region)
    if plan is None or (not plan.fits and best[1] != last and lowest_peak):
        plan = state = live = None
        state = lower(budgets[best[1]], best[3])
        plan = Plan(g, state, *memory_plan(state, chip, best[2]))  # the same lowering: the same streaming applies
        last = best[1]
    if grow and plan.fits and budgets[last][0] == free and getattr(state, "streaming", None) is None:
        if grow_when is None or grow_when(plan.state, plan.memory):
            if grow_beside is not None:
                grow_beside(lambda start=plan, b=budgets[last]: _growth(lower, chip, layers, start, b, grow, grow_ops))
            else:
                state = live = None
                plan = _growth(lower, chip, layers, plan, budgets[last], grow, grow_ops)
                state = plan.state
        else:  # not grown (no step taken, not done): grown_on grows it from the start
            state.growth = Growth(free, float("inf"), (0, 0), 0.0)
    if budget is not None:
        budget += [last, int(plan.state.level_weights)]
    if weights == "streamed" and getattr(state, "streaming", None) is None:
        raise TremulaError(f"--weights streamed: {graph.name} has no run of {MIN_RUN} or more identical layers whose "
                           "weights can be streamed; use --weights auto or resident")
    return plan

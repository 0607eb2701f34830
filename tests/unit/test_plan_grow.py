"""pipeline._grown: a plan that fits has its operand budget grown into the bytes it left free, on a synthetic planner
whose peak and cycles are functions of the budget."""

from dataclasses import dataclass

import pytest

from tremula import pipeline
from tremula.plan.plan import Plan


@dataclass
class _MP:
    peak_bytes: int
    fits: bool
    code_region_used: None = None
    code_region_bytes: None = None


@dataclass
class _Chip:
    sram_bytes_per_tile: int = 1000


def _planner(monkeypatch, peak, cycles):
    tried: list[float] = []

    class Lowerer:
        def __init__(self, g, chip, progress, temp_fraction, level_weights=False, **kw):
            self.tf, self.level_weights = temp_fraction, level_weights

        def lower(self):
            tried.append(self.tf)
            return self

    def memory_plan(state, chip, streaming=None, both_orders=False):
        p = int(peak(state.tf))
        return _MP(p, p <= chip.sram_bytes_per_tile), None, None

    monkeypatch.setattr(pipeline, "memory_plan", memory_plan)
    monkeypatch.setattr(pipeline, "state_cycles", lambda state, chip: (int(cycles(state.tf)), 0, 0))
    return tried, Lowerer, memory_plan


def _grow(monkeypatch, peak, cycles, tf0, steps=3):
    tried, Lowerer, memory_plan = _planner(monkeypatch, peak, cycles)
    first = Lowerer(None, None, None, temp_fraction=tf0)
    plan = Plan(None, first, *memory_plan(first, _Chip()))

    def lower(budget, level):  # (plan_graph's)
        return Lowerer(None, None, None, temp_fraction=budget[0], level_weights=level).lower()

    plan, unchanged_at = pipeline._grown(lower, _Chip(), plan, (tf0, None, True, "free"), steps)
    return tried, plan.state.tf, plan.memory, unchanged_at


def test_growth_gives_the_free_bytes_to_the_temporaries_and_keeps_the_fastest(monkeypatch):
    # fits up to 0.5; each step gives 0.6 of the free fraction (TEMP_FRACTION / BUFFER_FRACTION) to the budget
    tried, tf, mp, unchanged_at = _grow(monkeypatch, lambda t: 500 + 1000 * t, lambda t: 1000 - 100 * int(t * 10), 0.2)
    assert tried == pytest.approx([0.38, 0.452, 0.4808])
    assert tf == pytest.approx(0.452) and mp.fits  # 0.4808 is no faster: the first of the fastest is kept
    assert unchanged_at == 0.0  # (each plan differed in its peak)


def test_a_budget_that_overflows_halves_the_step_and_is_never_passed(monkeypatch):
    # fits up to 0.25: 0.28 does not, 0.19 (halfway back) does with 0.12 free, 0.262 does not, 0.226 does
    tried, tf, mp, _ = _grow(monkeypatch, lambda t: 500 + 2000 * t, lambda t: 1000 - 1000 * t, 0.1, steps=4)
    assert tried == pytest.approx([0.28, 0.19, 0.262, 0.226])
    assert tf == pytest.approx(0.226) and mp.fits and mp.peak_bytes == 952


def test_growth_stops_at_the_first_plan_the_budget_does_not_change(monkeypatch):
    tried, tf, _, unchanged_at = _grow(monkeypatch, lambda t: 600, lambda t: 1000, 0.2)
    assert tried == pytest.approx([0.44]) and tf == pytest.approx(0.2)
    assert unchanged_at == pytest.approx(0.44)  # every op had 0.44 there: op growth needs no scale up to 2.2


def test_growth_carried_on_from_its_record_tries_what_one_growth_tries(monkeypatch):
    """A growth of one step, then the rest from the Growth record the plan kept (pipeline.grown_on's way: a batch
    search grows a step, the compile carries on), tries the budgets one growth of all the steps tries."""
    tried, Lowerer, memory_plan = _planner(monkeypatch, lambda t: 500 + 2000 * t, lambda t: 1000 - 1000 * t)
    first = Lowerer(None, None, None, temp_fraction=0.1)

    def lower(budget, level):
        return Lowerer(None, None, None, temp_fraction=budget[0], level_weights=level).lower()

    budget = (0.1, None, True, "free")
    plan, _ = pipeline._grown(lower, _Chip(), Plan(None, first, *memory_plan(first, _Chip())), budget, 1)
    assert plan.state.growth.steps == 1 and not plan.state.growth.done
    plan, _ = pipeline._grown(lower, _Chip(), plan, budget, 3, plan.state.growth)
    assert tried == pytest.approx([0.28, 0.19, 0.262, 0.226]) and plan.state.tf == pytest.approx(0.226)


def test_a_plan_grown_a_step_then_grown_on_is_the_plan_grown_in_one_go(tmp_path):
    """On a real lowering whose growth changes the plan (siglip-tiny fp16 b8 on a 16-tile chip of 48 KiB tiles):
    plan_graph(grow=1, grow_ops=False), as a batch search's probe, then grown_on, as --batch auto's compile, gives the
    plan plan_graph(grow=GROW_STEPS) gives, as a compile of that batch alone."""
    from pathlib import Path

    from tremula.frontends import load_model
    from tremula.plan.price import state_cycles
    from tremula.target.chip import load_chip

    text = (Path(__file__).resolve().parents[2] / "examples" / "chips" / "tiny16.toml").read_text()
    path = tmp_path / "tiny16-48k.toml"
    path.write_text(text.replace("sram_bytes_per_tile = 65536", "sram_bytes_per_tile = 49152"))
    chip = load_chip(str(path))
    graph = load_model("siglip-tiny", 8)
    ungrown = pipeline.plan_graph(graph, chip, "float16", partials="half")
    probe = pipeline.plan_graph(graph, chip, "float16", partials="half", grow=1, grow_ops=False)
    probe_steps = probe.state.growth.steps
    on = pipeline.grown_on(probe, chip)
    alone = pipeline.plan_graph(graph, chip, "float16", partials="half", grow=pipeline.GROW_STEPS)

    def seen(plan):
        state = plan.state
        return sum(state_cycles(state, chip)), plan.memory.peak_bytes, dict(state.strategies), state.plan_fraction

    assert seen(on) == seen(alone) != seen(ungrown)
    # the same growth, carried on from the probe's step (its second lowering found the same plan again)
    assert probe_steps == 1 and on.state.growth == alone.state.growth and alone.state.growth.steps == 2


# ---- pipeline._grown_ops: each role's own operand budget, on the same synthetic planner ---------------------------


def _grow_ops(monkeypatch, peak, cycles, roles, steps=10, unchanged_at=0.0):
    """peak, cycles: functions of the op_scale dict the planner lowers with."""
    tried: list[dict] = []

    class State:
        plan_fraction = 0.2

        def __init__(self, scale):
            self.scale = scale

    def memory_plan(state, chip, streaming=None, both_orders=False):
        p = int(peak(state.scale))
        return _MP(p, p <= chip.sram_bytes_per_tile), None, None

    def lower(scale):
        tried.append(dict(scale))
        return State(dict(scale))

    monkeypatch.setattr(pipeline, "memory_plan", memory_plan)
    monkeypatch.setattr(pipeline, "state_cycles", lambda state, chip: (int(cycles(state.scale)), 0, 0))
    first = State({})
    plan = pipeline._grown_ops(lower, _Chip(), Plan(None, first, *memory_plan(first, _Chip())), roles, steps,
                               unchanged_at)
    return tried, plan.state.scale, plan.memory


def test_each_role_takes_the_largest_budget_that_fits_when_it_is_faster(monkeypatch):
    monkeypatch.setattr(pipeline, "GROW_OP_SCALES", (2.0, 1.4))
    # a: 2x overflows, 1.4x fits and is faster; b: 2x fits but is no faster (not kept); c: 2x fits and is faster,
    # on top of a's 1.4 (the peak adds up: a's extra bytes stay when c is tried)
    extra = {"a": 700, "b": 0, "c": 100}
    peak = lambda sc: 500 + sum(extra[r] * (s - 1) for r, s in sc.items())
    gain = {"a": 300, "b": 0, "c": 200}
    cycles = lambda sc: 2000 - sum(gain[r] * (s - 1) for r, s in sc.items())
    tried, scale, mp = _grow_ops(monkeypatch, peak, cycles, ["a", "b", "c"])
    assert tried == [{"a": 2.0}, {"a": 1.4}, {"a": 1.4, "b": 2.0}, {"a": 1.4, "c": 2.0}]
    assert scale == {"a": 1.4, "c": 2.0} and mp.fits and mp.peak_bytes == 880


def test_op_growth_keeps_the_plan_when_nothing_fits_and_counts_its_lowerings(monkeypatch):
    monkeypatch.setattr(pipeline, "GROW_OP_SCALES", (2.0, 1.4))
    tried, scale, mp = _grow_ops(monkeypatch, lambda sc: 900 + 1000 * len(sc), lambda sc: 1000 - len(sc),
                                 ["a", "b", "c"], steps=3)
    assert tried == [{"a": 2.0}, {"a": 1.4}, {"b": 2.0}]  # three lowerings, then it stops
    assert scale == {} and mp.peak_bytes == 900


def test_op_growth_skips_the_scales_the_plan_wide_growth_already_gave_every_op(monkeypatch):
    monkeypatch.setattr(pipeline, "GROW_OP_SCALES", (2.0, 1.4))
    # the plan stayed the same at 0.3 = 1.5 x the plan's 0.2: 1.4x is not tried, 2x is
    tried, scale, _ = _grow_ops(monkeypatch, lambda sc: 900 + 1000 * len(sc), lambda sc: 1000 - len(sc), ["a", "b"],
                                unchanged_at=0.3)
    assert tried == [{"a": 2.0}, {"b": 2.0}] and scale == {}


def test_the_roles_tried_are_the_budgeted_ops_that_take_the_most_cycles_over_their_layers(monkeypatch):
    from tremula.frontends import load_model
    from tremula.ir.layers import find_layers, layer_roles

    g = pipeline.canonical(load_model("bert-tiny", batch=2))
    layers = find_layers(g)
    role = layer_roles(g, layers)
    by_op = {n.op: [] for n in g.nodes}
    for n in g.nodes:
        by_op[n.op].append(n.name or n.outputs[0])
    linears = [k for k in by_op["Linear"] if k in role]
    q, o = role[linears[0]], role[linears[-1]]  # the first and the last Linear of the layers
    gelu = next(k for k in by_op["Gelu"] if k in role)
    # cycles per node: the last Linear of layer 1 alone outweighs the first's two layers; a Gelu (no operand
    # budget) costs the most; every other op costs nothing, so the third role is the first budgeted op in node order
    later_o = next(k for k in linears if role[k] == o and k != o)
    cycles = {q: 30, next(k for k in linears if role[k] == q and k != q): 30, later_o: 100, gelu: 1000}
    monkeypatch.setattr(pipeline, "node_cycles", lambda state, chip: cycles)
    monkeypatch.setattr(pipeline, "GROW_OP_ROLES", 3)
    first_budgeted = next(role.get(k, k) for k in (n.name or n.outputs[0] for n in g.nodes
                                                   if n.op in pipeline.MATMULS or n.op == "Attention")
                          if role.get(k, k) not in (q, o))
    assert pipeline._budget_roles(g, layers, None, None) == [o, q, first_budgeted]

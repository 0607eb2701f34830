"""Projections of one input fused into one Linear and a Split (passes/fuse_qkv.py), the near misses that must stay
apart, and the planner's in-place Split of the fused output (plan/lower_linear.py, plan/lower_move.py)."""

import dataclasses

import numpy as np
import pytest

from tremula.ir import GraphBuilder, infer_types, run
from tremula.passes import canonicalize, fuse_qkv
from tremula.plan.lower_ops import Lowerer
from tremula.target.chip import load_chip

RNG = np.random.default_rng(7)


def _randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _projections(widths=(8, 8, 8), bias=(True, True, True), lazy=False, other_input=False):
    b = GraphBuilder("qkv", seed=3)
    x = b.input("x", (2, 5, 8))
    z = b.input("z", (2, 5, 8)) if other_input else x
    for i, (n, has_b) in enumerate(zip(widths, bias)):
        w = b.param(f"w{i}", (8, n)) if lazy else b.const(f"w{i}", _randn(8, n))
        ins = [z if (other_input and i == 2) else x, w] + ([b.const(f"b{i}", _randn(n))] if has_b else [])
        b.output(b.op("Linear", ins), f"y{i}")
    return b.build()


def _same(g, f):
    infer_types(f)
    feeds = {n: _randn(*g.types[n].shape) for n in g.inputs}
    want, got = run(g, feeds), run(f, feeds)
    for k in want:  # column blocks of one product: the same sums, so the same bits
        assert np.array_equal(got[k], want[k]), k


@pytest.mark.parametrize("lazy", [False, True])
def test_three_projections_become_one_linear_and_a_split(lazy):
    g = _projections(lazy=lazy)
    f = fuse_qkv(g)
    assert [n.op for n in f.nodes if n.op != "Identity"] == ["Linear", "Split"]
    lin, split = f.nodes[:2]
    assert f.types[lin.inputs[1]].shape == (8, 24) and f.types[lin.inputs[2]].shape == (24,)
    assert split.outputs == [n.outputs[0] for n in g.nodes if n.op == "Linear"]
    assert split.attrs == {"axis": 2, "sizes": [8, 8, 8]}
    # the joined weights are made when first needed, and fusing made none of the parts
    assert f.constants[lin.inputs[1]].is_lazy
    assert [g.constants[n.inputs[1]].is_lazy for n in g.nodes if n.op == "Linear"] == [lazy] * 3
    _same(g, f)


@pytest.mark.parametrize("miss", ["widths", "bias", "input"])
def test_projections_that_differ_stay_apart(miss):
    kw = {"widths": {"widths": (8, 8, 4)}, "bias": {"bias": (True, True, False)},
          "input": {"other_input": True}}[miss]
    f = fuse_qkv(_projections(**kw))
    linears = [n for n in f.nodes if n.op == "Linear"]
    # the two alike are fused, the odd one stays a Linear of its own
    assert len(linears) == 2 and [n.op for n in f.nodes].count("Split") == 1


def test_canonical_bert_fuses_q_k_v_and_the_planner_splits_in_place():
    from tremula.frontends import load_model

    g = canonicalize(load_model("bert-tiny", 2))
    splits = [n for n in g.nodes if n.op == "Split"]
    assert len(splits) == 2  # one per layer
    state = Lowerer(g, load_chip("c600")).lower()
    for s in splits:
        fused = state.layouts[s.inputs[0]]
        assert state.strategies[s.name] == "Split free (column blocks of its input)"
        for o in s.outputs:  # Q, K and V are column blocks of the fused output, on its tiles, in its buffer
            part = state.layouts[o]
            assert part.buf == fused.buf and part.cols == 32
            assert set(part.tiles.reshape(-1)) <= set(fused.tiles.reshape(-1))


@pytest.mark.parametrize("dtype,serial", [("fp16", 1), ("fp8", 1), ("fp16", 2)])
def test_a_fused_projection_planned_apart_still_answers(monkeypatch, dtype, serial):
    """When its parts cost less apart (made so here by pricing the whole one high), the fused projection is lowered
    as one Linear per part straight into the Split's outputs, and the Program still computes the model. The parts
    share one gathered operand; in two rounds (forced here) they run round by round, each round's rows gathered
    once."""
    from dataclasses import replace

    import tremula.plan.lower_linear as lower_linear
    from tremula.check import check_model

    real = lower_linear.choose_linear

    def whole_is_dear(chip, m, k, n, *args, **kwargs):
        st = real(chip, m, k, n, *args, **kwargs)
        if n == 32 and serial > 1:  # the parts: K split in two, two row groups of 8 rows, in `serial` rounds
            st = replace(st, pm=2, pk=2, serial=serial, stream=False)
        return replace(st, cycles=10**9) if n == 96 else st  # bert-tiny's fused Q, K and V: 3 x 32 columns

    monkeypatch.setattr(lower_linear, "choose_linear", whole_is_dear)
    res = check_model("bert-tiny", "c600", 2, dtype)
    assert res.passed, res.outputs
    apart = [k for k, v in res.compile.strategies.items() if "projections apart" in v]
    assert len(apart) == 2 and all(res.compile.strategies[a + ".0"].startswith("linear") for a in apart)
    assert sum("its parts were made apart" in v for v in res.compile.strategies.values()) == 2
    # its steps are the fused projection's in the reports, not the Split's
    fused = {n.outputs[0] for n in res.compile.graph.nodes if n.name in apart}
    values = {s.origin.value for s in res.compile.program.steps
              if s.origin is not None and s.origin.op.startswith("Linear")}
    assert fused <= values
    # the parts run on the first part's tiles and read the x it gathered, round by round
    assert all("on one gathered operand" in res.compile.strategies[a] for a in apart)
    assert all(f"serial={serial}" in res.compile.strategies[a + ".1"] for a in apart)
    if serial > 1:  # round 1 of every part before round 2 of any
        labels = [s.label for s in res.compile.program.steps if "layer.0.attention.self" in s.label]
        rounds = [lb[-4:-1] for lb in labels]
        assert rounds == ["1/2"] * 6 + ["2/2"] * 6, labels  # partials and reduce of Q, K and V, then again
    monkeypatch.setattr(lower_linear, "share_gather", lambda bounded, thrift: False)  # (each part gathers its own)
    own = check_model("bert-tiny", "c600", 2, dtype)
    assert own.passed and not any("on one gathered operand" in v for v in own.compile.strategies.values())
    assert own.compile.steps == res.compile.steps  # the same steps, two gathers a layer fewer in their exchanges
    assert res.compile.exchange_cycles < own.compile.exchange_cycles


def test_parts_on_one_gathered_operand_beyond_the_weight_block_budget_are_retried_apart(monkeypatch):
    """A plan taking its choices free shares one gathered operand among a fused projection's parts even when their
    weight blocks together exceed the weight-block budget (made so here: a budget of 0 B), the memory plan judging
    the bytes. When that plan does not fit by less than gathering apart would save, the same budget is planned again
    lean (pipeline.plan_graph), where each part gathers its own operand, before a tighter budget or streamed
    weights."""
    import tremula.pipeline as pipeline
    import tremula.plan.lower_linear as lower_linear
    from tremula.compiler import compile_model

    real, real_lowerer, real_plan = lower_linear.choose_linear, pipeline.Lowerer, pipeline.memory_plan

    def whole_is_dear(chip, m, k, n, *args, **kwargs):  # (bert-tiny's fused Q, K and V: 3 x 32 columns)
        st = real(chip, m, k, n, *args, **kwargs)
        return dataclasses.replace(st, cycles=10**9) if n == 96 else st

    monkeypatch.setattr(lower_linear, "choose_linear", whole_is_dear)
    monkeypatch.setattr(lower_linear, "weight_block_budget", lambda chip, f: 0.0)
    free = compile_model("bert-tiny", "c600", 2, "fp16")
    assert sum("on one gathered operand" in v for v in free.strategies.values()) == 2  # free: shared all the same

    made, saves = [], []

    def lowerer(*a, **kw):
        made.append((kw.get("temp_fraction"), kw.get("perm_fraction"), kw.get("thrift")))
        return real_lowerer(*a, **kw)

    def plan(state, *a, **kw):
        mp, live, reserved = real_plan(state, *a, **kw)
        if any("on one gathered operand" in s for s in state.strategies.values()):  # over by less than it saves
            saves.append(state.lean_saves)
            used = mp.tile_used.copy()
            used[0] = load_chip("c600").sram_bytes_per_tile + state.lean_saves // 2
            mp = dataclasses.replace(mp, fits=False, tile_used=used)
        return mp, live, reserved

    monkeypatch.setattr(pipeline, "Lowerer", lowerer)
    monkeypatch.setattr(pipeline, "memory_plan", plan)
    res = compile_model("bert-tiny", "c600", 2, "fp16")
    assert saves and saves[0] > 0  # the other parts' weight blocks
    assert [m[2] for m in made[:2]] == ["free", "lean"] and made[0][:2] == made[1][:2], made  # the same budget
    assert res.fits and not res.streamed_layers
    apart = [v for v in res.strategies.values() if "projections apart" in v]
    assert len(apart) == 2 and not any("on one gathered operand" in v for v in apart)

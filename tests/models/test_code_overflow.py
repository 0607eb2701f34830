"""A lowering without shared layers stops as soon as its exchange code overflows a tile's code region (the Lowerer's
code_limit; plan/lower_ops.CodeOverflow): what it counted is never more than the memory plan of the whole lowering
reserves on that tile, so a plan it stops cannot fit, and plan_graph goes on to shared layers."""

import dataclasses

import numpy as np
import pytest

from tremula import pipeline
from tremula.frontends.zoo import _vision
from tremula.ir.layers import find_layers
from tremula.models.build import build_from_config
from tremula.models.weights import LazyWeights
from tremula.plan.finalize import memory_plan
from tremula.plan.lower_ops import CodeOverflow, Lowerer
from tremula.target.chip import load_chip
from tremula.target.overheads import reserved_bytes

UNSHARED = (0.12, None, False, "free")


def _graph(chip):
    g = build_from_config("siglip", _vision("siglip", 32, 4, 4, 48, 32, 8, 1e-6, "gelu_tanh"), LazyWeights(),
                          batch=2, name="siglip-tiny4")
    return pipeline._planned_graph(pipeline.canonical(g), "float16", chip, None, "half")


def _lower(g, chip, share=False, code_limit=None):
    return Lowerer(g, chip, temp_fraction=0.12, share_layers=share, layers=find_layers(g),
                   code_limit=code_limit).lower()


def test_stops_early_and_counts_no_more_than_the_memory_plan_reserves():
    chip = load_chip("c600")
    g = _graph(chip)
    whole = reserved_bytes(chip.tiles, _lower(g, chip).steps, chip)["exchange_code"]
    limit = int(whole.max()) // 2
    with pytest.raises(CodeOverflow) as e:
        _lower(g, chip, code_limit=limit)
    assert limit < e.value.nbytes <= whole[e.value.tile]
    assert e.value.node < len(g.nodes)  # stopped before the last node
    # at the whole plan's own total it does not stop, and what it counted is what the memory plan reserves, which
    # takes it instead of counting again; shared layers (which share code) never stop
    counted = _lower(g, chip, code_limit=int(whole.max()))
    assert np.array_equal(counted.exchange_code, whole)
    assert np.array_equal(memory_plan(counted, chip)[2]["exchange_code"], whole)
    assert len(_lower(g, chip, share=True, code_limit=1).steps) > 0


def test_plan_graph_goes_on_to_shared_layers(monkeypatch):
    """plan_graph gives the limit to unshared lowerings only (with --weights resident too: its shared plans keep every
    weight on the chip), and a lowering that stops makes it plan shared layers. The tiny model's instructions are mostly
    codelet code, which no chip's code region can hold while its exchange code overflows, so the limit each lowering
    is given is cut to 1,000 B here (its unshared plan reserves over 2 KB of exchange code on a tile)."""
    chip = load_chip("c600")
    given = []
    real = pipeline._lowered

    def lowered(*args, code_limit=None, **kw):
        given.append((args[4][2], code_limit))  # (budget's share flag, the limit plan_graph gave)
        return real(*args, code_limit=None if code_limit is None else 1000, **kw)

    monkeypatch.setattr(pipeline, "_lowered", lowered)
    monkeypatch.setattr(pipeline, "PLAN_BUDGETS", (UNSHARED[:3], (0.12, None, True)))
    graph = pipeline.canonical(build_from_config("siglip", _vision("siglip", 32, 4, 4, 48, 32, 8, 1e-6, "gelu_tanh"),
                                                 LazyWeights(), batch=2, name="siglip-tiny4"))
    fullness = []
    plan = pipeline.plan_graph(graph, chip, "float16", partials="half", fullness=fullness)
    state, mp = plan.state, plan.memory
    assert given == [(False, chip.non_interleaved_bytes_per_tile), (True, None)]
    assert state.share_layers and mp.fits
    assert len(fullness) == 1 and fullness[0] <= 1.0  # the shared plan's only: how full the stopped one is is unknown
    alone = pipeline.plan_graph(graph, chip, "float16", partials="half", shared_only=True)
    assert len(state.steps) == len(alone.state.steps) and np.array_equal(mp.tile_used, alone.memory.tile_used)
    given.clear()
    resident = pipeline.plan_graph(graph, chip, "float16", partials="half", weights="resident")
    assert given == [(False, chip.non_interleaved_bytes_per_tile), (True, None)]
    assert resident.state.share_layers and resident.memory.fits and getattr(resident.state, "streaming", None) is None


def test_a_plan_that_fits_is_kept_over_a_lower_peak_that_does_not(monkeypatch):
    """A plan can fail on its code region with a lower SRAM peak than a later plan that fits: plan_graph keeps the one
    that fits (it had lowered the other again as the lowest peak)."""
    c600 = load_chip("c600")
    g = _graph(c600)
    unshared = memory_plan(_lower(g, c600), c600)[0].code_region_used.max()
    shared = memory_plan(_lower(g, c600, share=True), c600)[0].code_region_used.max()
    assert shared < unshared  # (the tiny model's codelet code: the unshared plan's control code is per step)
    chip = dataclasses.replace(c600, non_interleaved_bytes_per_tile=int(shared + unshared) // 2)
    monkeypatch.setattr(pipeline, "PLAN_BUDGETS", (UNSHARED[:3], (0.12, None, True)))
    graph = pipeline.canonical(build_from_config("siglip", _vision("siglip", 32, 4, 4, 48, 32, 8, 1e-6, "gelu_tanh"),
                                                 LazyWeights(), batch=2, name="siglip-tiny4"))
    fullness = []
    plan = pipeline.plan_graph(graph, chip, "float16", partials="half", fullness=fullness)
    assert fullness[0] > 1.0 and plan.state.share_layers and plan.fits


def test_when_every_budget_tried_stops_early_one_is_lowered_whole(monkeypatch):
    """With no shared budget to go on to, plan_graph lowers the stopped budget whole (without the limit), so that it
    has a plan to return and report, and `fullness` gets that plan's fullness only."""
    chip = load_chip("c600")
    given = []
    real = pipeline._lowered

    def lowered(*args, code_limit=None, **kw):
        given.append((args[4][2], code_limit))
        return real(*args, code_limit=None if code_limit is None else 1000, **kw)

    monkeypatch.setattr(pipeline, "_lowered", lowered)
    monkeypatch.setattr(pipeline, "PLAN_BUDGETS", (UNSHARED[:3],))
    graph = pipeline.canonical(build_from_config("siglip", _vision("siglip", 32, 4, 4, 48, 32, 8, 1e-6, "gelu_tanh"),
                                                 LazyWeights(), batch=2, name="siglip-tiny4"))
    fullness = []
    plan = pipeline.plan_graph(graph, chip, "float16", partials="half", fullness=fullness)
    assert given == [(False, chip.non_interleaved_bytes_per_tile), (False, None)]
    assert not plan.state.share_layers and fullness == [pipeline.plan_fullness(plan.memory, chip)]

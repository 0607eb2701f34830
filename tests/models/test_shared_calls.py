"""Shared layers are real in the Program: each of their steps is a Call of a template step with a patch, which the
file stores instead of the code, the simulator runs, the timing charges, and the memory count sees once."""

import copy
import dataclasses

import numpy as np
import pytest

from tremula import compiler, pipeline
from tremula.feeds import make_feeds
from tremula.pipeline import canonical
from tremula.frontends import load_model
from tremula.plan.finalize import memory_plan, to_program
from tremula.plan.lower_ops import Lowerer
from tremula.program import load_program, save_program
from tremula.sim.functional import simulate
from tremula.target import cost_terms
from tremula.target.chip import load_chip
from tremula.target.overheads import reserved_bytes
from tremula.target.step_cost import price_step, step_cycles
from test_shared_layers import bert4, siglip4

SHARED = ((0.12, None, True),)


@pytest.fixture(scope="module")
def shared_fp8():
    """siglip4 at fp8 with shared layers: its calls rewrite FP8 cast fields and set weight bases."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "PLAN_BUDGETS", SHARED)
        res = compiler.compile_model(siglip4, "c600", 2, "fp8")
    assert res.shared_layers == 3
    return res


def test_calls_hold_only_what_differs(shared_fp8):
    p = shared_fp8.program
    calls = [s for s in p.steps if s.call is not None]
    assert len(calls) == len(p.shared_steps) > 0
    for s in calls:
        t = p.steps[s.call.template]
        assert t.call is None  # a template has code of its own
        for g, f, a in zip(t.compute, s.call.fields, s.compute):
            assert a.tiles is g.tiles and a.shapes is g.shapes  # the same code, not a copy
            assert f.addrs.shape == (len(g), len(f.addr_cols)) and f.params.shape == (len(g), len(f.param_cols))
        assert s.exchange.rows is t.exchange.rows
    assert any(f.words for s in calls for f in s.call.fields)  # FP8 casts' fields differ per layer
    assert any(len(s.call.base) for s in calls)  # and the layers' weights sit at other addresses


def test_a_call_step_cannot_be_edited_as_if_it_had_code(shared_fp8):
    p = copy.deepcopy(shared_fp8.program)
    s = next(s for s in p.steps if s.call is not None)
    with pytest.raises(Exception, match="template"):
        s.compute = []


def test_saved_calls_reload_and_simulate_identically(shared_fp8, tmp_path):
    p = shared_fp8.program
    a, b = tmp_path / "a.tremula", tmp_path / "b.tremula"
    save_program(p, a)
    q = load_program(a)
    save_program(q, b)
    assert a.read_bytes() == b.read_bytes()
    assert np.array_equal(q.shared_steps, p.shared_steps)
    for s, r in zip(p.steps, q.steps):
        assert (s.call is None) == (r.call is None)
        for g, h in zip(s.compute, r.compute):
            assert np.array_equal(g.addrs, h.addrs) and np.array_equal(g.params, h.params)
        assert np.array_equal(s.exchange.src_addr, r.exchange.src_addr)
    g = canonical(siglip4(2))
    feeds = make_feeds(g, 2)
    x, y = simulate(p, shared_fp8.graph, feeds), simulate(q, shared_fp8.graph, feeds)
    for k in x:
        assert np.array_equal(x[k], y[k])


def test_the_file_stores_calls_not_code(shared_fp8, tmp_path):
    """The file of the shared plan is smaller than the same Program with every call materialised as code."""
    from tremula.program import Step

    p = shared_fp8.program
    flat = copy.copy(p)
    flat.steps = [Step(s.compute, s.exchange, s.label) for s in p.steps]
    save_program(p, tmp_path / "calls.tremula")
    save_program(flat, tmp_path / "flat.tremula")
    assert (tmp_path / "calls.tremula").stat().st_size < (tmp_path / "flat.tremula").stat().st_size


def test_timing_charges_the_patch(shared_fp8):
    """A call's compute is its template's code on each tile plus rewriting its fields and setting its weight base
    (cost_terms.call_cycles), in step_cycles and in the profile alike."""
    from tremula.program import Step
    from tremula.report.profile import step_rows

    chip = load_chip("c600")
    p = shared_fp8.program
    charged = 0
    for s in p.steps:
        if s.call is None:
            continue
        flat = Step(s.compute, s.exchange, s.label)  # the same code, as if the layer had its own
        extra = cost_terms.call_cycles(s.patch_words(p.tiles), s.base_tiles(p.tiles))
        per_tile = price_step(chip, flat, p.tiles).tile_compute + extra
        assert step_cycles(chip, s)[0] == per_tile.max() == price_step(chip, s, p.tiles).tile_compute.max()
        charged += step_cycles(chip, s)[0] > step_cycles(chip, flat)[0]
    assert charged > 0
    rows = step_rows(p, chip, keep_tile_cycles=False)[0]
    assert [r.compute for r in rows] == [step_cycles(chip, s)[0] for s in p.steps]


@pytest.mark.parametrize("model,dtype", [(siglip4, "float16"), (bert4, "float16"), ("vit-tiny", "float16")])
def test_planned_and_counted_code_agree(model, dtype):
    """What the memory plan reserves for code, vertex state and exchange code is what the Program holds, counted
    from its own steps: the same bytes, except that a receive continuing another into the next buffer needs no
    pointer reset, which only the Program's addresses show (so with resets priced at 0 the two are equal)."""
    chip = load_chip("c600")
    g = pipeline.lower_precision(model(2) if callable(model) else canonical(load_model(model, 2)), dtype, chip, None)
    state = Lowerer(g, chip, None, share_layers=True).lower()
    mp, live, reserved = memory_plan(state, chip)
    assert state.sharing is not None and state.sharing.calls
    prog = to_program(state, chip, mp, live, reserved, dtype, 2, {})
    assert len(prog.shared_steps) == len(state.sharing.calls)
    counted = reserved_bytes(prog.tiles, prog.steps, chip)
    for cat in ("code", "vertex_state"):
        assert np.array_equal(counted[cat], reserved[cat]), cat
    assert (counted["exchange_code"] <= reserved["exchange_code"]).all()
    free = dataclasses.replace(chip, exchange_code=dataclasses.replace(chip.exchange_code, pointer_reset_bytes=0))
    is_w = np.array([b.category == "weights" for b in state.bufs], bool)
    planned = reserved_bytes(state.T, state.steps, free, state.sharing, is_w)
    assert np.array_equal(reserved_bytes(prog.tiles, prog.steps, free)["exchange_code"], planned["exchange_code"])

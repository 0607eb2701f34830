"""A plan made again from its Recipe (plan/plan.py) is the same plan, so plans made in another process come back as a
few values: the batch search's growths beside it rank the batches as growths made in turn do, and --batch auto
compiles the same Program with its two candidates grown side by side as one after the other."""

import pickle

import pytest

from tremula import pipeline
from tremula.batch_search import GrowthsBeside, find_max_batch
from tremula.frontends import load_model
from tremula.ir.layers import find_layers, layer_roles
from tremula.plan.finalize import memory_plan
from tremula.plan.plan import Plan, recipe_of
from tremula.plan.price import state_cycles
from tremula.program import save_program
from tremula.target.chip import load_chip


@pytest.fixture
def chip48k(tmp_path):
    """tiny16 with 48 KiB tiles: siglip-tiny's growth changes its plans there (test_plan_grow.py)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "examples" / "chips" / "tiny16.toml").read_text()
    path = tmp_path / "tiny16-48k.toml"
    path.write_text(text.replace("sram_bytes_per_tile = 65536", "sram_bytes_per_tile = 49152"))
    return load_chip(str(path))


def _seen(plan: Plan, chip) -> tuple:
    s = plan.state
    return (sum(state_cycles(s, chip)), plan.memory.peak_bytes, plan.memory.fits, dict(s.strategies), s.plan_fraction,
            dict(s.op_scale), s.level_weights, len(s.steps))


def test_a_grown_plan_made_again_from_its_recipe_is_the_same_plan(chip48k):
    graph = load_model("siglip-tiny", 8)
    ungrown = pipeline.plan_graph(graph, chip48k, "float16", partials="half")
    grown = pipeline.plan_graph(graph, chip48k, "float16", partials="half", grow=pipeline.GROW_STEPS)
    recipe = recipe_of(grown.state)
    assert recipe.budget[0] != ungrown.state.plan_fraction and recipe.both_orders  # the growth moved its budget
    again = pipeline.from_recipe(graph, chip48k, "float16", pickle.loads(pickle.dumps(recipe)), None, "half")
    assert _seen(again, chip48k) == _seen(grown, chip48k) != _seen(ungrown, chip48k)
    assert len(pickle.dumps(recipe)) < 1000  # (the plan itself is megabytes)


def test_a_plan_with_its_own_op_budgets_and_levelled_storage_made_again_is_the_same_plan():
    """The recipe carries the roles' own operand budgets (pipeline._grown_ops) and the levelled storage of shared
    layers (plan/layers.spread_caps)."""
    chip = load_chip("examples/chips/tiny64.toml")
    graph = pipeline._planned_graph(load_model("bert-tiny", 4), "float16", chip, None, "half")
    layers = find_layers(graph)
    role = next(iter(dict.fromkeys(layer_roles(graph, layers).values())))
    state = pipeline._lowered(graph, chip, None, layers, (0.1, 0.4, True, "free"), True, {role: 2.0})
    plan = Plan(graph, state, *memory_plan(state, chip, both_orders=True))
    recipe = recipe_of(plan.state)
    assert recipe.op_scale == ((role, 2.0),) and recipe.level_weights and recipe.budget == (0.1, 0.4, True, "free")
    again = pipeline.from_recipe(load_model("bert-tiny", 4), chip, "float16", recipe, None, "half")
    assert _seen(again, chip) == _seen(plan, chip)


@pytest.mark.parametrize("model", ["siglip-tiny", "gpt2-tiny"])
def test_growths_beside_the_search_rank_the_batches_as_growths_in_turn(model, chip48k):
    """find_max_batch with each probe's growth made in a forked process (GrowthsBeside) probes the same batches and
    finds the same rates as with the growths made in turn; every batch that fits comes back as a recipe whose plan
    has that rate."""
    build = lambda b: load_model(model, batch=b)  # noqa: E731
    inline: dict = {}
    beside: dict = {}
    largest = find_max_batch(build, chip48k, "fp16", found=inline, partials="half", grow=True)
    assert find_max_batch(build, chip48k, "fp16", found=beside, partials="half", grow=True,
                          growths=GrowthsBeside(chip48k, "float16", beside)) == largest
    assert beside["rates"] == inline["rates"] and set(beside["made"]) == set(beside["rates"])
    assert any(g is not None and g.steps >= 1 for _, g in beside["made"].values())  # growths were made beside
    for b, (recipe, _) in beside["made"].items():
        plan = pipeline.from_recipe(build(b), chip48k, "float16", recipe, None, "half")
        assert plan.fits and pipeline.plan_rate(plan, chip48k, "float16", b) == beside["rates"][b]


def test_auto_with_its_candidates_grown_side_by_side_compiles_what_one_after_the_other_does(chip48k, monkeypatch,
                                                                                          tmp_path):
    """compile_model --batch auto on two cores (growths beside the search, the plans kept as recipes and made again
    from them, the second candidate grown in a process of its own) and on one (plans kept whole, nothing beside): the
    same batch, rates and Program, byte for byte."""
    import tremula.compiler as compiler

    made: list[int] = []
    real_made, real_beside = compiler.from_recipe, compiler.beside
    monkeypatch.setattr(compiler, "from_recipe", lambda *a, **k: made.append(1) or real_made(*a, **k))
    side: list[int] = []
    monkeypatch.setattr(compiler, "beside", lambda *a, **k: side.append(1) or real_beside(*a, **k))
    seen = {}
    for cores in (1, 2):
        monkeypatch.setattr(compiler, "usable_cores", lambda cores=cores: cores)
        res = compiler.compile_model("siglip-tiny", chip48k, "auto", "fp16")
        seen[cores] = (res.batch, res.auto, res.cycles, res.peak_tile_bytes)
        res.program.meta = {}
        save_program(res.program, tmp_path / str(cores))
        if cores == 1:
            assert not made and not side  # one core: nothing beside, no recipe
    assert side and made  # the second candidate was grown beside; the first made from its recipe
    assert seen[1] == seen[2] and len(seen[2][1]["grown"]) == 2
    assert (tmp_path / "1").read_bytes() == (tmp_path / "2").read_bytes()

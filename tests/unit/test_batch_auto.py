"""--batch auto compiles the fastest of the batches the search planned that fit, and reports the largest that fits."""

import warnings

import pytest

from tremula.batch_search import AUTO_GROWN, find_max_batch
from tremula.compiler import compile_model
from tremula.frontends import load_model
from tremula.program import save_program
from tremula.target.chip import load_chip

TINY16 = "examples/chips/tiny16.toml"


@pytest.mark.parametrize("model", ["gpt2-tiny", "vit-tiny"])
def test_auto_compiles_the_fastest_batch_planned_and_reports_the_largest(model):
    chip = load_chip(TINY16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = compile_model(model, chip, "auto", "fp16")
    rates = res.auto["rates"]
    assert res.auto["largest"] == find_max_batch(lambda b: load_model(model, batch=b), chip, "fp16",
                                                 partials="half")
    assert 1 in rates and res.auto["largest"] in rates and max(rates) == res.auto["largest"]
    assert res.batch == max(rates, key=lambda b: (rates[b], b))
    # The rate the search recorded is the throughput the compile reports for that batch (host I/O in series).
    assert rates[res.batch] == pytest.approx(res.batch * chip.clock_hz / res.throughput_cycles, rel=1e-12)
    said = [str(w.message) for w in caught if "largest that fits" in str(w.message)]
    assert bool(said) == (res.batch != res.auto["largest"])
    assert res.summary()["auto"]["largest"] == res.auto["largest"]
    # the batches grown fully (their rates are a compile's): the compiled one and at most AUTO_GROWN in all
    grown = res.auto["grown"]
    assert res.batch in grown and set(grown) <= set(rates) and len(grown) <= AUTO_GROWN
    assert res.summary()["auto"]["grown"] == grown


def test_a_fixed_batch_is_not_auto():
    res = compile_model("gpt2-tiny", TINY16, 2, "fp16")
    assert res.auto is None and "auto" not in res.summary()


def test_auto_compiles_the_batch_it_chose_as_a_compile_of_that_batch_alone(tmp_path):
    """The search ranks batches by plans grown one step; the batch chosen is then planned as a compile of it alone
    plans it (grown fully): the same Program, byte for byte."""
    res = compile_model("gpt2-tiny", TINY16, "auto", "fp16")
    alone = compile_model("gpt2-tiny", TINY16, res.batch, "fp16")
    assert (res.cycles, res.peak_tile_bytes, res.strategies) == (alone.cycles, alone.peak_tile_bytes, alone.strategies)
    for r, name in ((res, "auto"), (alone, "alone")):
        r.program.meta = {}  # (the summary differs: the auto one lists the rates)
        save_program(r.program, tmp_path / name)
    assert (tmp_path / "auto").read_bytes() == (tmp_path / "alone").read_bytes()


def test_probes_rank_by_their_plans_grown_one_step_and_fit_by_the_plans_before(monkeypatch):
    """fits_at(grow=True) asks plan_graph for one step of growth and no ops' budgets, not within NEAR_FULL of a tile;
    its rate is the grown plan's (plan_rate), its fullness the last plan's plan_graph tried, before growth (what the
    search's guesses read; growing changes nothing on this tiny chip's plans)."""
    import tremula.batch_search as bs
    import tremula.pipeline as pipeline

    chip = load_chip(TINY16)
    asked = {}
    real = bs.plan_graph

    def planning(graph, *args, **kwargs):
        asked.update(kwargs)
        return real(graph, *args, **kwargs)

    monkeypatch.setattr(bs, "plan_graph", planning)
    rates: dict = {}
    fits, _, full = bs.fits_at(lambda b: load_model("gpt2-tiny", batch=b), chip, "float16", 4, partials="half",
                               rates=rates, grow=True)
    assert fits and (asked["grow"], asked["grow_ops"]) == (1, False)
    plan = real(load_model("gpt2-tiny", batch=4), chip, "float16", partials="half", lowest_peak=False, grow=1,
                grow_ops=False)
    state, mp = plan.state, plan.memory
    assert rates[4] == pipeline.plan_rate(plan, chip, "float16", 4)
    assert full == asked["fullness"][-1] == pipeline.plan_fullness(mp, chip)  # (the last plan tried: before growth)
    when = asked["grow_when"]
    assert when(state, mp) == (pipeline.plan_fullness(mp, chip) < bs.NEAR_FULL)
    monkeypatch.setattr(bs, "plan_fullness", lambda mp, chip: bs.NEAR_FULL)
    assert not when(state, mp)


def test_plan_graph_without_grow_ops_grows_no_op_budget(monkeypatch):
    import tremula.pipeline as pipeline

    monkeypatch.setattr(pipeline, "_grown_ops", lambda *a, **k: pytest.fail("grow_ops=False grew an op's budget"))
    plan = pipeline.plan_graph(load_model("gpt2-tiny", batch=4), load_chip(TINY16), "float16", partials="half",
                               grow=1, grow_ops=False)
    assert plan.fits and not plan.state.op_scale


def test_placeholder_scales_differ_between_layers():
    from tremula.batch_search import placeholder_scales
    from tremula.ir.layers import find_layers
    from tremula.passes.precision import activation_casts, fp8_linear_casts
    from tremula.pipeline import canonical

    g = fp8_linear_casts(canonical(load_model("siglip-tiny")))
    scales = placeholder_scales(load_model("siglip-tiny"))
    layers = find_layers(g)
    casts = [n for n in activation_casts(g) if n.name in layers]
    assert set(scales) == {n.name for n in activation_casts(g)}
    by_layer: dict = {}
    for n in casts:
        by_layer.setdefault(layers[n.name], []).append(scales[n.name])
    rows = list(by_layer.values())
    assert len(rows) >= 2 and all(len(r) == len(rows[0]) for r in rows)
    for a in rows:  # the same cast of any two layers never has the same scale
        for b in rows:
            if a is not b:
                assert all(x != y for x, y in zip(a, b))


@pytest.mark.parametrize("grow", ["line", "convex", "steps"])
def test_the_search_finds_what_bisection_finds_in_fewer_probes(monkeypatch, grow):
    """A synthetic planner whose plans fill a tile as the batch grows (in a line, faster and faster, or in steps):
    the search returns the largest batch that fits, as bisection would, and guessing from how full the plans are
    takes fewer probes than bisection on the line."""
    import tremula.batch_search as bs

    def fullness(b: int) -> float:
        return {"line": 0.3 + 0.013 * b, "convex": 0.3 + 0.00011 * b * b, "steps": 0.5 + 0.06 * (b // 7)}[grow]

    answer = max(b for b in range(1, 4097) if fullness(b) <= 1.0)
    probed: list[int] = []

    def fits_at(build, chip, dt, b, *args, **kwargs):
        probed.append(b)
        return fullness(b) <= 1.0, False, fullness(b)

    monkeypatch.setattr(bs, "fits_at", fits_at)
    monkeypatch.setattr(bs, "bound_limit", lambda *a, **k: 4096)
    assert bs.find_max_batch(lambda b: None, load_chip(TINY16), "fp16") == answer
    doubling = answer.bit_length() + 1  # 1, 2, 4, ... up to the first power of two that fails
    assert len(probed) <= doubling + 2 * (answer.bit_length() - 1)
    if grow == "line":
        assert len(probed) <= doubling + 2


def _replay(monkeypatch, full: dict[int, float]) -> tuple[int, list[int]]:
    """find_max_batch against plans whose fullness is `full` (batch -> how full the fullest tile is): (the answer,
    the batches probed in order)."""
    import tremula.batch_search as bs

    probed: list[int] = []

    def fits_at(build, chip, dt, b, *args, **kwargs):
        probed.append(b)
        return full[b] <= 1.0, False, full[b]

    monkeypatch.setattr(bs, "fits_at", fits_at)
    monkeypatch.setattr(bs, "bound_limit", lambda *a, **k: 4096)
    return bs.find_max_batch(lambda b: None, load_chip(TINY16), "fp16"), probed


def test_a_line_that_undershoots_is_leaned_towards_the_batch_that_failed(monkeypatch):
    """SigLIP so400m fp8's plans (how full the fullest tile is): 8 fits, 16 does not, the line's guess 10 fits and so
    does 11 after it; the next guess halves 16's excess (Illinois) and lands on 12, which fails: the answer, 11, in
    one failing probe fewer than bisection's 13 then 12."""
    import tremula.batch_search as bs

    full = {1: 0.5, 2: 0.55, 4: 0.7, 8: 0.897, 10: 0.951, 11: 0.993, 12: 1.068, 13: 1.112, 16: 1.185}
    assert _replay(monkeypatch, full) == (11, [1, 2, 4, 8, 16, 10, 11, 12])
    assert bs._guess(11, 16, full) == 12 and bs._guess(11, 16, full, halve=1) == 12
    assert bs._guess(0, 100, {0: 0.0, 100: 3.0}) == 33 and bs._guess(0, 100, {0: 0.0, 100: 3.0}, halve=2) == 66


def test_a_guess_that_fits_far_from_full_is_followed_by_a_new_guess(monkeypatch):
    """BERT-base fp16's plans as the search met them (how full the fullest tile is; measured on the c600): 128 fits,
    256 does not. The line guesses 137, which fits at 96 %: the line overestimated the growth, so the next probe is a
    new guess (146), not 138; likewise after 146 at 98.6 %. A guess within NEAR_FULL of a tile is followed by the batch
    after it. The answer, 150, in 5 probes after the doubling where stepping by one after every guess took 9 (137,
    138, 155, 145, 146, 149, 150, 152, 151)."""
    full = {1: 0.69, 2: 0.703, 4: 0.532, 8: 0.608, 16: 0.696, 32: 0.795, 64: 0.947, 128: 0.963, 256: 1.449,
            137: 0.9602, 138: 0.9609, 145: 0.9841, 146: 0.9856, 149: 0.9896, 150: 0.9829, 151: 1.054, 152: 1.056,
            155: 1.051}
    answer, probed = _replay(monkeypatch, full)
    assert answer == 150 and probed[9:] == [137, 146, 149, 151, 150]


def test_a_larger_batch_starts_at_the_budget_that_fitted_a_smaller_one(monkeypatch):
    """find_max_batch: every probe above the largest batch that fitted so far starts at the budget that plan came from
    (pipeline.plan_graph's from_budget); one below it, or before any fitted, starts at the first."""
    import tremula.batch_search as bs

    calls: list[tuple[int, int]] = []

    def fits_at(build, chip, dt, b, *args, from_budget=0, budget=None, **kwargs):
        calls.append((b, from_budget))
        fits = b <= 40
        if budget is not None:
            budget.append(max(from_budget, b // 8))  # tighter budgets as the batch grows
        return fits, False, b / 40

    monkeypatch.setattr(bs, "fits_at", fits_at)
    monkeypatch.setattr(bs, "bound_limit", lambda *a, **k: 4096)
    assert bs.find_max_batch(lambda b: None, load_chip(TINY16), "fp16") == 40
    fitted: dict[int, int] = {}  # batch -> its budget
    for b, start in calls:
        below = [c for c in fitted if c < b]
        assert start == (fitted[max(below)] if below and max(fitted) < b else 0), (b, start, fitted)
        if b <= 40:
            fitted[b] = max(start, b // 8)
    assert any(start > 0 for _, start in calls)


def test_a_larger_batch_starts_levelled_when_the_plan_that_fitted_a_smaller_one_was(monkeypatch):
    """find_max_batch: as with the budget, a probe above the largest batch that fitted so far starts with the shared
    layers' storage levelled when that batch's plan was (plan_graph's level_from; `budget` gets the index and 1 when
    levelled): BERT-base fp16 fitted only levelled from batch 128 on, and each larger probe lowered unlevelled first
    in vain. A probe below it, or before any fitted, starts unlevelled."""
    import tremula.batch_search as bs

    calls: list[tuple[int, bool]] = []

    def fits_at(build, chip, dt, b, *args, from_budget=0, budget=None, level_from=False, **kwargs):
        calls.append((b, level_from))
        if budget is not None:
            budget += [from_budget, int(level_from or b >= 24)]  # plans levelled from batch 24 on
        return b <= 40, False, b / 40

    monkeypatch.setattr(bs, "fits_at", fits_at)
    monkeypatch.setattr(bs, "bound_limit", lambda *a, **k: 4096)
    assert bs.find_max_batch(lambda b: None, load_chip(TINY16), "fp16") == 40
    fitted: dict[int, bool] = {}  # batch -> levelled
    for b, level in calls:
        below = [c for c in fitted if c < b]
        assert level == (fitted[max(below)] if below and max(fitted) < b else False), (b, level, fitted)
        if b <= 40:
            fitted[b] = level or b >= 24
    assert any(level for _, level in calls) and not all(level for _, level in calls)


@pytest.mark.parametrize("batch", [16, 64])
@pytest.mark.parametrize("lowest_peak", [True, False])
def test_a_plan_that_fits_nowhere_is_lowered_again_only_when_the_least_full_was_not_the_last(monkeypatch, batch,
                                                                                           lowest_peak):
    """plan_graph tries budgets in turn; when none fits it returns the least full plan, lowered again only if it is
    not the plan in hand (budgets skipped after the last one tried used to count as tried); the batch search asks
    for no such re-lowering (lowest_peak=False) and judges the least full plan from `fullness`."""
    from tremula import pipeline

    lowered = []

    class Counting(pipeline.Lowerer):
        def lower(self):
            lowered.append(self.temp_fraction)
            return super().lower()

    monkeypatch.setattr(pipeline, "Lowerer", Counting)
    chip = load_chip(TINY16)
    full: list[float] = []
    mp = pipeline.plan_graph(load_model("bert-tiny", batch), chip, "float16", lowest_peak=lowest_peak,
                             fullness=full).memory
    assert not mp.fits and len(full) >= 2
    least = min(range(len(full)), key=full.__getitem__)
    again = lowest_peak and least != len(full) - 1
    assert len(lowered) == len(full) + again
    assert pipeline.plan_fullness(mp, chip) == (full[least] if lowest_peak else full[-1])


def test_fp8_auto_calibrates_beside_the_search_and_compiles_with_the_calibrated_scales(tmp_path):
    """The search plans with all-zero scales while the calibration runs; the batch it answers is planned again with
    the calibrated scales, and the Program compiled is the one a compile of that batch alone makes, byte for byte."""
    res = compile_model("siglip-tiny", "c600", "auto", "fp8")
    alone = compile_model("siglip-tiny", "c600", res.batch, "fp8")
    for r, name in ((res, "auto"), (alone, "alone")):
        r.program.meta = {}
        save_program(r.program, tmp_path / name)
    assert (tmp_path / "auto").read_bytes() == (tmp_path / "alone").read_bytes()
    # the rate listed for the batch compiled is the calibrated plan's, as the compile reports it
    rate = res.batch * load_chip("c600").clock_hz / res.throughput_cycles
    assert res.auto["rates"][res.batch] == pytest.approx(rate, rel=1e-12)


def test_fp8_auto_searches_again_when_the_plan_chosen_does_not_fit_with_the_calibrated_scales(monkeypatch):
    """When the plan of the batch the zero-scale search chose does not fit with the calibrated scales, the search runs
    again with them: the compile answers what a search with the calibrated scales answers, and plans the batch it
    chose as --batch N plans it (all-zero scales first, then lowered again with the calibrated ones: _plan_beside)."""
    import tremula.compiler as compiler
    from tremula.fp8_calibration import calibrate

    real, calls = compiler._calibrated, []

    def first_fails(*a, **k):  # the auto's chosen plan: none (as one that does not fit); the compile's after: real
        calls.append(1)
        return None if len(calls) == 1 else real(*a, **k)

    monkeypatch.setattr(compiler, "_calibrated", first_fails)
    beside, planned_beside = compiler._plan_beside, []
    monkeypatch.setattr(compiler, "_plan_beside", lambda *a, **k: planned_beside.append(1) or beside(*a, **k))
    res = compile_model("bert-tiny", "c600", "auto", "fp8")
    assert planned_beside == [1]
    build = lambda b: load_model("bert-tiny", batch=b)
    scales = calibrate(build, None, None, load_chip("c600"))
    assert res.fits and res.auto["largest"] == find_max_batch(build, load_chip("c600"), "fp8", scales=scales,
                                                              partials="half")
    # and the batch it chose is planned as --batch N plans it (all-zero scales first, then the calibrated ones)
    alone = compile_model("bert-tiny", "c600", res.batch, "fp8")
    assert (res.cycles, res.peak_tile_bytes, res.strategies) == (alone.cycles, alone.peak_tile_bytes, alone.strategies)


def test_fp8_auto_confirms_the_largest_beside_the_growths_after_the_first(monkeypatch):
    """Beside the calibration, --batch auto grows its fastest batch, then waits for the scales and plans the search's
    largest with them beside the growth of the next: the confirm starts between the two growths, and the answer and
    Program are a compile's that confirms after them (the same searches, the same plans)."""
    import tremula.compiler as compiler

    events = []
    grow, confirm = compiler.grown_on, compiler._confirm_beside
    monkeypatch.setattr(compiler, "grown_on", lambda *a, **k: events.append("grow") or grow(*a, **k))
    monkeypatch.setattr(compiler, "_confirm_beside", lambda *a, **k: events.append("confirm") or confirm(*a, **k))
    res = compile_model("siglip-tiny", "c600", "auto", "fp8")
    assert events[:3] == ["grow", "confirm", "grow"]
    monkeypatch.setattr(compiler, "_confirm_beside", lambda *a, **k: None)  # (the confirm after the growths)
    after = compile_model("siglip-tiny", "c600", "auto", "fp8")
    assert (res.batch, res.auto, res.cycles) == (after.batch, after.auto, after.cycles)


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("last,probes", [(11, [11]), (10, [11, 10]), (9, [11, 10, 9]), (8, [11, 10, 9])])
def test_the_largest_with_calibrated_scales_is_found_below_the_search_largest(monkeypatch, last, probes, parallel):
    """The plan compiled fits with the calibrated scales, the largest the zero-scale search found may not (SigLIP
    so400m fp8: batch 11 fits with zeros, 10 with the calibrated scales' patches): the largest then is probed first,
    the batch below it next, then the batches between are halved; the batch compiled is never probed again.
    parallel: the largest and the batch below it are probed at once, the largest beside (here run first, in turn)."""
    import tremula.compiler as compiler

    seen = []

    def fits_at(build, chip, dt, b, scales, **k):
        seen.append(b)
        return b <= last, False, None

    def beside(fn, *args, name, process):  # (in turn: what a forked process would see stays here)
        got = fn(*args)
        return lambda: got

    monkeypatch.setattr(compiler, "fits_at", fits_at)
    monkeypatch.setattr(compiler, "beside", beside)
    got = compiler._largest_calibrated(None, None, "fp8", 8, 11, {}, {}, "half", "resident", None, parallel)
    assert got == last and seen == (probes if not parallel or last < 11 else [11, 10])  # (both at once)
    seen.clear()
    assert compiler._largest_calibrated(None, None, "fp8", 11, 11, {}, {}, "half", "resident", None, parallel) == 11
    assert not seen
    # the batch below the largest fits already: the largest alone is probed
    got = compiler._largest_calibrated(None, None, "fp8", 10, 11, {}, {}, "half", "resident", None, parallel)
    assert got == (11 if last == 11 else 10) and seen == [11]

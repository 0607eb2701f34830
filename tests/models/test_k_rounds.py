"""K rounds (plan/strategies.py LinearStrategy.kchunk): a matmul that gathers each tile's K slice in chunks of whole
AMP groups and adds every chunk's products into the same half partials must compute the bits of the one-round plan,
on the direct path (whole K on a tile) and the split-K path, at fp16 with half partials and at FP8; and the planner
takes them where the operand budget leaves few rows a round (BERT-base at batch 128 on a C600)."""

import dataclasses

import numpy as np
import pytest

import tremula.plan.lower_linear as lower_linear
from tremula.compiler import compile_model
from tremula.feeds import make_feeds
from tremula.plan.strategies import cdiv, choose_linear, choose_linear_pair
from tremula.sim.functional import simulate
from tremula.target.chip import load_chip

C600 = load_chip("c600")


def _in_rounds(st, k: int, group: int):
    """st with its K slice in rounds of one AMP group (unchanged when the slice is a single group)."""
    return dataclasses.replace(st, kchunk=group) if cdiv(k, st.pk) > group else st


def _force(monkeypatch, pk: int, rounds: bool):
    """With `rounds`, every half-partials matmul (fp16 with half partials, FP8) planned in K rounds of one AMP group;
    with pk, on that many K parts where the planner has a free choice (the split-K path)."""
    def group(dtype):
        return C600.amp_pair("fp8" if "float8" in dtype else "fp16", "fp16").weights_per_conv_unit

    def forced(st, k, dtype, partials):
        return _in_rounds(st, k, group(dtype)) if rounds and (partials == "half" or "float8" in dtype) else st

    def one(chip, m, k, n, dtype, *a, **kw):
        if pk and not kw.get("pk_fix"):
            kw["pk_fix"] = pk
        return forced(choose_linear(chip, m, k, n, dtype, *a, **kw), k, dtype, kw.get("partials", "float"))

    def pair(chip, m, k, n, n2, dtype, dtype2, pm_max, tf, src, perm, pk_fix, pn2_fix, partials, partials2, k_rounds,
             tf2=None):
        s1, s2 = choose_linear_pair(chip, m, k, n, n2, dtype, dtype2, pm_max, tf, src, perm, pk_fix or pk, pn2_fix,
                                    partials, partials2, k_rounds, tf2)
        return forced(s1, k, dtype, partials), forced(s2, n, dtype2, partials2)

    monkeypatch.setattr(lower_linear, "choose_linear", one)
    monkeypatch.setattr(lower_linear, "choose_linear_pair", pair)


def _outputs(model: str, dtype: str, batch: int = 2):
    res = compile_model(model, C600, batch, dtype)
    return res, simulate(res.program, res.graph, make_feeds(res.source, 0))


# pk 0: the planner's own K cuts, which put whole K on a tile for these (clip-tiny's fc2 at FP8: 128 = 4 groups);
# pk 2: the split-K path
@pytest.mark.parametrize("model,dtype,pk", [("bert-tiny", "fp16", 0), ("clip-tiny", "fp8", 0), ("vit-tiny", "fp16", 2),
                                            ("vit-tiny", "fp8", 2)])
def test_k_rounds_give_the_bits_of_one_round(model, dtype, pk, monkeypatch):
    _force(monkeypatch, pk, rounds=False)
    _, plain = _outputs(model, dtype)
    _force(monkeypatch, pk, rounds=True)
    res, rounds = _outputs(model, dtype)
    planned = [s for s in res.strategies.values() if " kchunk=" in s]
    assert any((" pk=1 " in s) == (pk == 0) for s in planned), res.strategies
    assert any("K 2/" in s.label for s in res.program.steps)
    assert plain.keys() == rounds.keys()
    for name in plain:
        assert np.array_equal(plain[name].view(np.uint8), rounds[name].view(np.uint8)), name


def test_bert_base_b128_takes_k_rounds_and_they_pay():
    """On a C600 at batch 128 BERT-base's fc1 fits only a few rows a round under its operand budget; K rounds let a
    round keep more rows (fewer AMP passes' overheads): the planner's estimate is cheaper with them than the
    cheapest plan without them on the same budgets, and a lean choice needs no more bytes than that plan."""
    m, k, n = 128 * 128, 768, 3072
    free, lean, none = (choose_linear(C600, m, k, n, "float16", 1472, 0.2, partials="half", k_rounds=r)
                        for r in ("free", "lean", "none"))
    assert free.kchunk and not none.kchunk
    assert free.over == none.over == 0 and free.cycles < none.cycles
    assert lean.bytes_per_tile <= none.bytes_per_tile and lean.cycles <= none.cycles
    # float partials cannot continue a running sum exactly: no K rounds
    assert not choose_linear(C600, m, k, n, "float16", 1472, 0.2, partials="float").kchunk


def test_a_plan_with_k_rounds_that_does_not_fit_is_retried_lean(monkeypatch):
    """pipeline.plan_graph: when the first plan takes K rounds and does not fit, the same budget is planned again with
    lean K rounds (no more bytes than without them) before any tighter budget or streamed weights, when what they
    save could make it fit. Here the free plan is made to take K rounds 1000 B fuller than lean ones and to be judged
    500 B too full; the lean one is then the plan compiled."""
    import tremula.pipeline as pipeline

    made = []
    real_lowerer, real_plan = pipeline.Lowerer, pipeline.memory_plan
    real_one = lower_linear.choose_linear

    def one(chip, m, k, n, dtype, *a, k_rounds="free", **kw):
        st = real_one(chip, m, k, n, dtype, *a, k_rounds=k_rounds, **kw)
        if k_rounds != "free" or kw.get("partials") != "half" or st.kchunk or _in_rounds(st, k, 16) is st:
            return st
        return dataclasses.replace(st, kchunk=16, bytes_per_tile=st.bytes_per_tile + 1000)  # 1000 B fuller

    def lowerer(*a, **kw):
        made.append((kw.get("temp_fraction"), kw.get("perm_fraction"), kw.get("thrift")))
        return real_lowerer(*a, **kw)

    def plan(state, *a, **kw):
        mp, live, reserved = real_plan(state, *a, **kw)
        if any(" kchunk=" in s for s in state.strategies.values()):  # over by less than lean rounds save
            used = mp.tile_used.copy()
            used[0] = C600.sram_bytes_per_tile + 500
            mp = dataclasses.replace(mp, fits=False, tile_used=used)
        return mp, live, reserved

    monkeypatch.setattr(lower_linear, "choose_linear", one)
    monkeypatch.setattr(pipeline, "Lowerer", lowerer)
    monkeypatch.setattr(pipeline, "memory_plan", plan)
    res = compile_model("bert-tiny", C600, 2, "fp16")
    assert [m[2] for m in made[:2]] == ["free", "lean"] and made[0][:2] == made[1][:2], made  # the same budget
    assert res.fits and not res.streamed_layers
    assert not any(" kchunk=" in s for s in res.strategies.values())

"""--batch auto compiles the fastest of the batches the search planned that fit, and reports the largest that fits."""

import warnings

import pytest

from tremula.batch_search import find_max_batch
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


def test_a_fixed_batch_is_not_auto():
    res = compile_model("gpt2-tiny", TINY16, 2, "fp16")
    assert res.auto is None and "auto" not in res.summary()


def test_auto_reuses_the_plan_of_the_batch_it_chose(monkeypatch, tmp_path):
    """The chosen batch is planned once, by the search, and its kept plan is what the compile returns: the same
    Program as a compile of that batch alone."""
    import tremula.batch_search as bs
    import tremula.compiler as compiler

    planned = []
    real = compiler.plan_graph

    def counting(graph, *args, **kwargs):
        from tremula.ir.graph import model_batch

        planned.append(model_batch(graph))
        return real(graph, *args, **kwargs)

    monkeypatch.setattr(compiler, "plan_graph", counting)
    monkeypatch.setattr(bs, "plan_graph", counting)
    res = compile_model("gpt2-tiny", TINY16, "auto", "fp16")
    assert planned.count(res.batch) == 1
    alone = compile_model("gpt2-tiny", TINY16, res.batch, "fp16")
    assert (res.cycles, res.peak_tile_bytes, res.strategies) == (alone.cycles, alone.peak_tile_bytes, alone.strategies)
    for r, name in ((res, "auto"), (alone, "alone")):
        r.program.meta = {}  # (the summary differs: the auto one lists the rates)
        save_program(r.program, tmp_path / name)
    assert (tmp_path / "auto").read_bytes() == (tmp_path / "alone").read_bytes()

"""--batch auto compiles the fastest of the batches the search planned that fit, and reports the largest that fits."""

import warnings

import pytest

from tremula.batch_search import find_max_batch
from tremula.compiler import compile_model
from tremula.frontends import load_model
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

"""--partials: half partials (the default for fp16 and fp8, as PopRT runs them) against float32 partials, on whole
models: both pass check against the reference of their own arithmetic, half runs the fp16 AMP at twice the rate, and
the simulated outputs really differ (the choice reaches the arithmetic, not only the price)."""

import numpy as np
import pytest

from tremula.check import check_model


@pytest.mark.parametrize("model", ["bert-tiny", "vit-tiny"])
def test_half_partials_are_faster_and_both_choices_check(model):
    half = check_model(model, "c600", 2, "fp16", partials="half")
    flt = check_model(model, "c600", 2, "fp16", partials="float")
    assert half.passed and flt.passed
    assert half.compile.partials == "half" and flt.compile.partials == "float"
    assert half.compile.compute_cycles < flt.compile.compute_cycles
    strategies = [s for s in half.compile.strategies.values() if s.startswith("linear")]
    assert strategies and all(s.endswith("half partials") for s in strategies)
    assert not any("half partials" in s for s in flt.compile.strategies.values())


def test_the_choice_changes_the_simulated_values():
    from tremula.compiler import compile_model
    from tremula.feeds import make_feeds
    from tremula.sim.functional import simulate

    outs = {}
    for p in ("half", "float"):
        res = compile_model("bert-tiny", "c600", 2, "fp16", partials=p)
        outs[p] = simulate(res.program, res.graph, make_feeds(res.source, 0))["last_hidden_state"]
    assert not np.array_equal(outs["half"], outs["float"])
    cos = float(np.dot(outs["half"].ravel().astype(np.float64), outs["float"].ravel()) /
                np.linalg.norm(outs["half"].astype(np.float64)) / np.linalg.norm(outs["float"].astype(np.float64)))
    assert cos > 0.999  # close: half partials round more often, they do not compute something else


def test_fp32_ignores_the_choice():
    from tremula.compiler import compile_model

    a, b = (compile_model("bert-tiny", "c600", 2, "fp32", partials=p) for p in ("half", "float"))
    assert a.cycles == b.cycles and a.partials == b.partials == "float"

"""FP8 end to end: every tiny zoo model compiled with --dtype fp8, run in the simulator, against float32."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tremula.check import check_model
from tremula.compiler import compile_model
from tremula.errors import TremulaError
from tremula.feeds import make_feeds
from tremula.ir import run
from tremula.target.chip import load_chip

TINY = ["vit-tiny", "siglip-tiny", "clip-tiny", "bert-tiny", "minilm-tiny", "gpt2-tiny"]
TINY16 = str(Path(__file__).resolve().parents[2] / "examples" / "chips" / "tiny16.toml")


def _cos(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("model", TINY)
def test_fp8_check_on_c600(model):
    res = check_model(model, "c600", 2, "fp8")
    assert res.passed, res.outputs
    assert res.layers and all(x.cosine > 0.99 for x in res.layers)
    codelets = {g.codelet for s in res.compile.program.steps for g in s.compute}
    assert {"matmul_fp8", "fp8_cast"} <= codelets
    g = res.compile.graph
    # Every Linear of an activation runs on the quarter path (SigLIP's pooling probe is a constant: it stays fp16).
    assert not [n.name for n in g.nodes if n.op == "Linear" and n.inputs[0] not in g.constants]


def test_simulator_runs_the_planned_fp8_graph():
    """Against the interpreter on the graph it planned, the simulator differs only where split-K sums float partials
    (the interpreter rounds one running sum to half per group over all of K)."""
    from tremula.sim.functional import simulate

    res = compile_model("minilm-tiny", "c600", 2, "fp8")
    assert any("pk=1 " not in s for s in res.strategies.values() if s.startswith("linear"))
    feeds = make_feeds(res.graph, seed=0)
    got = simulate(res.program, res.graph, feeds)
    ref = run(res.graph, feeds)
    for o in res.graph.outputs:
        assert _cos(got[o], ref[o]) > 0.9999, o


def test_fp8_on_a_small_chip():
    # tiny16 with the C600's quarter AMP path added (a hypothetical chip): every matmul spans several tiles and the
    # weights' scale operands are replicated on each.
    c600, tiny = load_chip("c600"), load_chip(TINY16)
    chip = dataclasses.replace(tiny, name="tiny16-fp8", amp=tiny.amp + (c600.amp_pair("fp8", "fp16"),))
    res = check_model("vit-tiny", chip, 16, "fp8")
    assert res.passed, res.outputs


def test_fp8_halves_weight_bytes_and_runs_at_the_fp8_rate():
    from tremula.codelets import codelet

    r16 = compile_model("vit-tiny", "c600", 2, "fp16")
    r8 = compile_model("vit-tiny", "c600", 2, "fp8")
    w16 = sum(c.type.nbytes for c in r16.graph.constants.values())
    w8 = sum(c.type.nbytes for c in r8.graph.constants.values())
    assert w8 < 0.6 * w16
    # The same vertex shape on the quarter path (128 MAC/cycle) against the half one (64): well under the fp16 cost.
    chip = load_chip("c600")
    shapes = [(256, 512), (512, 64), (256, 64)]
    c16 = codelet("matmul").cycles(chip, (0,), shapes, ("float16", "float16", "float16"))
    c8 = codelet("matmul_fp8").cycles(chip, (0, 0, 0, -4, 32), shapes[:2] + [(1, 1)] + shapes[2:],
                                      ("uint8", "uint8", "int8", "float16"))
    assert c8 < 0.65 * c16


def test_fp8_needs_a_chip_with_fp8():
    with pytest.raises(TremulaError, match="no FP8 matmul unit"):
        compile_model("vit-tiny", "mk2", 1, "fp8")


def test_calibration_inputs_are_used_and_checked():
    g_feeds = make_feeds(compile_model("vit-tiny", "c600", 1, "fp16").graph, seed=5)
    name = next(iter(g_feeds))
    small = compile_model("vit-tiny", "c600", 2, "fp8", calibration={name: g_feeds[name].astype(np.float32) * 1e-3})
    big = compile_model("vit-tiny", "c600", 2, "fp8", calibration={"": g_feeds[name].astype(np.float32) * 1e3})
    s_small = [n.attrs["scale"] for n in small.graph.nodes if n.op == "Fp8Quantize"]
    s_big = [n.attrs["scale"] for n in big.graph.nodes if n.op == "Fp8Quantize"]
    assert s_small[0] < s_big[0]  # the first cast sees the inputs' range directly
    with pytest.raises(TremulaError, match="do not match"):
        compile_model("vit-tiny", "c600", 1, "fp8", calibration={"nope": g_feeds[name]})
    with pytest.raises(TremulaError, match="has shape"):
        compile_model("vit-tiny", "c600", 1, "fp8", calibration={name: g_feeds[name][..., :3]})

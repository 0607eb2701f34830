"""The FP8 precision pass: where casts go, calibration of activation scales, and per-layer loss."""

import numpy as np

from tremula.compiler import make_feeds
from tremula.frontends.zoo import build_zoo
from tremula.ir import run
from tremula.numerics.fp8 import Fp8Format
from tremula.passes import canonicalize
from tremula.passes.precision import Fp8Policy, activation_casts, calibrate_fp8, fp8_linear_casts, layer_losses


def _cos(a, b):
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_every_linear_reads_fp8_operands_and_weights_stay_lazy():
    g = canonicalize(build_zoo("vit-tiny"))
    q = fp8_linear_casts(g)
    linears = [n for n in q.nodes if n.op == "Linear"]
    prod = q.producers()
    assert linears and all(prod[n.inputs[0]].op == "Fp8Cast" and prod[n.inputs[1]].op == "Fp8Cast" for n in linears)
    assert all(c.is_lazy for c in q.constants.values() if c.type.size > 1024)
    assert not any(n.op == "Fp8Cast" for n in g.nodes)  # the input graph is untouched


def test_calibration_sets_scales_that_fit_the_observed_range():
    g = fp8_linear_casts(canonicalize(build_zoo("vit-tiny", batch=2)))
    feeds = make_feeds(g, seed=1)
    cal = calibrate_fp8(g, feeds)
    casts = activation_casts(cal)
    assert casts and all(isinstance(n.attrs["scale"], int) for n in casts)
    vals = run(cal, feeds, keep={n.inputs[0] for n in casts})
    for n in casts:
        m = float(np.max(np.abs(vals[n.inputs[0]])))
        assert m * 2.0 ** -n.attrs["scale"] <= Fp8Format.parse(n.attrs["fmt"]).max


def test_fp8_model_stays_close_to_float32_and_reports_layer_losses():
    g = canonicalize(build_zoo("vit-tiny", batch=2))
    feeds = make_feeds(g, seed=2)
    ref = run(g, feeds)
    q = calibrate_fp8(fp8_linear_casts(g), feeds)
    got = run(q, feeds)
    for o in g.outputs:
        assert _cos(ref[o], got[o]) > 0.99
        assert not np.array_equal(ref[o], got[o])  # the casts really round
    losses = layer_losses(q, feeds)
    assert len(losses) == sum(n.op == "Linear" for n in q.nodes)
    assert all(0.9 < r.cosine <= 1.0 + 1e-12 for r in losses)
    assert losses == sorted(losses, key=lambda r: r.cosine)


def test_policy_parse():
    p = Fp8Policy.parse("F152,F143")
    assert (p.act_fmt, p.weight_fmt) == (Fp8Format.F152, Fp8Format.F143)

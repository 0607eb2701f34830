"""The FP8 precision pass: where casts go, calibration of activation scales, and per-layer loss."""

import numpy as np

from tremula.feeds import make_feeds
from tremula.frontends.zoo import build_zoo
from tremula.ir import run
from tremula.numerics.fp8 import Fp8Format, fp8_format, is_fp8
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


def test_calibration_sees_each_value_as_made_and_keeps_none():
    """The scales come from each cast input's max-abs seen as the interpreter makes it (run's observe), not from the
    values kept to the end: the same scales as kept values give, and observe sees every input and every node output
    once."""
    from tremula.numerics.fp8 import scale_for_max_abs
    from tremula.passes.precision import calibration_scales

    g = fp8_linear_casts(canonicalize(build_zoo("bert-tiny", batch=2)))
    feeds = make_feeds(g, seed=1)
    casts = activation_casts(g)
    kept = run(g, feeds, keep={n.inputs[0] for n in casts})
    want = {n.name: scale_for_max_abs(float(np.max(np.abs(kept[n.inputs[0]]))), Fp8Format.parse(n.attrs["fmt"]))
            for n in casts}
    assert calibration_scales(g, feeds) == want
    seen = []
    out = run(g, feeds, observe=lambda name, v: seen.append(name))
    assert seen == list(g.inputs) + [o for n in g.nodes for o in n.outputs] and set(out) == set(g.outputs)


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


def _storage(model="vit-tiny", batch=2):
    from tremula.passes.precision import calibration_scales, fp8_storage, with_scales
    from tremula.pipeline import cast_graph

    # Calibrate on a separately built graph, as the compiler does, so this one's weights stay lazy.
    cal = fp8_linear_casts(canonicalize(build_zoo(model, batch=1)))
    scales = calibration_scales(cal, make_feeds(cal, seed=1))
    g = canonicalize(build_zoo(model, batch=batch))
    qdq = cast_graph(with_scales(fp8_linear_casts(g), scales), "float16")
    return g, qdq, fp8_storage(qdq, group=32)


def test_storage_form_replaces_every_fp8_linear_and_keeps_weights_lazy():
    g, qdq, s = _storage()
    ops = [n.op for n in s.nodes]
    assert ops.count("LinearFp8") == sum(n.op == "Linear" for n in g.nodes) and "Linear" not in ops
    assert "Fp8Cast" not in ops
    # Each activation is quantised once, before it fans out: Q, K and V are one fused matmul (passes/fuse_qkv.py)
    # reading one quantised activation, as every other Linear reads its own.
    quantized = [n for n in s.nodes if n.op == "Fp8Quantize"]
    assert len(quantized) == len({n.inputs[0] for n in s.nodes if n.op == "LinearFp8"}) == ops.count("LinearFp8")
    assert any(s.types[n.inputs[1]].shape == (32, 96) for n in s.nodes if n.op == "LinearFp8")
    derived = [c for c in s.constants.values() if is_fp8(c.type.dtype) or c.type.dtype == "int8"]
    assert derived and all(c.is_lazy for c in derived)
    assert all(c.init.source.is_lazy for c in derived)  # planning made neither the codes nor the float weight
    # One byte per weight: the FP8 graph's weights take a little over half the bytes of the fp16 graph's.
    assert s.param_bytes() < 0.6 * qdq.param_bytes()


def test_storage_form_computes_what_the_qdq_form_means():
    from tremula.ir import GraphBuilder
    from tremula.passes.precision import fp8_storage
    from tremula.pipeline import cast_graph

    b = GraphBuilder("one_linear", seed=4)
    x = b.input("x", (3, 16, 256))
    y = b.op("Linear", [x, b.param("w", (256, 96), std=0.05), b.param("bias", (96,), std=0.1)])
    b.output(b.op("Relu", [y]))
    g = b.build()
    feeds = make_feeds(g, seed=0)
    qdq = cast_graph(calibrate_fp8(fp8_linear_casts(g), feeds), "float16")
    s = fp8_storage(qdq, group=32)
    assert [n.op for n in s.nodes] == ["Fp8Quantize", "LinearFp8", "Relu"]
    half = {"x": feeds["x"].astype(np.float16)}
    a, c = (run(h, half)[g.outputs[0]].astype(np.float32) for h in (qdq, s))
    # Same operands; the AMP rounds its running sum to half after each of the 8 groups of 32 where the QDQ form sums
    # in float32: a few half ulps of the output's magnitude, and no more.
    assert np.max(np.abs(a - c)) <= 8 * 2.0 ** -11 * np.max(np.abs(a))
    assert np.mean(a != c) < 0.5


def test_storage_form_is_as_accurate_as_the_qdq_form_on_a_whole_model():
    g, qdq, s = _storage()
    feeds = make_feeds(g, seed=0)
    half = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()}
    ref, a, b = run(g, feeds), run(qdq, half), run(s, half)
    for o in g.outputs:  # FP8 rounding upstream flips codes downstream, so compare both with float32
        assert _cos(b[o], ref[o]) > 0.99 and abs(_cos(b[o], ref[o]) - _cos(a[o], ref[o])) < 1e-3, o


def test_weight_codes_and_scale_come_from_the_weights_max_abs():
    s = _storage()[2]
    lin = next(n for n in s.nodes if n.op == "LinearFp8")
    codes, scale = s.constants[lin.inputs[1]], s.constants[lin.inputs[2]]
    w = codes.init.source.value().astype(np.float32)
    sc = int(scale.value()[0, 0])
    fmt = fp8_format(codes.type.dtype)  # FP8 is a dtype: the weight's says its format
    assert codes.value().dtype == fmt.np_dtype
    decoded = codes.value().astype(np.float32) * 2.0 ** sc
    assert np.max(np.abs(w)) * 2.0 ** -sc <= fmt.max < 2 * np.max(np.abs(w)) * 2.0 ** -sc
    np.testing.assert_allclose(decoded, w, rtol=2 ** -3, atol=2.0 ** (sc - 10))  # 3 mantissa bits


def test_layer_closeness_in_chunks_is_the_whole_formula_and_a_nan_is_the_worst():
    from tremula.passes.precision import _closeness

    rng = np.random.default_rng(2)
    exact = rng.standard_normal((37, 11)).astype(np.float32)
    got = exact + np.float32(0.01) * rng.standard_normal((37, 11)).astype(np.float32)
    e, g = exact.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    cos = e @ g / (np.linalg.norm(e) * np.linalg.norm(g))
    err = np.max(np.abs(g - e)) / np.max(np.abs(e))
    for chunk in (1 << 20, 50, 1):
        c, r = _closeness(exact, got, chunk)
        assert abs(c - cos) < 1e-12 and r == err
    got[5, 3] = np.nan
    assert _closeness(exact, got) == (float("-inf"), float("inf"))

"""Every canonical op: the reference interpreter vs onnxruntime on the exported ONNX, with attribute variants."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tremula.export import export_onnx
from tremula.ir import OPS, Graph, GraphBuilder, run
from tremula.numerics.fp8 import is_fp8

Gen = Callable[[np.random.Generator], np.ndarray]  # makes one operand from the case's generator
CASES: dict[str, dict[str, Callable[[np.random.Generator], tuple[Graph, dict[str, np.ndarray]]]]] = {}


def add(op: str, variant: str, *specs, **attrs) -> None:
    """Register a one-node case. specs: ("in", gen) fed input, ("const", gen) constant, "" omitted optional input;
    gen is an array or a Gen. Generators are made by the factories below, so no closure sees a loop variable."""
    CASES.setdefault(op, {})[variant] = lambda rng: _one_op(op, specs, rng, **attrs)


def randn(*shape: int, scale: float = 1.0, dtype: str = "float32") -> Gen:
    return lambda rng: (rng.standard_normal(shape) * scale).astype(dtype)


def rounded(*shape: int) -> Gen:  # small integers as floats, so comparisons see ties
    return lambda rng: np.round(rng.standard_normal(shape) * 1.5).astype("float32")


def positive(*shape: int, low: float = 0.05, high: float = 5.0) -> Gen:
    return lambda rng: rng.uniform(low, high, shape).astype("float32")


def nonzero(*shape: int, dtype: str = "float32") -> Gen:
    if dtype.startswith("int"):
        return lambda rng: (rng.integers(1, 9, shape) * rng.choice([-1, 1], shape)).astype(dtype)
    return lambda rng: (rng.uniform(0.5, 2.0, shape) * rng.choice([-1, 1], shape)).astype(dtype)


def ints(low: int, high: int, *shape: int) -> Gen:
    return lambda rng: rng.integers(low, high, shape)


def bools(*shape: int) -> Gen:
    return lambda rng: rng.random(shape) < 0.5


def _one_op(op: str, specs, rng, **attrs) -> tuple[Graph, dict[str, np.ndarray]]:
    b = GraphBuilder(f"t_{op}")
    feeds, names = {}, []
    for i, spec in enumerate(specs):
        if spec == "":
            names.append("")
            continue
        kind, gen = spec
        arr = np.asarray(gen(rng) if callable(gen) else gen)
        if kind == "in":
            names.append(b.input(f"x{i}", arr.shape, str(arr.dtype)))
            feeds[f"x{i}"] = arr
        else:
            names.append(b.const(f"c{i}", arr))
    outs = b.op(op, names, **attrs)
    for o in outs if isinstance(outs, list) else [outs]:
        b.output(o)
    return b.build(), feeds


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    onnx.checker.check_model(model, full_check=True)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1  # the test machine is shared
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # check the exported ops as written
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    feeds = {k: v.view(np.uint8) if is_fp8(v.dtype) else v for k, v in feeds.items()}  # FP8 goes in as its codes
    return dict(zip(names, sess.run(names, feeds)))


def check(graph: Graph, feeds: dict[str, np.ndarray], opset: int = 17) -> None:
    ref = run(graph, feeds)
    got = run_ort(export_onnx(graph, opset), feeds)
    for name in graph.outputs:
        r, g = np.asarray(ref[name]), np.asarray(got[name])
        if is_fp8(r.dtype):  # the export keeps FP8 as its uint8 codes (export/onnx_export._codes): compare codes
            r = r.view(np.uint8)
        assert g.dtype == r.dtype, f"{name}: onnxruntime gives {g.dtype}, reference {r.dtype}"
        assert g.shape == r.shape, f"{name}: onnxruntime gives {g.shape}, reference {r.shape}"
        if r.dtype.kind == "f":
            # atol: a few outputs (Gelu at large negative x, Sub of near-equal values) are O(1e-7) after cancellation.
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(g, r, err_msg=name)


# --------------------------------------------------------------------------------------------------------- element-wise

for op in ("Add", "Sub", "Mul", "Max", "Min"):
    add(op, "f32_same", ("in", randn(2, 3, 4)), ("in", randn(2, 3, 4)))
    add(op, "f32_bcast", ("in", randn(2, 3, 4)), ("in", randn(3, 1)))
    add(op, "f32_bcast_left", ("in", randn(4)), ("in", randn(2, 1, 4)))
    add(op, "i64", ("in", ints(-50, 50, 3, 4)), ("in", ints(-50, 50, 4)))
    add(op, "const_operand", ("in", randn(2, 5)), ("const", randn(5)))
add("Div", "f32_bcast", ("in", randn(2, 3, 4)), ("in", nonzero(3, 1)))
add("Div", "i64_negative_truncates", ("in", ints(-100, 100, 4, 5)), ("in", nonzero(4, 5, dtype="int64")))
add("Mod", "f32_fmod", ("in", randn(3, 4, scale=5)), ("in", nonzero(4)))
add("Mod", "i64_fmod", ("in", ints(-100, 100, 4, 5)), ("in", nonzero(4, 5, dtype="int64")))
add("Pow", "f32_positive_base", ("in", positive(3, 4, low=0.1, high=3)), ("in", randn(4)))
add("Pow", "f32_square_scalar", ("in", randn(3, 4)), ("const", np.array(2.0, np.float32)))

for op in ("Equal", "Less", "Greater"):
    add(op, "f32_bcast", ("in", rounded(2, 3, 4)), ("in", rounded(3, 1)))
    add(op, "i64", ("in", ints(0, 3, 5)), ("in", ints(0, 3, 4, 5)))
for op in ("And", "Or"):
    add(op, "bool_bcast", ("in", bools(3, 4)), ("in", bools(4)))

# Every element-wise unary op with an ONNX op of its name, on the inputs its row says it is defined on: a new row is
# checked against onnxruntime without a line here.
_DOMAIN = {"real": ("f32", randn(3, 7, scale=2)), "positive": ("f32_positive", positive(3, 7)),
           "bool": ("bool", bools(3, 5))}
for op, d in OPS.items():
    if d.codelet == "unary" and d.export == "direct" and d.domain:
        variant, gen = _DOMAIN[d.domain]
        add(op, variant, ("in", gen))
for op in ("Neg", "Abs", "Identity"):
    add(op, "i64", ("in", ints(-9, 9, 4, 3)))
add("Identity", "bool", ("in", bools(2)))

for src, dst in [
    ("float32", "int64"),
    ("int64", "float32"),
    ("float32", "bool"),
    ("bool", "float32"),
    ("float32", "float16"),
    ("int64", "int32"),
    ("float16", "float32"),
]:
    add("Cast", f"{src}_to_{dst}", ("in", randn(3, 4, scale=4, dtype=src)), to=dst)

add("Where", "bcast", ("in", bools(3, 1)), ("in", randn(2, 3, 4)), ("in", randn(4)))
add("Where", "const_minus_inf", ("in", bools(3, 4)), ("in", randn(3, 4)), ("const", np.array(-np.inf, np.float32)))

# -------------------------------------------------------------------------------------------------------- matmul family

add("MatMul", "2d", ("in", randn(3, 5)), ("in", randn(5, 4)))
add("MatMul", "batched_bcast", ("in", randn(2, 1, 3, 5)), ("in", randn(4, 5, 6)))
add("MatMul", "vectors", ("in", randn(5)), ("in", randn(2, 5, 3)))
add("MatMul", "matrix_vector", ("in", randn(2, 3, 5)), ("const", randn(5)))
add("Linear", "bias", ("in", randn(2, 3, 8)), ("const", randn(8, 5)), ("const", randn(5)))
add("Linear", "no_bias", ("in", randn(4, 8)), ("const", randn(8, 6)), "")

# ----------------------------------------------------------------------------------------------------------- reductions

for op in ("ReduceMean", "ReduceSum", "ReduceMax"):
    for name, axes in {"last": [-1], "two_axes": [0, 2], "all": None}.items():
        for keep in (0, 1):
            add(op, f"{name}_keep{keep}", ("in", randn(3, 4, 5)), axes=axes, keepdims=keep)
add("ReduceSum", "i64", ("in", ints(-9, 9, 3, 4)), axes=[1], keepdims=0)
for axis in (-1, 0, 1):
    add("Softmax", f"axis_{axis}", ("in", randn(3, 4, 5, scale=3)), axis=axis)

# ------------------------------------------------------------------------------------------------------------ fused ops

add("LayerNorm", "bias", ("in", randn(2, 3, 16, scale=3)), ("const", randn(16)), ("const", randn(16)), epsilon=1e-5)
add("LayerNorm", "no_bias_eps", ("in", randn(4, 8)), ("const", randn(8)), epsilon=1e-3)
for approx in ("none", "tanh"):
    add("Gelu", approx, ("in", randn(4, 33, scale=2)), approximate=approx)


def mask(*shape: int) -> Gen:  # additive: 0 or a large negative, as a padding mask is
    return lambda rng: np.where(rng.random(shape) < 0.2, -1e4, 0.0).astype("float32")


def attention(variant: str, lead: tuple[int, ...], sq: int, sk: int, d: int, dv: int, mask_shape=None, causal=0):
    specs = [("in", randn(*lead, sq, d)), ("in", randn(*lead, sk, d)), ("in", randn(*lead, sk, dv))]
    if mask_shape is not None:
        specs.append(("in", mask(*mask_shape)))
    add("Attention", variant, *specs, scale=1 / math.sqrt(d), causal=causal)


attention("plain", (2, 3), 5, 5, 8, 8)
attention("rank3_dv", (2,), 4, 6, 8, 3)
attention("mask_bcast", (2, 3), 5, 5, 8, 8, mask_shape=(2, 1, 1, 5))
attention("mask_full", (2, 3), 4, 6, 8, 8, mask_shape=(2, 3, 4, 6))
attention("causal", (1, 2), 6, 6, 4, 4, causal=1)
attention("causal_sq_lt_sk", (1, 2), 3, 7, 4, 4, causal=1)
attention("causal_mask", (2, 2), 3, 7, 4, 4, mask_shape=(2, 1, 1, 7), causal=1)

add("Patchify", "exact", ("in", randn(2, 3, 8, 12)), patch=(4, 4))
add("Patchify", "ragged_rect", ("in", randn(1, 2, 9, 11)), patch=(2, 3))

# ---------------------------------------------------------------------------------------------------------- convolution

add("Conv", "plain", ("in", randn(2, 3, 8, 8)), ("const", randn(4, 3, 3, 3)))
add(
    "Conv",
    "pads_strides_bias",
    ("in", randn(1, 3, 9, 7)),
    ("const", randn(6, 3, 3, 2)),
    ("const", randn(6)),
    pads=(1, 0, 2, 1),
    strides=(2, 3),
)
add(
    "Conv",
    "group_dilation",
    ("in", randn(1, 4, 10, 10)),
    ("const", randn(6, 2, 3, 3)),
    ("const", randn(6)),
    group=2,
    dilations=(2, 1),
)
add("Conv", "depthwise", ("in", randn(1, 4, 6, 6)), ("const", randn(4, 1, 3, 3)), group=4, pads=(1, 1, 1, 1))
add(
    "Conv",
    "patch_embed",
    ("in", randn(2, 3, 16, 16)),
    ("const", randn(8, 3, 4, 4)),
    ("const", randn(8)),
    strides=(4, 4),
)

# -------------------------------------------------------------------------------------------------------- data movement

add("Reshape", "f32", ("in", randn(2, 3, 4)), shape=(6, 2, 2))
add("Reshape", "i64_flatten", ("in", ints(0, 9, 2, 3, 4)), shape=(24,))
add("Reshape", "zero_size", ("in", randn(2, 0, 3)), shape=(0, 6))
add("Transpose", "perm", ("in", randn(2, 3, 4, 5)), perm=(0, 2, 3, 1))
add("Transpose", "default_reverse", ("in", randn(2, 3, 4)))
add("Concat", "three_axis1", ("in", randn(2, 1, 3)), ("const", randn(2, 4, 3)), ("in", randn(2, 2, 3)), axis=1)
add("Concat", "negative_axis_i64", ("in", ints(0, 9, 2, 3)), ("in", ints(0, 9, 2, 1)), axis=-1)

_SLICES = {
    "simple": dict(starts=[1], ends=[3], axes=[1]),
    "huge_end_multi_axis": dict(starts=[0, 1], ends=[2**63 - 1, 2**63 - 1], axes=[0, 2]),
    "negative_start_end": dict(starts=[-3], ends=[-1], axes=[-1]),
    "step2": dict(starts=[0], ends=[6], axes=[2], steps=[2]),
    "reverse_all": dict(starts=[-1], ends=[-(2**63)], axes=[2], steps=[-1]),
    "reverse_step2": dict(starts=[5], ends=[0], axes=[2], steps=[-2]),
    "reverse_partial_neg_end": dict(starts=[4], ends=[-6], axes=[-1], steps=[-1]),
    "empty": dict(starts=[3], ends=[1], axes=[1]),
}
for name, attrs in _SLICES.items():
    add("Slice", name, ("in", randn(3, 4, 6)), **attrs)

add("Split", "three_ways", ("in", randn(2, 9, 3)), axis=1, sizes=[2, 3, 4])
add("Split", "last_axis_i64", ("in", ints(0, 9, 2, 6)), axis=-1, sizes=[3, 3])
add("Gather", "embedding", ("const", randn(10, 4)), ("in", ints(-10, 10, 2, 5)), axis=0)
add("Gather", "axis1_scalar_index", ("in", randn(3, 5, 2)), ("const", np.array(-2, np.int64)), axis=1)
add("Expand", "bcast", ("in", randn(3, 1)), shape=(2, 3, 4))
add("Expand", "shape_smaller_rank", ("in", ints(0, 9, 2, 1, 4)), shape=(3, 1))

# ----------------------------------------------------------------------------------------------------- shape arithmetic

add("Shape", "full", ("in", randn(2, 3, 4)))
add("Shape", "start_end", ("in", randn(2, 3, 4, 5)), start=1, end=-1)
add("Range", "i64", ("const", np.array(2)), ("const", np.array(11)), ("const", np.array(3)), length=3)
add(
    "Range",
    "f32_negative_delta",
    ("const", np.float32(1.0)),
    ("const", np.float32(-2.0)),
    ("const", np.float32(-0.5)),
    length=6,
)
for upper in (0, 1):
    for k in (-1, 0, 2):
        add("Trilu", f"upper{upper}_k{k}", ("in", randn(2, 4, 5)), upper=upper, k=k)
add("Trilu", "bool_mask", ("const", np.ones((5, 5), bool)), upper=0)
add("CumSum", "f32_axis0", ("in", randn(4, 3)), axis=0)
add("CumSum", "i64_last", ("in", ints(0, 2, 2, 7)), axis=-1)


def halves(*shape: int, scale: float = 1.0, dtype: str = "float32") -> Gen:
    """Values that are exact halves: the IPU casts to FP8 through half, ONNX directly; on halves they agree."""
    return lambda rng: np.clip(rng.standard_normal(shape) * scale, -65000, 65000).astype("float16").astype(dtype)


add("Fp8Cast", "f143_scaled", ("in", halves(4, 6, scale=3.0)), fmt="F143", scale=-4)
add("Fp8Cast", "f152_saturates", ("in", halves(4, 6, scale=3e4)), fmt="F152", scale=0)
add("Fp8Cast", "f143_weight_scale_from_max_abs", ("const", halves(5, 7, scale=0.02)), fmt="F143", scale=None)
add("Fp8Quantize", "f143_scaled", ("in", halves(4, 6, scale=3.0)), fmt="F143", scale=-4)
add("Fp8Quantize", "f152_saturates_half_input", ("in", halves(3, 8, scale=3e4, dtype="float16")), fmt="F152", scale=2)


def fp8_codes(fmt: str, *shape: int, low: int = -3, high: int = 4) -> Gen:
    """Codes of small integers: every product and partial sum is exact, so ONNX's float32 MatMul agrees with the
    AMP's half partials bit for bit (rounding of real partials is tested against amp_fp8_matmul in tests/unit)."""
    from tremula.numerics.fp8 import Fp8Format, quantize

    f = Fp8Format.parse(fmt)
    return lambda rng: quantize(rng.integers(low, high, shape).astype(np.float32), f).view(f.np_dtype)


add("LinearFp8", "two_groups_bias", ("in", fp8_codes("F143", 2, 3, 64)), ("const", fp8_codes("F143", 64, 5)),
    ("const", np.array([[-2]], np.int8)), ("const", lambda rng: rng.integers(-8, 8, 5).astype(np.float16)),
    x_fmt="F143", w_fmt="F143", x_scale=-1, group=32)
add("LinearFp8", "f152_weights_no_bias", ("in", fp8_codes("F143", 6, 16)), ("const", fp8_codes("F152", 16, 4)),
    ("const", np.array([[3]], np.int8)), x_fmt="F143", w_fmt="F152", x_scale=0, group=32)
OPSET_OF = {"Fp8Cast": 19, "Fp8Quantize": 19}  # QuantizeLinear to an FP8 type needs opset 19


# ------------------------------------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("op", sorted(OPS))
def test_op_matches_onnxruntime(op: str) -> None:
    variants = CASES.get(op)
    assert variants, f"op {op!r} has a row in OPS but no case here; add one"
    for variant, make in variants.items():
        rng = np.random.default_rng(zlib.crc32(f"{op}/{variant}".encode()))  # stable per case (hash() is salted)
        graph, feeds = make(rng)
        try:
            check(graph, feeds, opset=OPSET_OF.get(op, 17))
        except AssertionError as e:
            raise AssertionError(f"{op}[{variant}]: {e}") from None


def test_cases_name_only_real_ops() -> None:
    assert set(CASES) <= set(OPS), f"cases for ops not in OPS: {sorted(set(CASES) - set(OPS))}"


@pytest.mark.parametrize("opset", [18, 21])
def test_reductions_export_axes_as_inputs_in_newer_opsets(opset: int) -> None:
    rng = np.random.default_rng(0)
    for op in ("ReduceMean", "ReduceMax", "ReduceSum"):
        graph, feeds = _one_op(op, [("in", randn(3, 4, 5))], rng, axes=[0, -1], keepdims=0)
        check(graph, feeds, opset=opset)


def test_float16_matches_reference_accumulating_in_float32() -> None:
    rng = np.random.default_rng(1)
    b = GraphBuilder("f16")
    x = b.input("x", (2, 4, 16), "float16")
    w = b.const("w", randn(16, 8, dtype="float16")(rng))
    y = b.op("Linear", [x, w, b.const("bias", randn(8, dtype="float16")(rng))])
    y = b.op("Gelu", [y])
    b.output(b.op("Softmax", [y], axis=-1))
    graph = b.build()
    feeds = {"x": randn(2, 4, 16, dtype="float16")(rng)}
    ref = run(graph, feeds)[graph.outputs[0]]
    got = run_ort(export_onnx(graph), feeds)[graph.outputs[0]]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=2e-3, atol=1e-4)


def test_lazy_constants_become_initializers_without_touching_the_graph() -> None:
    b = GraphBuilder("lazy", seed=3)
    x = b.input("x", (2, 8))
    w = b.param("w", (8, 4), std=0.5)
    b.output(b.op("MatMul", [x, w]))
    graph = b.build()
    model = export_onnx(graph)
    assert graph.constants["w"].is_lazy  # exporting did not cache the values in the Graph
    (init,) = [t for t in model.graph.initializer if t.name == "w"]
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(init), graph.constants["w"].init.make(graph.types["w"]))
    feeds = {"x": randn(2, 8)(np.random.default_rng(0))}
    check(graph, feeds)

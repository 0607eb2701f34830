"""ONNX import: every converter on a hand-built model against onnxruntime, folding, dynamic dims, functions."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tremula.errors import TremulaError
from tremula.frontends.onnx_import import import_onnx
from tremula.frontends.onnx_ops import CONVERTERS, since_versions
from tremula.ir import OPS, run

F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def make_model(
    nodes,
    inputs: dict[str, np.ndarray],
    outputs: list[tuple[str, int]],
    inits: dict | None = None,
    opset: int = 17,
    functions=(),
    extra_opsets=(),
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A model whose inputs take the shapes and types of the given arrays; outputs are (name, elem type)."""
    vin = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
        for k, v in inputs.items()
    ]
    vout = [helper.make_tensor_value_info(n, t, None) for n, t in outputs]
    init = [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()]
    g = helper.make_graph(nodes, "t", vin, vout, init)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), *extra_opsets], functions=list(functions))
    m.ir_version = 8
    return m, inputs


def i64(*v) -> np.ndarray:
    return np.asarray(v, np.int64)


def node(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, **attrs)


Case = Callable[[np.random.Generator], tuple[onnx.ModelProto, dict[str, np.ndarray]]]
CASES: dict[str, Case] = {}


def case(name: str):
    def deco(fn: Case) -> Case:
        CASES[name] = fn
        return fn

    return deco


# ------------------------------------------------------------------------------------------------------------ the cases


@case("elementwise_float")
def _(rng):
    x, y, z = (rng.standard_normal(s).astype(np.float32) for s in [(3, 4), (4,), (3, 1)])
    p = rng.uniform(0.2, 3, (3, 4)).astype(np.float32)
    binary = ["Add", "Sub", "Mul", "Div", "MatMul"]
    # every float unary op imported as itself, on the inputs its row says it is defined on (ir/ops.py)
    unary = {op: d.domain for op, d in OPS.items() if d.onnx == "direct" and d.codelet == "unary" and d.domain != "bool"}
    nodes = [node(op, ["x", "y" if op != "MatMul" else "w"], [op]) for op in binary]
    nodes += [node(op, ["p" if domain == "positive" else "x"], [op]) for op, domain in unary.items()]
    nodes += [
        node("Pow", ["p", "y"], ["Pow"]),
        node("Max", ["x", "y", "z"], ["Max"]),
        node("Min", ["x", "z"], ["Min"]),
        node("Sum", ["x", "y", "z"], ["Sum"]),
        node("Max", ["x"], ["Max1"]),
    ]
    outs = [n.output[0] for n in nodes]
    return make_model(
        nodes,
        {"x": x, "y": y, "z": z, "p": p},
        [(o, F) for o in outs],
        {"w": rng.standard_normal((4, 2)).astype(np.float32)},
    )


@case("compare_logic")
def _(rng):
    x, y = (
        np.round(rng.standard_normal((3, 4))).astype(np.float32),
        np.round(rng.standard_normal((4,))).astype(np.float32),
    )
    a, b = rng.random((3, 4)) < 0.5, rng.random((4,)) < 0.5
    n = x.copy()
    n[0, 1] = np.nan
    cmp = ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"]
    nodes = [node(op, ["x", "y"], [op]) for op in cmp]
    nodes += [node(op, ["a", "b"], [op]) for op in ("And", "Or", "Xor")]
    nodes += [node("Not", ["a"], ["Not"]), node("IsNaN", ["n"], ["IsNaN"]), node("Where", ["a", "x", "y"], ["Where"])]
    outs = [(nd.output[0], F if nd.op_type == "Where" else BOOL) for nd in nodes]
    return make_model(nodes, {"x": x, "y": y, "a": a, "b": b, "n": n}, outs)


@case("mod_and_cast")
def _(rng):
    a = rng.integers(-50, 50, (3, 5))
    d = rng.integers(1, 7, (5,)) * rng.choice([-1, 1], (5,))
    x = (rng.standard_normal((3, 5)) * 5).astype(np.float32)
    nodes = [
        node("Mod", ["a", "d"], ["floor_mod"]),
        node("Mod", ["a", "d"], ["c_mod"], fmod=1),
        node("Mod", ["x", "dfl"], ["f_mod"], fmod=1),
        node("Cast", ["x"], ["to_int"], to=I64),
        node("CastLike", ["a", "x"], ["like"]),
        node("Cast", ["x"], ["same"], to=F),
    ]
    return make_model(
        nodes,
        {"a": a, "d": d, "x": x},
        [("floor_mod", I64), ("c_mod", I64), ("f_mod", F), ("to_int", I64), ("like", F), ("same", F)],
        {"dfl": np.float32(1.5)},
    )


@case("shape_noise")
def _(rng):
    # The legacy exporter's way of writing x.view(x.size(0), -1, 4): it must fold down to one static Reshape.
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    nodes = [
        node("Shape", ["x"], ["shp"]),
        node("Gather", ["shp", "zero"], ["b"], axis=0),
        node("Unsqueeze", ["b", "axes0"], ["b1"]),
        node("Concat", ["b1", "tail"], ["newshape"], axis=0),
        node("Reshape", ["x", "newshape"], ["r"]),
        node("Size", ["x"], ["n"]),
        node("Cast", ["n"], ["nf"], to=F),
        node("Div", ["nf", "three"], ["q"]),
        node("Floor", ["q"], ["fl"]),
        node("Ceil", ["q"], ["ce"]),
        node("Round", ["q"], ["ro"]),
        node("Sign", ["q"], ["sg"]),
        node("Add", ["fl", "ce"], ["s1"]),
        node("Add", ["s1", "ro"], ["s2"]),
        node("Mul", ["s2", "sg"], ["s3"]),
        node("Shape", ["x"], ["last"], start=-1),
        node("ConstantOfShape", ["last"], ["ones"], value=numpy_helper.from_array(np.array([1.0], np.float32))),
        node("Range", ["zero", "eight", "one"], ["rng"]),
        node("Cast", ["rng"], ["rngf"], to=F),
        node("NonZero", ["nzsrc"], ["nz"]),
        node("Cast", ["nz"], ["nzf"], to=F),
        node("ReduceSum", ["nzf"], ["nzs"], keepdims=0),
        node("Add", ["rngf", "nzs"], ["t1"]),
        node("Mul", ["t1", "ones"], ["t2"]),
        node("Mul", ["t2", "s3"], ["t3"]),
        node("Add", ["x", "t3"], ["y"]),
        node("Shape", ["y"], ["ys"]),
        node("Gather", ["ys", "two"], ["d2"]),  # scalar index: a scalar result
        node("Unsqueeze", ["d2", "axes0"], ["d2v"]),
        node("Concat", ["d2v", "minus1"], ["shape2"], axis=0),
        node("Reshape", ["y", "shape2"], ["out"]),
    ]
    inits = {
        "zero": i64(0),
        "axes0": i64(0),
        "tail": i64(-1, 4),
        "three": np.float32(3),
        "eight": np.int64(8),
        "one": np.int64(1),
        "two": np.int64(2),
        "minus1": i64(-1),
        "nzsrc": np.array([[0, 1, 1], [1, 0, 0]]),
    }
    inits["zero"] = np.int64(0)
    return make_model(nodes, {"x": x}, [("r", F), ("out", F)], inits)


@case("gemm")
def _(rng):
    a, c = rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal((4,)).astype(np.float32)
    nodes = [
        node("Gemm", ["a", "wt", "c"], ["g1"], transB=1, alpha=0.5, beta=2.0),
        node("Gemm", ["at", "w"], ["g2"], transA=1),
        node("Gemm", ["a", "w", "c"], ["g3"]),
    ]
    inits = {
        "wt": rng.standard_normal((4, 5)).astype(np.float32),
        "w": rng.standard_normal((5, 4)).astype(np.float32),
        "at": rng.standard_normal((5, 3)).astype(np.float32),
    }
    return make_model(nodes, {"a": a, "c": c}, [("g1", F), ("g2", F), ("g3", F)], inits)


@case("reduce_opset13_axes_attr")
def _(rng):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    nodes = [
        node("ReduceMean", ["x"], ["m"], axes=[-1], keepdims=1),
        node("ReduceMax", ["x"], ["mx"], axes=[0, 2], keepdims=0),
        node("ReduceMin", ["x"], ["mn"], axes=[1]),
        node("ReduceSum", ["x", "ax"], ["s"], keepdims=0),
        node("ReduceMean", ["x"], ["all"], keepdims=0),
        node("Softmax", ["x"], ["sm"], axis=1),
    ]
    return make_model(nodes, {"x": x}, [(n.output[0], F) for n in nodes], {"ax": i64(-1)}, opset=13)


@case("reduce_opset18_axes_input")
def _(rng):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    nodes = [
        node("ReduceMean", ["x", "ax"], ["m"]),
        node("ReduceMax", ["x", "ax2"], ["mx"], keepdims=0),
        node("ReduceMin", ["x", "ax"], ["mn"]),
        node("ReduceSum", ["x", "empty"], ["noop"], noop_with_empty_axes=1),
        node("ReduceSum", ["x"], ["all"]),
    ]
    return make_model(
        nodes,
        {"x": x},
        [(n.output[0], F) for n in nodes],
        {"ax": i64(-1), "ax2": i64(0, 2), "empty": np.zeros((0,), np.int64)},
        opset=18,
    )


@case("layernorm_gelu_opset20")
def _(rng):
    x = rng.standard_normal((2, 3, 8)).astype(np.float32) * 2
    nodes = [
        node("LayerNormalization", ["x", "g", "b"], ["ln"], axis=-1, epsilon=1e-6),
        node("LayerNormalization", ["x", "g"], ["ln_nobias"], axis=2),
        node("Gelu", ["ln"], ["ge"]),
        node("Gelu", ["x"], ["gt"], approximate="tanh"),
    ]
    inits = {"g": rng.standard_normal((8,)).astype(np.float32), "b": rng.standard_normal((8,)).astype(np.float32)}
    return make_model(nodes, {"x": x}, [("ln", F), ("ln_nobias", F), ("ge", F), ("gt", F)], inits, opset=20)


@case("conv")
def _(rng):
    x = rng.standard_normal((1, 4, 9, 8)).astype(np.float32)
    inits = {
        "w": rng.standard_normal((6, 2, 3, 3)).astype(np.float32),
        "b": rng.standard_normal((6,)).astype(np.float32),
        "w1": rng.standard_normal((5, 4, 3, 2)).astype(np.float32),
    }
    nodes = [
        node("Conv", ["x", "w", "b"], ["c1"], group=2, pads=[1, 0, 2, 1], strides=[2, 1], kernel_shape=[3, 3]),
        node("Conv", ["x", "w1"], ["c2"], auto_pad="SAME_UPPER", strides=[2, 2]),
        node("Conv", ["x", "w1"], ["c3"], auto_pad="VALID", dilations=[2, 1]),
    ]
    return make_model(nodes, {"x": x}, [("c1", F), ("c2", F), ("c3", F)], inits)


@case("reshape_family")
def _(rng):
    x = rng.standard_normal((2, 1, 3, 4)).astype(np.float32)
    nodes = [
        node("Reshape", ["x", "s0"], ["r0"]),
        node("Flatten", ["x"], ["f2"], axis=2),
        node("Flatten", ["x"], ["f0"], axis=0),
        node("Squeeze", ["x", "sq"], ["sq1"]),
        node("Squeeze", ["x"], ["sq_all"]),
        node("Unsqueeze", ["x", "us"], ["us1"]),
        node("Transpose", ["x"], ["t_default"]),
        node("Transpose", ["x"], ["t_perm"], perm=[0, 2, 3, 1]),
        node("Identity", ["t_perm"], ["ident"]),
    ]
    inits = {"s0": i64(0, -1, 4), "sq": i64(1), "us": i64(0, -1)}
    return make_model(nodes, {"x": x}, [(n.output[0], F) for n in nodes], inits)


@case("concat_slice_split_opset13")
def _(rng):
    x = rng.standard_normal((3, 4, 6)).astype(np.float32)
    nodes = [
        node("Concat", ["x", "x"], ["cat"], axis=-2),
        node("Slice", ["x", "st", "en"], ["sl_default_axes"]),
        node("Slice", ["x", "st2", "en2", "ax2", "sp2"], ["sl_neg"]),
        node("Split", ["x", "sizes"], ["sp_a", "sp_b"], axis=2),
        node("Split", ["x"], ["eq_a", "eq_b", "eq_c"], axis=0),
    ]
    inits = {
        "st": i64(1),
        "en": i64(9**18),
        "st2": i64(-1, 4),
        "en2": i64(-(2**63), 0),
        "ax2": i64(2, 1),
        "sp2": i64(-2, -1),
        "sizes": i64(2, 4),
    }
    outs = ["cat", "sl_default_axes", "sl_neg", "sp_a", "sp_b", "eq_a", "eq_b", "eq_c"]
    return make_model(nodes, {"x": x}, [(o, F) for o in outs], inits, opset=13)


@case("split_opset18_num_outputs")
def _(rng):
    x = rng.standard_normal((2, 7)).astype(np.float32)
    nodes = [
        node("Split", ["x"], ["a", "b", "c"], axis=1, num_outputs=3),
        node("Split", ["x", "sz"], ["d", "e_unused"], axis=1),
    ]
    return make_model(nodes, {"x": x}, [("a", F), ("b", F), ("c", F), ("d", F)], {"sz": i64(3, 4)}, opset=18)


@case("gather_family")
def _(rng):
    ids = rng.integers(-10, 10, (2, 5))
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    nodes = [
        node("Gather", ["emb", "ids"], ["g"]),
        node("GatherElements", ["x", "ge_idx"], ["ge"], axis=2),
        node("GatherND", ["x", "nd_idx"], ["nd"]),
    ]
    inits = {
        "emb": rng.standard_normal((10, 4)).astype(np.float32),
        "ge_idx": rng.integers(-4, 4, (2, 3, 6)),
        "nd_idx": np.array([[[1, 0], [0, 2]], [[1, -1], [0, 0]]], np.int64),
    }
    return make_model(nodes, {"ids": ids, "x": x}, [("g", F), ("ge", F), ("nd", F)], inits)


@case("expand_tile")
def _(rng):
    x = rng.standard_normal((3, 1)).astype(np.float32)
    nodes = [
        node("Expand", ["x", "shape"], ["e"]),
        node("Expand", ["x", "same"], ["e_noop"]),
        node("Tile", ["x", "reps"], ["t"]),
    ]
    return make_model(
        nodes,
        {"x": x},
        [("e", F), ("e_noop", F), ("t", F)],
        {"shape": i64(2, 1, 4), "same": i64(1, 1), "reps": i64(2, 3)},
    )


@case("trilu_cumsum_dropout_constant")
def _(rng):
    x = rng.standard_normal((2, 4, 5)).astype(np.float32)
    nodes = [
        node("Trilu", ["x", "k"], ["tu"]),
        node("Trilu", ["x"], ["tl"], upper=0),
        node("CumSum", ["x", "ax"], ["cs"]),
        node("CumSum", ["x", "ax"], ["cs_ex"], exclusive=1),
        node("CumSum", ["x", "ax"], ["cs_rev"], reverse=1),
        node("CumSum", ["x", "ax"], ["cs_both"], reverse=1, exclusive=1),
        node("Dropout", ["x", "ratio"], ["dr", "drmask"]),
        node("Constant", [], ["cf"], value_float=2.5),
        node("Constant", [], ["ci"], value_ints=[1, 2]),
        node("Constant", [], ["ct"], value=numpy_helper.from_array(np.float32([1, 2, 3, 4, 5]))),
        node("Mul", ["dr", "cf"], ["m1"]),
        node("Add", ["m1", "ct"], ["m2"]),
    ]
    return make_model(
        nodes,
        {"x": x},
        [
            ("tu", F),
            ("tl", F),
            ("cs", F),
            ("cs_ex", F),
            ("cs_rev", F),
            ("cs_both", F),
            ("m2", F),
            ("drmask", BOOL),
            ("ci", I64),
        ],
        {"k": np.int64(1), "ax": np.int64(-1), "ratio": np.float32(0.3)},
    )


# -------------------------------------------------------------------------------------------------------------- helpers


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def _save(model: onnx.ModelProto, tmp_path, name="m.onnx"):
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def _compare(graph, model, feeds) -> None:
    ours = run(graph, feeds)
    theirs = _ort(model, feeds)
    for name in [o.name for o in model.graph.output]:
        r, g = theirs[name], ours[name]
        assert g.shape == r.shape and g.dtype == r.dtype, (
            f"{name}: {g.dtype}{g.shape} vs onnxruntime {r.dtype}{r.shape}"
        )
        if r.dtype.kind == "f":
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(g, r, err_msg=name)


# ---------------------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_matches_onnxruntime(name: str, tmp_path) -> None:
    model, feeds = CASES[name](np.random.default_rng(zlib.crc32(name.encode())))
    graph = import_onnx(_save(model, tmp_path))
    _compare(graph, model, feeds)


def test_every_converter_has_a_case() -> None:
    covered = {n.op_type for make in CASES.values() for n in make(np.random.default_rng(0))[0].graph.node}
    table = {op for op, _ in CONVERTERS}
    assert table <= covered, f"converters without a test case: {sorted(table - covered)}"


def test_converters_are_keyed_by_real_since_versions() -> None:
    for op, since in CONVERTERS:
        assert since in since_versions(op), (op, since)
        assert onnx.defs.get_schema(op, max_inclusive_version=since, domain="").since_version == since
    # Ops whose signature changed inside 13..21 have both versions converted.
    for op, versions in {
        "ReduceMean": (13, 18),
        "ReduceMax": (13, 18, 20),
        "Split": (13, 18),
        "Reshape": (14, 19, 21),
    }.items():
        for v in versions:
            assert (op, v) in CONVERTERS, (op, v)


def test_shape_noise_folds_to_static_ops(tmp_path) -> None:
    model, feeds = CASES["shape_noise"](np.random.default_rng(0))
    graph = import_onnx(_save(model, tmp_path))
    ops = [n.op for n in graph.nodes]
    assert not [o for o in ops if OPS[o].host_only], ops
    assert sorted(ops) == ["Add", "Reshape", "Reshape"], ops  # all else was arithmetic on constants
    _compare(graph, model, feeds)


def test_identity_output_keeps_its_public_name(tmp_path) -> None:
    model, feeds = make_model(
        [node("Relu", ["x"], ["r"]), node("Identity", ["r"], ["out"])], {"x": np.ones((2, 2), np.float32)}, [("out", F)]
    )
    graph = import_onnx(_save(model, tmp_path))
    assert graph.outputs == ["out"]
    _compare(graph, model, feeds)


def _dynamic_model(dims_x: list, dims_m: list | None = None) -> onnx.ModelProto:
    vin = [helper.make_tensor_value_info("x", F, dims_x)]
    nodes = [node("Softmax", ["x"], ["y"])]
    if dims_m is not None:
        vin.append(helper.make_tensor_value_info("m", F, dims_m))
        nodes.append(node("Add", ["y", "m"], ["z"]))
    out = "z" if dims_m is not None else "y"
    g = helper.make_graph(nodes, "dyn", vin, [helper.make_tensor_value_info(out, F, dims_x)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_dynamic_batch_and_sequence_dims_take_the_flags(tmp_path) -> None:
    path = _save(_dynamic_model(["batch_size", "sequence_length", 8]), tmp_path)
    g = import_onnx(path, batch=3, seq_len=5)
    assert g.types["x"].shape == (3, 5, 8) and g.types["y"].shape == (3, 5, 8)


def test_dynamic_sequence_without_seq_len_says_which_flag(tmp_path) -> None:
    path = _save(_dynamic_model(["batch", "seq", 8]), tmp_path)
    with pytest.raises(TremulaError) as e:
        import_onnx(path)
    msg = str(e.value)
    assert "x[1] (seq)" in msg and "--seq-len" in msg and "\n" not in msg


def test_dynamic_dim_that_is_not_batch_or_sequence_is_listed(tmp_path) -> None:
    path = _save(_dynamic_model(["N", 3, "height", "width"]), tmp_path)
    with pytest.raises(TremulaError, match=r"x\[2\] \(height\), x\[3\] \(width\)"):
        import_onnx(path, seq_len=4)


def test_a_symbol_fixed_once_is_fixed_everywhere(tmp_path) -> None:
    # `s0` is dim 0 of x (so it is the batch); m's dim 1 named `s0` must take the same value.
    path = _save(_dynamic_model(["s0", "s0"], ["s0", "s0"]), tmp_path)
    g = import_onnx(path, batch=4)
    assert g.types["m"].shape == (4, 4)


def test_model_local_functions_are_inlined(tmp_path) -> None:
    fn = helper.make_function(
        "my.fns",
        "MulAdd",
        ["a", "b"],
        ["c"],
        [node("Mul", ["a", "b"], ["t"]), node("Add", ["t", "b"], ["c"])],
        opset_imports=[helper.make_opsetid("", 17)],
    )
    nodes = [helper.make_node("MulAdd", ["x", "y"], ["z"], domain="my.fns"), node("Relu", ["z"], ["out"])]
    rng = np.random.default_rng(0)
    model, feeds = make_model(
        nodes,
        {"x": rng.standard_normal((2, 3)).astype(np.float32), "y": rng.standard_normal((3,)).astype(np.float32)},
        [("out", F)],
        functions=[fn],
        extra_opsets=[helper.make_opsetid("my.fns", 1)],
    )
    graph = import_onnx(_save(model, tmp_path))
    assert [n.op for n in graph.nodes] == ["Mul", "Add", "Relu"]
    _compare(graph, model, feeds)


def test_layernorm_over_an_inner_axis_is_reported(tmp_path) -> None:
    model, _ = make_model(
        [node("LayerNormalization", ["x", "g"], ["y"], axis=1)],
        {"x": np.ones((2, 3, 4), np.float32)},
        [("y", F)],
        {"g": np.ones((3, 4), np.float32)},
    )
    with pytest.raises(TremulaError, match=r"LayerNormalization \(opset 17\) at .*only the last axis"):
        import_onnx(_save(model, tmp_path))


def test_reshape_to_a_runtime_shape_is_reported(tmp_path) -> None:
    model, _ = make_model(
        [node("Cast", ["s"], ["si"], to=I64), node("Reshape", ["x", "si"], ["y"])],
        {"x": np.ones((2, 3), np.float32), "s": np.ones((2,), np.float32)},
        [("y", F)],
    )
    with pytest.raises(TremulaError, match="shape computed at run time"):
        import_onnx(_save(model, tmp_path))


def test_unnamed_token_dim_of_integer_ids_takes_seq_len(tmp_path) -> None:
    vin = [helper.make_tensor_value_info("ids", I64, ["s0", "s1"])]
    g = helper.make_graph([node("Cast", ["ids"], ["y"], to=F)], "t", vin, [helper.make_tensor_value_info("y", F, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    assert import_onnx(_save(m, tmp_path), batch=2, seq_len=6).types["ids"].shape == (2, 6)


def _fused_graph():
    """Every fused op and a few plain ones, with lazy weights: what the zoo builds."""
    from tremula.ir import GraphBuilder

    b = GraphBuilder("fused", seed=7)
    img = b.input("img", (2, 3, 8, 8))
    x = b.op("Patchify", [img], patch=(4, 4))
    x = b.op("Linear", [x, b.param("wp", (48, 16)), b.param("bp", (16,))])
    x = b.op("LayerNorm", [x, b.param("g", (16,), kind="ones"), b.param("b", (16,), kind="zeros")], epsilon=1e-6)
    q = b.op("Reshape", [b.op("Linear", [x, b.param("wq", (16, 16))])], shape=(2, 4, 2, 8))
    q = b.op("Transpose", [q], perm=(0, 2, 1, 3))
    a = b.op("Attention", [q, q, q], scale=0.35, causal=1)
    a = b.op("Reshape", [b.op("Transpose", [a], perm=(0, 2, 1, 3))], shape=(2, 4, 16))
    y = b.op("Gelu", [b.op("Add", [a, x])], approximate="tanh")
    b.output(b.op("ReduceMean", [y], axes=[1], keepdims=0), "pooled")
    return b.build()


def test_export_then_import_round_trip(tmp_path) -> None:
    from tremula.export import save_onnx

    graph = _fused_graph()
    path = save_onnx(graph, tmp_path / "fused.onnx")
    back = import_onnx(path)
    feeds = {"img": np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)}
    np.testing.assert_allclose(run(back, feeds)["pooled"], run(graph, feeds)["pooled"], rtol=1e-5, atol=1e-6)
    # Fused ops come back as ONNX wrote them: LayerNorm fused, GELU as its tanh formula, attention unfused.
    assert {n.op for n in back.nodes} >= {"LayerNorm", "Tanh", "MatMul", "Softmax", "Where"}


def test_large_models_save_weights_beside_the_file(tmp_path, monkeypatch) -> None:
    from tremula.export import onnx_export

    monkeypatch.setattr(onnx_export, "_INLINE_LIMIT_BYTES", 0)  # pretend the model is past protobuf's 2 GiB
    graph = _fused_graph()
    path = onnx_export.save_onnx(graph, tmp_path / "big.onnx")
    assert (tmp_path / "big.onnx.data").stat().st_size > 0
    back = import_onnx(path)
    feeds = {"img": np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)}
    np.testing.assert_allclose(run(back, feeds)["pooled"], run(graph, feeds)["pooled"], rtol=1e-5, atol=1e-6)

"""Bad ONNX input gives one TremulaError line: missing, truncated, garbage, escaping external data, unsupported ops."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tremula.errors import TremulaError
from tremula.frontends import load_model
from tremula.frontends.onnx_import import import_onnx


def _one_line_error(path, match: str, **kw) -> str:
    with pytest.raises(TremulaError, match=match) as e:
        import_onnx(path, **kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.strip() == msg and len(msg) < 600, msg
    return msg


def _matmul_model(opset: int = 17) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.arange(64 * 8, dtype=np.float32).reshape(64, 8), "w")
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [w],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _with_external_data(tmp_path, location: str):
    """A model whose weight lives in external data at `location` (written as-is into the file)."""
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "model.onnx"
    onnx.save(_matmul_model(), str(path), save_as_external_data=True, location="weights.bin", size_threshold=0)
    m = onnx.load(str(path), load_external_data=False)
    for entry in m.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save(m, str(path))
    return path


def test_good_external_data_loads(tmp_path) -> None:
    path = _with_external_data(tmp_path, "weights.bin")
    g = import_onnx(path)
    assert g.constants["w"].value()[1, 0] == 8.0


def test_missing_file(tmp_path) -> None:
    _one_line_error(tmp_path / "nope.onnx", "no such ONNX file")


def test_directory_is_not_a_file(tmp_path) -> None:
    _one_line_error(tmp_path, "is not a file")


def test_truncated_file(tmp_path) -> None:
    good = _matmul_model().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(good[: len(good) // 2])
    _one_line_error(path, "truncated or corrupt")


def test_garbage_bytes(tmp_path) -> None:
    path = tmp_path / "garbage.onnx"
    path.write_bytes(np.random.default_rng(0).bytes(4000))
    _one_line_error(path, "truncated or corrupt|does not look like an ONNX model")


def test_empty_file(tmp_path) -> None:
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    _one_line_error(path, "does not look like an ONNX model")


def test_external_data_escaping_the_folder(tmp_path) -> None:
    (tmp_path / "secret.bin").write_bytes(np.ones(64 * 8, np.float32).tobytes())
    path = _with_external_data(tmp_path, "../secret.bin")
    _one_line_error(path, "refusing its external data.*outside")


def test_external_data_at_an_absolute_path(tmp_path) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.ones(64 * 8, np.float32).tobytes())
    path = _with_external_data(tmp_path, str(secret.resolve()))
    _one_line_error(path, "refusing its external data.*absolute")


def test_external_data_through_a_symlink_out_of_the_folder(tmp_path) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.ones(64 * 8, np.float32).tobytes())
    path = _with_external_data(tmp_path, "link.bin")
    os.symlink(secret, path.parent / "link.bin")
    _one_line_error(path, "refusing its external data")


def test_missing_external_data_file(tmp_path) -> None:
    path = _with_external_data(tmp_path, "gone.bin")
    _one_line_error(path, "refusing its external data|cannot read")


def test_external_data_shorter_than_declared(tmp_path) -> None:
    path = _with_external_data(tmp_path, "weights.bin")
    data = path.parent / "weights.bin"
    data.write_bytes(data.read_bytes()[:100])
    _one_line_error(path, "external data|cannot be read")


def test_unsupported_ops_are_all_listed_at_once(tmp_path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8])
    nodes = [
        helper.make_node("LSTM", ["x", "w", "r"], ["h"], hidden_size=2),
        helper.make_node("FusedMatMul", ["x", "x"], ["f"], domain="com.microsoft"),
        helper.make_node("Relu", ["x"], ["ok"]),
        helper.make_node("Foo", ["ok"], ["foo"]),
        helper.make_node("LSTM", ["x", "w", "r"], ["h2"], hidden_size=2),  # repeated: listed once
        helper.make_node("Hardmax", ["ok"], ["hm"]),
    ]
    inits = [
        numpy_helper.from_array(np.zeros((1, 8, 8), np.float32), "w"),
        numpy_helper.from_array(np.zeros((1, 8, 2), np.float32), "r"),
    ]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("h", "f", "foo", "h2", "hm")]
    g = helper.make_graph(nodes, "g", [x], outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14), helper.make_opsetid("com.microsoft", 1)])
    path = tmp_path / "unsupported.onnx"
    onnx.save(m, str(path))
    msg = _one_line_error(path, "unsupported ONNX ops")
    for pair in ("LSTM (opset 14)", "com.microsoft.FusedMatMul (opset 1)", "Foo (opset 14)", "Hardmax (opset 14)"):
        assert pair in msg, msg
    assert msg.count("LSTM") == 1 and "Relu" not in msg


@pytest.mark.parametrize("opset", [11, 22])
def test_opset_outside_13_to_21(tmp_path, opset: int) -> None:
    path = tmp_path / "old.onnx"
    onnx.save(_matmul_model(opset), str(path))
    _one_line_error(path, f"opset {opset}; tremula reads opsets 13-21")


def test_non_positive_batch(tmp_path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(_matmul_model(), str(path))
    _one_line_error(path, "must be positive", batch=0)


def test_unsupported_element_type(tmp_path) -> None:
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "bf16.onnx"
    onnx.save(m, str(path))
    _one_line_error(path, "bfloat16")


def test_load_model_dispatches_onnx_errors_too(tmp_path) -> None:
    path = tmp_path / "cut.onnx"
    path.write_bytes(_matmul_model().SerializeToString()[:50])
    with pytest.raises(TremulaError, match="truncated or corrupt"):
        load_model(str(path))


def _save_graph(tmp_path, nodes, inits=(), out_type=TensorProto.FLOAT) -> str:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    g = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", out_type, None)], list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    return path


def test_a_huge_constant_is_refused_not_allocated(tmp_path) -> None:
    shape = numpy_helper.from_array(np.array([10**6, 10**6, 2], np.int64), "shape")
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["big"]), helper.make_node("Add", ["x", "big"], ["y"])]
    _one_line_error(_save_graph(tmp_path, nodes, [shape]), "ConstantOfShape .*over .* elements")


def test_a_node_missing_a_required_attribute(tmp_path) -> None:
    path = _save_graph(tmp_path, [helper.make_node("Cast", ["x"], ["y"])])  # Cast without `to`
    _one_line_error(path, "Cast")

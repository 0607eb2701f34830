"""A saved Program stands alone (issue #12 item 5): it embeds its chip and a hash of its weights, names FP8 formats,
reloads and simulates to bit-identical outputs, and refuses another chip, other weights or a damaged provenance."""

import hashlib
import io
import json
import zipfile

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tremula.compiler import compile_model
from tremula.feeds import make_feeds
from tremula.pipeline import canonical
from tremula.errors import TremulaError
from tremula.frontends import load_model
from tremula.ir.graph import Constant, Graph, TensorType
from tremula.numerics.fp8 import FP8_DTYPES
from tremula.program import FORMAT_VERSION, load_program, save_program, storage_dtype
from tremula.provenance import seal, weights_sha256
from tremula.run_program import prepare, run_saved
from tremula.sim.functional import simulate
from tremula.target.chip import load_chip


def _onnx(path, delta: float = 0.0, batch: int = 2) -> str:
    """x[batch, 8] @ W[8, 4] + b -> tanh: W shifted by `delta` gives a model of the same shape, other weights."""
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])
    w = numpy_helper.from_array((rng.standard_normal((8, 4)) + delta).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("Tanh", ["a"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w, b]),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return str(path)


def _saved(tmp_path, model: str, chip: str, batch, dtype: str, name: str = "p.tremula"):
    c = load_chip(chip)
    res = compile_model(model, c, batch, dtype)
    path = tmp_path / name
    save_program(seal(res.program, c, res.graph), path)
    return res, str(path)


@pytest.mark.parametrize("dtype", ["fp32", "fp8"])
def test_saved_program_reloads_and_simulates_bit_identically(tmp_path, dtype):
    res, path = _saved(tmp_path, "bert-tiny", "c600", 2, dtype)
    feeds = make_feeds(canonical(load_model("bert-tiny", batch=2)), 7)
    before = simulate(res.program, res.graph, feeds)
    # The reloaded Program runs on the weights `run` rebuilds from the model alone (no planning), on its own chip.
    after = run_saved(prepare(path, "bert-tiny"), feeds).outputs
    assert sorted(before) == sorted(after)
    for k in before:
        assert before[k].dtype == after[k].dtype and before[k].tobytes() == after[k].tobytes(), k
    # save -> load -> save gives the same bytes with the provenance in
    again = tmp_path / "again.tremula"
    save_program(load_program(path), again)
    assert again.read_bytes() == (tmp_path / "p.tremula").read_bytes()


def test_a_shared_layer_program_reloads_and_simulates_bit_identically(tmp_path, monkeypatch):
    # Shared layers' steps are calls of a template with patches (FP8 scales among the patched params).
    from tremula import pipeline

    monkeypatch.setattr(pipeline, "PLAN_BUDGETS", ((0.12, None, True),))
    res, path = _saved(tmp_path, "vit-tiny", "c600", 2, "fp8")
    assert res.shared_layers == 1
    feeds = make_feeds(canonical(load_model("vit-tiny", batch=2)), 3)
    before = simulate(res.program, res.graph, feeds)
    after = run_saved(prepare(path, "vit-tiny"), feeds).outputs
    assert all(before[k].tobytes() == after[k].tobytes() for k in before)


def test_fp8_operands_and_weights_have_their_formats_dtype_in_memory_and_in_the_file(tmp_path):
    res, path = _saved(tmp_path, "bert-tiny", "c600", 2, "fp8")
    with np.load(path) as z:
        header = json.loads(bytes(z["header.json"]).decode())
    named = {d for g in header["groups"] for d in g["dtypes"]} | {c[-1] for c in header["consts"]}
    assert "uint8" not in named and "float8_e4m3fnuz" in named  # bert-tiny's policy: F143 operands and weights
    mm = [g for g in header["groups"] if g["codelet"] == "matmul_fp8"]
    assert mm and all(g["dtypes"][:2] == ["float8_e4m3fnuz"] * 2 for g in mm)
    back = load_program(path)
    assert back.consts == res.program.consts
    fp8 = {c.name for c in back.consts if c.dtype == "float8_e4m3fnuz"}
    assert fp8 and all(name.endswith(".codes") for name in fp8)  # the weights' FP8 codes
    assert [g.dtypes for s in back.steps for g in s.compute] == [g.dtypes for s in res.program.steps for g in s.compute]


def test_fp8_names_follow_the_codelets_formats():
    from tremula.codelets.fp8 import FORMATS

    assert tuple(f.np_dtype.name for f in FORMATS) == FP8_DTYPES
    assert storage_dtype("float8_e5m2fnuz") == np.uint8 and storage_dtype("float16") == np.float16


def _rewrite_header(path, change) -> None:
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    header = json.loads(bytes(np.load(io.BytesIO(members["header.json.npy"]))).decode())
    change(header)
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.frombuffer(json.dumps(header).encode(), np.uint8))
    members["header.json.npy"] = buf.getvalue()
    with zipfile.ZipFile(path, "w") as z:
        for n, data in members.items():
            z.writestr(n, data)


def test_an_fp8_name_that_contradicts_the_params_is_a_damaged_file(tmp_path):
    _, path = _saved(tmp_path, "bert-tiny", "c600", 2, "fp8")

    def lie(h):
        g = next(g for g in h["groups"] if g["codelet"] == "matmul_fp8")
        g["dtypes"][0] = "float8_e5m2fnuz"

    _rewrite_header(path, lie)
    with pytest.raises(TremulaError, match="damaged"):
        load_program(path)


def test_another_chip_is_refused_by_the_hash_of_its_file(tmp_path):
    _, path = _saved(tmp_path, "bert-tiny", "c600", 2, "fp32")
    with pytest.raises(TremulaError, match="compiled for chip c600") as e:
        prepare(path, "bert-tiny", "mk2")
    assert "\n" not in str(e.value)
    from importlib import resources

    text = (resources.files("tremula") / "chips" / "c600.toml").read_text()
    same = tmp_path / "same.toml"
    same.write_text(text)
    prepare(path, "bert-tiny", str(same))  # the same text under another path is the same chip
    edited = tmp_path / "edited.toml"
    edited.write_text(text.replace("\nclock_hz = ", "\nclock_hz = 2e9\n# was: ", 1))
    assert load_chip(str(edited)).clock_hz == 2e9
    with pytest.raises(TremulaError, match="compiled for chip c600"):
        prepare(path, "bert-tiny", str(edited))


def test_other_weights_are_refused(tmp_path):
    model, other = _onnx(tmp_path / "m.onnx"), _onnx(tmp_path / "m2.onnx", delta=0.5)
    _, path = _saved(tmp_path, model, "c600", None, "fp16")
    prepare(path, model)  # its own weights pass
    with pytest.raises(TremulaError, match="compiled for other weights") as e:
        prepare(path, other)
    assert "\n" not in str(e.value)


def test_another_model_is_refused(tmp_path):
    _, path = _saved(tmp_path, _onnx(tmp_path / "m.onnx"), "c600", None, "fp32")
    with pytest.raises(TremulaError, match="another model"):
        prepare(path, "bert-tiny")


def test_an_unsealed_or_tampered_program_is_refused(tmp_path):
    c = load_chip("c600")
    res = compile_model("bert-tiny", c, 1, "fp32")
    save_program(res.program, tmp_path / "bare.tremula")
    with pytest.raises(TremulaError, match="no chip description or weights hash"):
        prepare(str(tmp_path / "bare.tremula"), "bert-tiny")
    path = tmp_path / "p.tremula"
    save_program(seal(res.program, c, res.graph), path)
    _rewrite_header(path, lambda h: h["provenance"].update(chip_toml=h["provenance"]["chip_toml"].replace(
        "tiles = 1472", "tiles = 1473")))
    with pytest.raises(TremulaError, match="does not match its sha256"):
        prepare(str(path), "bert-tiny")


def test_a_file_of_another_version_is_refused_in_one_line(tmp_path):
    _, path = _saved(tmp_path, _onnx(tmp_path / "m.onnx"), "c600", None, "fp32")
    _rewrite_header(path, lambda h: h.update(version=FORMAT_VERSION - 1))
    with pytest.raises(TremulaError, match=f"version {FORMAT_VERSION}; recompile"):
        load_program(path)


def test_weights_hash_is_the_documented_digest():
    # provenance.py's WEIGHTS_HASH, written out by hand: names in order, each "name\0dtype\0shape\0" + LE bytes.
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    b = np.array([3, -1], np.int64)
    g = Graph("g", [], [], [], {}, {})
    for name, v in (("b.w", a), ("a.idx", b), ("unused", np.ones(2, np.float32))):
        g.constants[name] = Constant(name, TensorType(v.shape, str(v.dtype)), data=v)
    h = hashlib.sha256()
    h.update(b"a.idx\0int64\x002\0" + b.astype("<i8").tobytes())
    h.update(b"b.w\0float16\x002,3\0" + a.astype("<f2").tobytes())
    assert weights_sha256(g, ["b.w", "a.idx", "b.w"]) == h.hexdigest()
    with pytest.raises(TremulaError, match="no constant 'missing'"):
        weights_sha256(g, ["missing"])

"""`check --inputs [--expected]` and `run` from the command line (issue #12 items 4, 5): the user's inputs, checked in
one line each; their expected outputs and onnxruntime as more oracles, a wrong one failing the check; a saved Program
run alone to the outputs the compile's own Program gives."""

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

TREMULA = [sys.executable, "-m", "tremula"]


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(TREMULA + [str(a) for a in args], capture_output=True, text=True, timeout=300, cwd=cwd)


def one_line_error(p: subprocess.CompletedProcess, *needles: str) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _onnx(path, batch: int = 2, delta: float = 0.0) -> str:
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])
    w = numpy_helper.from_array((rng.standard_normal((8, 4)) + delta).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("Tanh", ["a"], ["y"])]
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w, b]),
                                opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def _ort(model: str, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.fixture
def files(tmp_path):
    model = _onnx(tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    x2 = rng.standard_normal((2, 8)).astype(np.float32)
    np.savez(tmp_path / "x2.npz", x=x2)
    np.savez(tmp_path / "x4.npz", x=rng.standard_normal((4, 8)).astype(np.float32))
    np.savez(tmp_path / "y2.npz", y=_ort(model, x2))  # what onnxruntime says: the truth for this file
    return tmp_path, model


def test_inputs_expected_and_onnxruntime_all_agree(files):
    tmp, model = files
    p = cli("check", model, "--inputs", tmp / "x2.npz", "--expected", tmp / "y2.npz", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["passed"] and r["inputs"] == "user" and r["batch"] == 2
    oracles = {o["name"]: o for o in r["oracles"]}
    assert set(oracles) == {"expected", "onnxruntime"}
    for o in oracles.values():
        assert [x["name"] for x in o["outputs"]] == ["y"] and all(x["passed"] for x in o["outputs"])
        assert o["outputs"][0]["rel_err"] <= 1e-4


def test_wrong_expected_outputs_fail_the_check(files):
    tmp, model = files
    y = np.load(tmp / "y2.npz")["y"].copy()
    y[1, 2] += 0.05  # one element off by 5 % of the output's scale
    np.savez(tmp / "bad.npz", y=y)
    p = cli("check", model, "--inputs", tmp / "x2.npz", "--expected", tmp / "bad.npz")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "FAIL" in p.stdout and "against your expected outputs" in p.stdout
    assert "against onnxruntime" in p.stdout  # onnxruntime, on the same inputs, still agrees


def test_the_inputs_choose_the_batch_and_onnxruntime_runs_the_original_file_in_slices(files):
    tmp, model = files
    p = cli("check", model, "--inputs", tmp / "x4.npz", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["batch"] == 4  # the file fixes 2; the inputs hold 4 samples; no --batch given
    ort = next(o for o in r["oracles"] if o["name"] == "onnxruntime")
    assert "2 times" in ort["note"] and ort["outputs"][0]["passed"]


def _write(tmp, name, **arrays):
    np.savez(tmp / name, **arrays)
    return tmp / name


def _nan_input():
    x = np.zeros((2, 8), np.float32)
    x[1, 3] = np.nan
    return x


HOSTILE = [
    (lambda t: ["--inputs", _write(t, "n.npz", z=np.zeros((2, 8), np.float32))], ["missing 'x'", "unknown 'z'"]),
    (lambda t: ["--inputs", _write(t, "s.npz", x=np.zeros((2, 7), np.float32))], ["shape [2, 7]", "[N, 8]"]),
    (lambda t: ["--inputs", _write(t, "nan.npz", x=_nan_input())], ["NaN or infinite", "[1, 3]"]),
    (lambda t: ["--inputs", _write(t, "inf.npz", x=np.full((2, 8), np.inf, np.float32))], ["NaN or infinite"]),
    (lambda t: ["--inputs", _write(t, "str.npz", x=np.array(["a", "b"]))], ["cannot read inputs", "are numbers"]),
    (lambda t: ["--inputs", t / "x2.npz", "--batch", "4"], ["hold 2 samples", "--batch is 4"]),
    (lambda t: ["--inputs", t / "x2.npz", "--batch", "auto"], ["--batch auto"]),
    (lambda t: ["--expected", t / "y2.npz"], ["--expected needs --inputs"]),
    (lambda t: ["--inputs", t / "x2.npz", "--expected", _write(t, "e.npz", q=np.zeros((2, 4)))], ["'q'"]),
    (lambda t: ["--inputs", t / "x2.npz", "--expected", _write(t, "e.npz", y=np.zeros((2, 5)))], ["shape [2, 5]"]),
    (lambda t: ["--inputs", t / "x2.npz", "--expected", _write(t, "e.npz", y=np.full((2, 4), np.nan))], ["NaN"]),
    (lambda t: ["--inputs", t / "x2.npz", "--calibration", t / "x2.npz"], ["--dtype fp8 only"]),
]


@pytest.mark.parametrize("make,needles", HOSTILE)
def test_hostile_inputs_are_one_line_errors(files, make, needles):
    tmp, model = files
    one_line_error(cli("check", model, *make(tmp)), *needles)


def test_fp8_calibrates_on_one_file_and_checks_on_another(tmp_path):
    from tremula.feeds import make_feeds
    from tremula.pipeline import canonical
    from tremula.frontends import load_model

    g = canonical(load_model("bert-tiny", batch=2))
    np.savez(tmp_path / "cal.npz", **make_feeds(g, 11))
    np.savez(tmp_path / "in.npz", **make_feeds(g, 12))
    p = cli("check", "bert-tiny", "--dtype", "fp8", "--calibration", tmp_path / "cal.npz", "--inputs",
            tmp_path / "in.npz", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["passed"] and r["inputs"] == "user" and r["matched"] and r["oracles"] == []  # not ONNX: no ORT


def test_run_a_saved_program_alone(files):
    tmp, model = files
    assert cli("compile", model, "--dtype", "fp16", "-o", tmp / "m.tremula").returncode == 0
    p = cli("run", tmp / "m.tremula", model, "--inputs", tmp / "x2.npz", "--out", tmp / "out.npz")
    assert p.returncode == 0, p.stderr
    # the same as the compile's own Program simulated in this process
    from tremula.target.chip import load_chip
    from tremula.compiler import compile_model
    from tremula.sim.functional import simulate

    res = compile_model(model, load_chip("c600"), None, "fp16")
    want = simulate(res.program, res.graph, {"x": np.load(tmp / "x2.npz")["x"]})["y"]
    got = np.load(tmp / "out.npz")["y"]
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    # and near onnxruntime, at fp16
    assert np.max(np.abs(got.astype(np.float32) - np.load(tmp / "y2.npz")["y"])) < 5e-3


def test_run_refuses_another_chip_other_weights_and_a_wrong_batch(files):
    tmp, model = files
    assert cli("compile", model, "-o", tmp / "m.tremula").returncode == 0
    one_line_error(cli("run", tmp / "m.tremula", model, "--inputs", tmp / "x2.npz", "--chip", "mk2"),
                   "compiled for chip c600", "--chip mk2")
    other = _onnx(tmp / "other.onnx", delta=0.25)
    one_line_error(cli("run", tmp / "m.tremula", other, "--inputs", tmp / "x2.npz"), "compiled for other weights")
    one_line_error(cli("run", tmp / "m.tremula", model, "--inputs", tmp / "x4.npz"), "shape [4, 8]", "[2, 8]")
    one_line_error(cli("run", tmp / "m.tremula", model, "--inputs", tmp / "x2.npz", "--out", tmp / "m.tremula"),
                   "would overwrite the program")

"""The command line as a user meets it: bad input gives one line on stderr and a non-zero exit, never a traceback."""

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

TREMULA = [sys.executable, "-m", "tremula"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(TREMULA + list(args), capture_output=True, text=True, timeout=300)


def assert_one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode != 0, p.stdout
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def _tiny_onnx(path, op="Relu", domain=""):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    nodes = [helper.make_node(op, ["x"], ["y"], domain=domain)]
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=opsets), path)


def test_help_and_chips_table():
    p = run_cli("--help")
    assert p.returncode == 0 and "inspect" in p.stdout
    p = run_cli("chips", "--json")
    assert p.returncode == 0
    rows = json.loads(p.stdout)
    assert {r["name"] for r in rows} >= {"mk1", "mk2", "bow", "c600"}


def test_inspect_zoo_model_json():
    p = run_cli("inspect", "vit-tiny", "--json", "--batch", "2")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["inputs"][0][1].startswith("float32[2,")
    assert info["flops"] > 0 and sum(r["flops"] for r in info["ops"]) == info["flops"]


def test_missing_file(tmp_path):
    assert_one_line_error(run_cli("inspect", str(tmp_path / "nope.onnx")), "nope.onnx")


def test_unknown_zoo_name():
    assert_one_line_error(run_cli("inspect", "not-a-model"), "not-a-model")


def test_garbage_and_truncated_onnx(tmp_path):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert_one_line_error(run_cli("inspect", str(garbage)), "garbage.onnx")
    good = tmp_path / "good.onnx"
    _tiny_onnx(good)
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    assert_one_line_error(run_cli("inspect", str(truncated)), "truncated.onnx")


def test_unsupported_ops_are_listed_together(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4])
    nodes = [helper.make_node("Hardmax", ["x"], ["y"]), helper.make_node("Celu", ["y"], ["z"])]
    path = tmp_path / "unsupported.onnx"
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [z]), opset_imports=[helper.make_opsetid("", 17)]),
              path)
    assert_one_line_error(run_cli("inspect", str(path)), "Hardmax", "Celu")


def test_external_data_outside_folder(tmp_path):
    inner = tmp_path / "model"
    inner.mkdir()
    (tmp_path / "secret.bin").write_bytes(np.ones(4, np.float32).tobytes())
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[1, 4])
    w.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "../secret.bin"), ("offset", "0"), ("length", "16")):
        e = w.external_data.add()
        e.key, e.value = k, v
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g", [x], [y], initializer=[w])
    path = inner / "escape.onnx"
    with open(path, "wb") as f:
        f.write(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    assert_one_line_error(run_cli("inspect", str(path)))


@pytest.mark.parametrize("content", ["tiles = [", "name = 'x'\n", "garbage\x00"])
def test_invalid_chip_file(tmp_path, content):
    from tremula.target.chip import load_chip
    from tremula.errors import TremulaError

    path = tmp_path / "chip.toml"
    path.write_text(content)
    with pytest.raises(TremulaError) as e:
        load_chip(str(path))
    assert "\n" not in str(e.value)


def test_compile_timetable_json_reports_makespans_near_their_bounds():
    p = run_cli("compile", "gpt2-tiny", "--chip", "c600", "--batch", "2", "--timetable", "--json")
    assert p.returncode == 0, p.stderr
    ex = json.loads(p.stdout)["exchanges"]
    assert ex and all(e["lower_bound"] <= e["makespan"] <= 1.25 * e["lower_bound"] for e in ex)


def test_check_fp8_prints_accuracy_and_the_layers_that_lose_most():
    p = run_cli("check", "vit-tiny", "--chip", "c600", "--dtype", "fp8", "--batch", "2")
    assert p.returncode == 0, p.stderr
    assert "cosine" in p.stdout and "max rel err" in p.stdout and "layers that lose most" in p.stdout
    p = run_cli("check", "vit-tiny", "--chip", "c600", "--dtype", "fp8", "--json")
    layers = json.loads(p.stdout)["layers"]
    assert layers and layers[0]["cosine"] == min(x["cosine"] for x in layers)


def test_fp8_on_a_chip_without_it_and_bad_calibration_files(tmp_path):
    assert_one_line_error(run_cli("compile", "vit-tiny", "--chip", "mk2", "--dtype", "fp8"), "no FP8 matmul unit")
    bad = tmp_path / "cal.npy"
    bad.write_text("not numpy")
    assert_one_line_error(run_cli("compile", "vit-tiny", "--dtype", "fp8", "--calibration", str(bad)),
                          "cannot read calibration inputs")
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.zeros((1, 3, 4, 4), np.float32))
    assert_one_line_error(run_cli("compile", "vit-tiny", "--dtype", "fp8", "--calibration", str(wrong)), "has shape")


@pytest.mark.parametrize("args,needle", [
    (("inspect", "vit-tiny", "--seq-len", "0"), "--seq-len"),
    (("--no-such-flag",), "--no-such-flag"),
    (("compile",), "model"),
    (("chips", "--json", "extra"), "extra"),
])
def test_flag_errors_are_one_line(args, needle):
    # The CLI library's own usage errors come as one line too, not a framed box over several lines (issue #11).
    p = run_cli(*args)
    assert p.returncode == 2
    assert_one_line_error(p, needle)


def test_bare_command_prints_help():
    p = run_cli()
    assert p.returncode == 0 and "compile" in p.stdout and not p.stderr.strip()


def test_json_has_no_nan(capsys):
    # A cosine of an all-zero output is NaN; --json must still be JSON (null), not the token NaN.
    from tremula.cli import _print_json

    _print_json({"cosine": float("nan"), "rows": [float("inf"), 1.5], "ok": True})
    assert json.loads(capsys.readouterr().out) == {"cosine": None, "rows": [None, 1.5], "ok": True}


def test_check_reports_the_precision_matched_reference():
    # At fp16 the verdict also rests on the precision-matched comparison: it must be shown, not only decide.
    p = run_cli("check", "bert-tiny", "--chip", "examples/chips/tiny16.toml", "--batch", "2", "--dtype", "fp16",
                "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert {m["name"] for m in doc["matched"]} == {o["name"] for o in doc["outputs"]}
    assert all(m["metric"] == "max_rel_err" and m["value"] <= m["threshold"] for m in doc["matched"])
    p = run_cli("check", "bert-tiny", "--chip", "examples/chips/tiny16.toml", "--batch", "2", "--dtype", "fp16")
    assert "precision-matched reference" in p.stdout


def test_partials_option_reaches_the_compile_and_is_reported():
    p = run_cli("compile", "bert-tiny", "--chip", "examples/chips/tiny16.toml", "--batch", "2", "--dtype", "fp16",
                "--partials", "float", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["partials"] == "float"
    p = run_cli("compile", "bert-tiny", "--chip", "examples/chips/tiny16.toml", "--batch", "2", "--dtype", "fp16")
    assert p.returncode == 0 and "float16, half partials" in p.stdout
    p = run_cli("compile", "bert-tiny", "--chip", "examples/chips/tiny16.toml", "--dtype", "fp16", "--partials", "fp8")
    assert p.returncode != 0 and "unsupported --partials 'fp8'" in p.stderr


def test_compile_and_check_on_a_system_of_several_chips(tmp_path):
    """--system: a pipeline of stages, one chip each; the JSON gives each stage and the pipeline's figures."""
    p = run_cli("compile", "bert-tiny", "--system", "2xc600", "--stages", "2", "--batch", "2", "--dtype", "fp16",
                "--json", "--report", str(tmp_path / "r.html"))
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in tmp_path.iterdir()) == ["r.stage0.html", "r.stage1.html"]  # a profile per chip
    data = json.loads(p.stdout)
    assert data["stages"] == 2 and len(data["per_stage"]) == 2 and data["replicas"] == 1
    assert data["period_cycles"] == max(s["stage_cycles"] for s in data["per_stage"]) + data["link_cycles"] + \
        data["sync_cycles"]
    p = run_cli("check", "gpt2-tiny", "--system", "4xc600", "--stages", "2", "--batch", "2", "--dtype", "fp16")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 stage(s) x 2 replica(s)" in p.stdout and "stage 1 last_hidden_state" in p.stdout
    p = run_cli("systems", "--json")
    assert p.returncode == 0 and {r["name"] for r in json.loads(p.stdout)} >= {"2xc600", "bow2000"}


@pytest.mark.parametrize("args, needle", [  # (the library's own refusals: tests/models/test_multichip.py)
    (("compile", "bert-tiny", "--stages", "2"), "--stages needs --system"),
    (("check", "bert-tiny", "--system", "2xc600", "--inputs", "x.npz"), "--inputs is not supported with --system"),
])
def test_system_flags_refused_in_one_line(args, needle):
    assert_one_line_error(run_cli(*args), needle)



def test_batch_auto_says_which_rates_are_a_compiles():
    """--batch auto lists each batch planned; the rates of the batches grown fully (a compile's) apart from the
    ones ranked by a plan grown one step (a compile of that batch may be faster)."""
    p = run_cli("compile", "vit-tiny", "--chip", "examples/chips/tiny16.toml", "--batch", "auto", "--dtype", "fp16")
    assert p.returncode == 0, p.stderr
    row = next(ln for ln in p.stdout.splitlines() if "batch auto" in ln)
    assert "as compiled" in row and "the largest that fits is" in row
    p = run_cli("compile", "vit-tiny", "--chip", "examples/chips/tiny16.toml", "--batch", "auto", "--dtype", "fp16",
                "--json")
    auto = json.loads(p.stdout)["auto"]
    assert auto["grown"] and set(map(str, auto["grown"])) <= set(auto["rates"])

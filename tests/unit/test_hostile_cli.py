"""Hostile command lines (issue #11): no output destroys an input, unwritable outputs and unreadable calibration files
are one-line user errors before any work, and names from a model file cannot act on the terminal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import warnings
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tremula import check, cli, compiler
from tremula.errors import TremulaError
from tremula.outputs import check_outputs

ROOT = Path(__file__).resolve().parents[2]
TINY_CHIP = ROOT / "examples" / "chips" / "tiny16.toml"


# ------------------------------------------------------------------------------------------------ helpers


@pytest.fixture
def tremula(monkeypatch, capsys):
    """Run the CLI in this process (as `tremula ARGS`): (exit status, stdout, stderr)."""
    monkeypatch.delenv("TREMULA_DEBUG", raising=False)
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # main() installs its own

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["tremula", *map(str, args)])
        with pytest.raises(SystemExit) as e:
            cli.main()
        captured = capsys.readouterr()
        return e.value.code or 0, captured.out, captured.err

    return run


@pytest.fixture
def no_work(monkeypatch):
    """compile_model and check_model fail the test if called: a refusal must come before any work."""

    def refuse(*args, **kwargs):
        raise AssertionError("the compile started")

    monkeypatch.setattr(compiler, "compile_model", refuse)
    monkeypatch.setattr(check, "check_model", refuse)


def one_line_error(result: tuple[int, str, str], *needles: str) -> str:
    code, _, err = result
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("tremula: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def matmul_model(graph_name: str = "g", node_name: str = "n", input_name: str = "x") -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", [input_name, "w"], ["y"], name=node_name)], graph_name,
                          [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def inputs(tmp_path) -> Path:
    """A folder with every kind of input: an ONNX model, one with external data, a chip file, a calibration file,
    and a checkpoint folder."""
    onnx.save(matmul_model(), tmp_path / "m.onnx")
    onnx.save(matmul_model(), tmp_path / "ext.onnx", save_as_external_data=True, location="ext.data",
              size_threshold=0)
    (tmp_path / "chip.toml").write_bytes(TINY_CHIP.read_bytes())
    np.save(tmp_path / "cal.npy", np.ones((1, 4), np.float32))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "vit"}')
    (hf / "model.safetensors").write_bytes(b"weights")
    return tmp_path


# ------------------------------------------------------------------------------------------------ 1. data loss


@pytest.mark.parametrize("args, needles", [
    (["m.onnx", "--chip", "chip.toml", "--report", "m.onnx"], ["--report m.onnx", "the model"]),
    (["m.onnx", "--chip", "chip.toml", "-o", "./m.onnx"], ["--output ./m.onnx", "the model"]),
    (["m.onnx", "--chip", "chip.toml", "--trace", "chip.toml"], ["--trace chip.toml", "the chip file"]),
    (["ext.onnx", "--chip", "chip.toml", "-o", "ext.data"], ["--output ext.data", "external data"]),
    (["m.onnx", "--chip", "c600", "--dtype", "fp8", "--calibration", "cal.npy", "-o", "cal.npy"],
     ["--output cal.npy", "the calibration file"]),
    (["hf", "--chip", "chip.toml", "-o", "hf/config.json"], ["--output hf/config.json", "model folder hf"]),
    (["hf", "--chip", "chip.toml", "--report", "hf/model.safetensors"], ["hf/model.safetensors", "model folder"]),
    (["hf", "--chip", "chip.toml", "--trace", "hf/new.json"], ["--trace hf/new.json", "model folder"]),
    (["hf", "--chip", "chip.toml", "-o", "hf"], ["--output hf", "model folder"]),
])
def test_outputs_never_overwrite_inputs(tremula, no_work, inputs, monkeypatch, args, needles):
    monkeypatch.chdir(inputs)
    before = snapshot(inputs)
    one_line_error(tremula("compile", *args), *needles)
    assert snapshot(inputs) == before


def test_links_to_an_input_are_the_input(tremula, no_work, inputs, monkeypatch):
    monkeypatch.chdir(inputs)
    os.symlink("m.onnx", "soft.onnx")
    os.link("m.onnx", "hard.onnx")
    before = snapshot(inputs)
    one_line_error(tremula("compile", "m.onnx", "--chip", "chip.toml", "-o", "soft.onnx"), "the model m.onnx")
    one_line_error(tremula("compile", "m.onnx", "--chip", "chip.toml", "--report", "hard.onnx"), "the model m.onnx")
    assert snapshot(inputs) == before


def test_a_built_in_chip_file_is_an_input_too(tremula, no_work, tmp_path):
    from importlib import resources

    packaged = Path(str(resources.files("tremula") / "chips" / "c600.toml"))
    before = packaged.read_bytes()
    onnx.save(matmul_model(), tmp_path / "m.onnx")
    one_line_error(tremula("compile", str(tmp_path / "m.onnx"), "--chip", "C600", "-o", str(packaged)),
                   "the chip file")
    assert packaged.read_bytes() == before


def test_external_data_anywhere_in_the_model_is_an_input(tmp_path):
    """Initializers and Constant nodes' tensors alike; looked up only when an output lands in the model's folder."""
    from tremula.outputs import input_files

    const = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.ones(4, np.float32), "c"))
    m = matmul_model()
    m.graph.node.insert(0, const)
    from onnx.external_data_helper import convert_model_to_external_data

    convert_model_to_external_data(m, all_tensors_to_one_file=False, size_threshold=0, convert_attribute=True)
    onnx.save(m, tmp_path / "m.onnx")
    found = input_files(str(tmp_path / "m.onnx"))
    assert {p.name for p, what in found.items() if what == "the model's external data"} == {"w", "c"}
    assert list(input_files(str(tmp_path / "m.onnx"), near=[Path("/elsewhere/out.html")])) == [tmp_path / "m.onnx"]


@pytest.mark.parametrize("flags", [
    ["--report", "same.out", "--trace", "same.out"],
    ["-o", "same.out", "--trace", "./same.out"],
    ["-o", "same.out", "--report", "sub/../same.out"],
])
def test_two_outputs_onto_one_file(tremula, no_work, inputs, monkeypatch, flags):
    monkeypatch.chdir(inputs)
    (inputs / "sub").mkdir()
    one_line_error(tremula("compile", "m.onnx", "--chip", "chip.toml", *flags), "same.out", "the same file")
    assert not (inputs / "same.out").exists()


def test_report_onto_the_model_end_to_end(tmp_path):
    """The issue's own command, in a real process: the model keeps its bytes."""
    model = tmp_path / "v.onnx"
    onnx.save(matmul_model(), model)
    before = model.read_bytes()
    p = subprocess.run([sys.executable, "-m", "tremula", "compile", str(model), "--chip", str(TINY_CHIP),
                        "--report", str(model)], capture_output=True, text=True, timeout=120)
    one_line_error((p.returncode, p.stdout, p.stderr), "would overwrite the model")
    assert model.read_bytes() == before


# ------------------------------------------------------------------------------------------------ 2. writable


@pytest.mark.parametrize("flag", ["-o", "--report", "--trace"])
@pytest.mark.parametrize("path, needle", [
    ("", "needs a file name"),
    ("  ", "needs a file name"),
    ("missing/out.bin", "does not exist"),
    ("m.onnx/out.bin", "is not a folder"),
    ("a_folder", "is a folder"),
    ("/proc/tremula-out.bin", "cannot be written"),  # refused even to root
])
def test_unwritable_outputs_are_refused_before_the_compile(tremula, no_work, inputs, monkeypatch, flag, path,
                                                          needle):
    monkeypatch.chdir(inputs)
    (inputs / "a_folder").mkdir()
    before, names = snapshot(inputs), sorted(os.listdir(inputs))
    one_line_error(tremula("compile", "m.onnx", "--chip", "chip.toml", flag, path), needle)
    assert snapshot(inputs) == before and sorted(os.listdir(inputs)) == names  # no stray file from the probe


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder(tremula, no_work, inputs, monkeypatch):
    monkeypatch.chdir(inputs)
    locked = inputs / "locked"
    locked.mkdir(mode=0o500)
    one_line_error(tremula("compile", "m.onnx", "--chip", "chip.toml", "-o", "locked/p.tremula"), "cannot be written")


def test_the_probe_leaves_no_trace(tmp_path):
    existing = tmp_path / "old.html"
    existing.write_text("previous report")
    stamp = existing.stat().st_mtime_ns
    check_outputs({"--output": str(tmp_path / "new.tremula"), "--report": str(existing)})
    assert sorted(os.listdir(tmp_path)) == ["old.html"]  # the new file was created and removed again
    assert existing.read_text() == "previous report" and existing.stat().st_mtime_ns == stamp


def test_fifo_output_does_not_hang(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(TremulaError, match="cannot be written"):
        check_outputs({"--trace": str(fifo)})


def test_a_good_compile_still_writes_every_output(tremula, tmp_path):
    from tremula.export import export_onnx
    from tremula.frontends.zoo import build_zoo

    onnx.save(export_onnx(build_zoo("vit-tiny")), tmp_path / "vit.onnx")
    outs = {"-o": tmp_path / "p.tremula", "--report": tmp_path / "r.html", "--trace": tmp_path / "t.json"}
    args = [a for flag, path in outs.items() for a in (flag, str(path))]
    code, out, err = tremula("compile", str(tmp_path / "vit.onnx"), "--chip", str(TINY_CHIP), *args)
    assert code == 0, err
    assert all(p.stat().st_size > 0 for p in outs.values())
    assert "program written to" in out and "report written to" in out and "trace written to" in out


# ------------------------------------------------------------------------------------------------ 3. calibration


def _pickled_npz(path: Path) -> None:
    np.savez(path, x=np.array([{"a": 1}], dtype=object))


def _text_member_npz(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x.txt", "not an array")


def _bad_zip(path: Path) -> None:
    path.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)


def _truncated_npy(path: Path) -> None:
    np.save(path, np.ones((1, 4), np.float32))
    path.write_bytes(path.read_bytes()[:-5])


def _huge_header(path: Path) -> None:  # declares 4e8 floats in a few bytes
    np.save(path, np.ones(4, np.float32))
    data = path.read_bytes().replace(b"(4,)", b"(400000000,)".ljust(4), 1)
    path.write_bytes(data)


def _corrupt_npz_data(path: Path) -> None:
    np.savez_compressed(path, x=np.arange(1000, dtype=np.float32))
    data = bytearray(path.read_bytes())
    data[200:260] = bytes(60)  # inside the deflated stream: headers stay, the data does not
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name, write, needle", [
    ("garbage.npy", lambda p: p.write_bytes(np.random.default_rng(0).bytes(300)), "not a NumPy .npy or .npz"),
    ("text.npz", lambda p: p.write_text("hello"), "not a NumPy .npy or .npz"),
    ("pickled.npy", lambda p: np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True), "pickled"),
    ("pickled.npz", _pickled_npz, "pickled"),
    ("scalar.npy", lambda p: np.save(p, np.array(3.0, np.float32)), "0-d array"),
    ("empty.npz", lambda p: np.savez(p), "empty .npz"),
    ("odd.npz", _text_member_npz, "'x.txt', which is not a .npy array"),
    ("badzip.npz", _bad_zip, "cannot read calibration inputs"),
    ("strings.npy", lambda p: np.save(p, np.array(["a", "b"])), "calibration inputs are numbers"),
    ("truncated.npy", _truncated_npy, "truncated"),
    ("huge.npy", _huge_header, "truncated"),
    ("corrupt.npz", _corrupt_npz_data, "cannot read calibration inputs"),
    ("a_folder", lambda p: p.mkdir(), "is a folder"),
    ("missing.npy", lambda p: None, "No such file"),
])
def test_unreadable_calibration_files(tremula, no_work, tmp_path, name, write, needle):
    path = tmp_path / name
    write(path)
    line = one_line_error(tremula("compile", "vit-tiny", "--dtype", "fp8", "--calibration", str(path)), needle)
    assert "cannot read calibration inputs" in line and name in line


def test_empty_calibration_path(tremula, no_work):
    one_line_error(tremula("compile", "vit-tiny", "--dtype", "fp8", "--calibration", ""), "needs a file name")


def test_calibration_bigger_than_the_host_is_refused_from_its_header():
    with pytest.raises(TremulaError, match="more than this host's"):
        cli._check_fits_in_memory("big.npz", {"x": ((1 << 50,), np.dtype(np.float32))})


def test_good_calibration_files_are_read(tmp_path):
    np.save(tmp_path / "one.npy", np.arange(6, dtype=np.float32).reshape(2, 3))
    np.savez_compressed(tmp_path / "two.npz", a=np.ones((2, 3), np.int64), b=np.zeros((2,), np.float16))
    one = cli._calibration(str(tmp_path / "one.npy"))
    two = cli._calibration(str(tmp_path / "two.npz"))
    assert list(one) == [""] and one[""].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert sorted(two) == ["a", "b"] and two["a"].dtype == np.int64 and two["b"].shape == (2,)


def test_negative_seed(tremula, no_work):
    one_line_error(tremula("check", "vit-tiny", "--seed", "-1"), "--seed", "-1")


# ------------------------------------------------------------------------------------------------ 4. --calibration


@pytest.mark.parametrize("command", ["compile", "check"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "FP16"])
def test_calibration_outside_fp8_is_refused(tremula, no_work, tmp_path, command, dtype):
    np.save(tmp_path / "cal.npy", np.ones((1, 3, 32, 32), np.float32))
    one_line_error(tremula(command, "vit-tiny", "--dtype", dtype, "--calibration", str(tmp_path / "cal.npy")),
                   "--calibration applies to --dtype fp8 only")


# ------------------------------------------------------------------------------------------------ 5. small things


@pytest.mark.parametrize("given, meant", [("FP16", "fp16"), ("Fp8", "fp8"), ("FP32", "fp32"), (" fp16 ", "fp16")])
def test_dtype_in_any_case(tremula, monkeypatch, given, meant):
    seen = {}

    def record(model, chip, batch, dtype, *args, **kwargs):
        seen["dtype"] = dtype
        raise TremulaError("stop here")

    monkeypatch.setattr(compiler, "compile_model", record)
    one_line_error(tremula("compile", "vit-tiny", "--dtype", given), "stop here")
    assert seen["dtype"] == meant


def test_unknown_dtype(tremula, no_work):
    one_line_error(tremula("compile", "vit-tiny", "--dtype", "int8"), "--dtype 'int8'")


def _piped(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    p = subprocess.run([sys.executable, "-m", "tremula", *args], capture_output=True, text=True, timeout=120,
                       env=env)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_piped_tables_keep_whole_rows():
    chips = _piped("chips").splitlines()
    header = next(ln for ln in chips if "name" in ln and "arch" in ln)
    assert "exchange GB/s/tile" in header and "host GB/s" in header and "…" not in "".join(chips)
    c600 = next(ln for ln in chips if " c600 " in ln).split("│")
    assert [c.strip() for c in c600[1:-1]] == ["c600", "ipu21", "1472", "624", "897.0", "1.500", "70.7", "282.6",
                                               "565.2", "6.00", "31.5"]
    mk2 = [c.strip() for c in next(ln for ln in chips if " mk2 " in ln).split("│")[1:-1]]
    assert mk2[8] == "-"
    zoo = _piped("zoo")
    assert "siglip-so400m-patch14-384" in zoo and "…" not in zoo and "pixel_values float32[1,3,384,384]" in zoo


def test_piped_inspect_table(tremula):
    code, out, _ = tremula("inspect", "bert-tiny")
    assert code == 0 and "…" not in out
    # (the first Linear row is the fused Q, K and V projection: passes/fuse_qkv.py)
    assert any("Linear" in ln and "float32[1,16,32] float32[32,96] float32[96]" in ln for ln in out.splitlines())


def test_chips_json_numbers(tremula):
    code, out, _ = tremula("chips", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 0
    assert rows["c600"]["tiles"] == 1472 and isinstance(rows["c600"]["tiles"], int)
    assert rows["c600"]["FP8 TFLOP/s"] == 565.2 and rows["c600"]["clock GHz"] == 1.5
    assert rows["mk2"]["FP8 TFLOP/s"] is None and rows["mk2"]["SRAM/tile KiB"] == 624
    assert all(isinstance(v, (int, float)) for r in rows.values() for k, v in r.items()
               if k not in ("name", "arch") and v is not None)


HOSTILE = "\x1b[31mred\x1b]0;title\x07[bold]x[/bold][/]\u202e"


# The HTML report draws names into its plots, where matplotlib warns about the control characters' missing glyphs.
@pytest.mark.filterwarnings("ignore:Glyph .* missing from font")
def test_names_from_a_model_are_shown_not_obeyed(tremula, tmp_path):
    model = tmp_path / "esc.onnx"
    onnx.save(matmul_model(graph_name=HOSTILE, node_name="node" + HOSTILE, input_name="in" + HOSTILE), model)
    code, out, err = tremula("inspect", str(model))
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    shown = "\\x1b[31mred\\x1b]0;title\\x07[bold]x[/bold][/]\\u202e"
    assert shown in out.splitlines()[0]  # the graph's name: escaped, and its markup printed, not applied
    assert f"input  in{shown}: float32[1,4]" in out
    code, out, err = tremula("compile", str(model), "--chip", str(TINY_CHIP), "--report", str(tmp_path / "r.html"))
    assert code == 0, err
    assert "\x1b" not in out and f"why: node{shown} (Linear" in out
    code, out, err = tremula("inspect", str(model), "--json")
    assert code == 0 and "\x1b" not in out and "\u202e" not in out and json.loads(out)["name"] == HOSTILE


def test_notices_are_escaped(capsys):
    from tremula.errors import TremulaNotice

    cli._show_notice(f"input {HOSTILE} defaulted", TremulaNotice, "x.py", 1)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "tremula: note: input \\x1b[31mred" in err


def test_names_in_errors_are_escaped(tremula, tmp_path):
    line = one_line_error(tremula("inspect", str(tmp_path / "nope\x1b[2J\n[bold].onnx")))
    assert "\x1b" not in line and "nope\\x1b[2J\\n[bold].onnx" in line


def test_printable():
    assert cli.printable("plain [text] ünïcode 中文") == "plain [text] ünïcode 中文"
    assert cli.printable("a\x1bb\x9bc\r\n\t\u2028\udcff") == "a\\x1bb\\x9bc\\r\\n\\t\\u2028\\udcff"
    assert cli.safe("[bold]x") == "\\[bold]x"


def test_license_is_an_spdx_string():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert any(r.replace(" ", "").startswith("setuptools>=77") for r in project["build-system"]["requires"])


def test_weights_option(tremula, tmp_path):
    """--weights streamed on a model with four identical layers says what it streams (text and JSON); a model with two
    cannot stream, and a bad value or --weights with --system is refused, each in one line."""
    from tremula.export.onnx_export import save_onnx
    from tremula.frontends.zoo import _vision
    from tremula.models.build import build_from_config
    from tremula.models.weights import LazyWeights

    path = tmp_path / "siglip4.onnx"
    save_onnx(build_from_config("siglip", _vision("siglip", 32, 4, 4, 48, 32, 8, 1e-6, "gelu_tanh"), LazyWeights(),
                                batch=2, name="siglip-tiny4"), path)
    code, out, err = tremula("compile", path, "--chip", "c600", "--dtype", "fp16", "--weights", "streamed")
    assert code == 0, err
    assert "weights streamed" in out and "4 layers of" in out
    code, out, err = tremula("compile", path, "--chip", "c600", "--dtype", "fp16", "--weights", "streamed", "--json")
    got = json.loads(out)
    assert list(got["streamed_layers"].values()) == [4] and 0 < got["streamed_bytes"] < got["host_in_bytes"]
    one_line_error(tremula("compile", "vit-tiny", "--weights", "streamed"), "no run of 3 or more identical")
    one_line_error(tremula("compile", "vit-tiny", "--weights", "sometimes"), "unsupported --weights")
    one_line_error(tremula("compile", "vit-tiny", "--system", "2xc600", "--weights", "streamed"), "--weights",
                   "not supported with --system")

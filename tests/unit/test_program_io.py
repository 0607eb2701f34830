"""Program files: save -> load -> save is byte-identical, two compiles give identical files, damage fails cleanly."""

import numpy as np
import pytest

from tremula.compiler import compile_model
from tremula.errors import TremulaError
from tremula.program import load_program, save_program
from tremula.target.chip import load_chip


@pytest.fixture(scope="module")
def chip():
    return load_chip("mk2")


def test_roundtrip_is_byte_identical(tmp_path, chip):
    res = compile_model("bert-tiny", chip, 2, "fp32")
    a, b = tmp_path / "a.tremula", tmp_path / "b.tremula"
    save_program(res.program, a)
    p2 = load_program(a)
    save_program(p2, b)
    assert a.read_bytes() == b.read_bytes()
    assert p2.n_vertices() == res.program.n_vertices() and p2.n_transfers() == res.program.n_transfers()
    s0, s1 = res.program.steps[3], p2.steps[3]
    assert [g.codelet for g in s0.compute] == [g.codelet for g in s1.compute]
    np.testing.assert_array_equal(s0.exchange.d_addr, s1.exchange.d_addr)
    assert p2.consts == res.program.consts and p2.host_in == res.program.host_in
    assert [s.origin for s in p2.steps] == [s.origin for s in res.program.steps]  # provenance kept


def test_two_compiles_give_identical_files(tmp_path, chip):
    for i in range(2):
        save_program(compile_model("gpt2-tiny", chip, 1, "fp16").program, tmp_path / f"p{i}.tremula")
    assert (tmp_path / "p0.tremula").read_bytes() == (tmp_path / "p1.tremula").read_bytes()


def test_loaded_program_still_simulates(tmp_path, chip):
    from tremula.feeds import make_feeds
    from tremula.frontends import load_model
    from tremula.ir import run
    from tremula.pipeline import canonical
    from tremula.sim.functional import simulate

    res = compile_model("vit-tiny", chip, 1, "fp32")
    save_program(res.program, tmp_path / "v.tremula")
    g = canonical(load_model("vit-tiny", 1))
    feeds = make_feeds(g, 3)
    got = simulate(load_program(tmp_path / "v.tremula"), g, feeds)
    ref = run(g, feeds)
    for k in g.outputs:
        assert np.max(np.abs(got[k] - ref[k])) <= 1e-4 * np.max(np.abs(ref[k]))


@pytest.mark.parametrize("content", [b"", b"not a zip", b"PK\x03\x04garbage"])
def test_damaged_file_is_a_one_line_error(tmp_path, content):
    p = tmp_path / "bad.tremula"
    p.write_bytes(content)
    with pytest.raises(TremulaError) as e:
        load_program(p)
    assert "\n" not in str(e.value)


def test_truncated_file_is_an_error(tmp_path, chip):
    p = tmp_path / "t.tremula"
    save_program(compile_model("bert-tiny", chip, 1, "fp32").program, p)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(TremulaError):
        load_program(p)


def test_program_of_an_onnx_file_saves(tmp_path):
    # An imported graph's shapes and a constant's placement may be NumPy integers; the header must still be JSON.
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    w = numpy_helper.from_array(np.ones((8, 4), np.float32), "W")
    model = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g", [x], [y], [w]),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "mm.onnx")
    res = compile_model(str(tmp_path / "mm.onnx"), load_chip("examples/chips/tiny16.toml"))
    save_program(res.program, tmp_path / "mm.tremula")
    back = load_program(tmp_path / "mm.tremula")
    assert back.batch == 2 and len(back.steps) == len(res.program.steps)

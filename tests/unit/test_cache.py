"""cache.py: FP8 scales kept between runs under a key of everything they are computed from, and a compile that takes
them from there makes the Program a calibrating compile makes."""

import json
import warnings

import numpy as np
import pytest

from tremula import cache
from tremula.compiler import compile_model
from tremula.errors import TremulaNotice
from tremula.fp8_calibration import SCALES_ENTRY, Stored, calibration_job
from tremula.frontends import load_model
from tremula.ir.graph import Constant, DerivedInit, LazyInit
from tremula.program import save_program
from tremula.target.chip import load_chip


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _key(g, extra=None):
    return cache.key("test", 1, g, extra or {})


def test_the_key_names_the_graph_its_weights_and_the_other_inputs(folder):
    g = load_model("bert-tiny", batch=2)
    k = _key(g)
    assert k is not None and k == _key(load_model("bert-tiny", batch=2))  # the same model built again
    assert k != _key(load_model("bert-tiny", batch=3))
    assert k != _key(g, {"seed": 1}) and _key(g, {"seed": 1}) != _key(g, {"seed": 2})
    feeds = {"x": np.arange(6, dtype=np.float32)}
    other = {"x": np.arange(6, dtype=np.float32)[::-1].copy()}
    assert _key(g, {"feeds": feeds}) != _key(g, {"feeds": other})
    name = next(n for n, c in g.constants.items() if isinstance(c.init, LazyInit))
    c = g.constants[name]
    g.constants[name] = Constant(name, c.type, init=LazyInit(c.init.kind, c.init.seed + 1, c.init.mean, c.init.std))
    assert _key(g) != k  # another seed: other weights
    g.constants[name] = Constant(name, c.type, data=c.value().copy())
    with_data = _key(g)
    g.constants[name].data[(0,) * c.value().ndim] += 1  # one value changed
    assert with_data not in (k, _key(g))
    g.nodes[0].attrs["extra"] = 1.5
    assert _key(g) != with_data
    g.constants[name] = Constant(name, c.type, init=DerivedInit(c, lambda x: x, "a copy"))
    assert _key(g) is None  # a constant made by a function: no key, not cached


def test_the_key_changes_with_the_code_and_the_cache_can_be_off(folder, monkeypatch):
    g = load_model("bert-tiny", batch=2)
    k = _key(g)
    monkeypatch.setattr(cache, "code_fingerprint", lambda: "another tremula")
    assert _key(g) != k
    for off in ("", "off", "OFF"):
        monkeypatch.setenv(cache.ENV, off)
        assert cache.cache_dir() is None and _key(g) is None


def test_entries_are_written_whole_and_unreadable_ones_are_misses(folder):
    assert cache.load("test", "ab") is None
    path = cache.store("test", "ab", {"scales": {"a": -3}})
    assert path == folder / "test" / "ab.json" and cache.load("test", "ab") == {"key": "ab", "scales": {"a": -3}}
    assert [p.name for p in (folder / "test").iterdir()] == ["ab.json"]  # no temporary file left
    path.write_text(json.dumps({"key": "cd", "scales": {}}))  # another key's entry under this name
    assert cache.load("test", "ab") is None
    path.write_text("{ half an entr")
    assert cache.load("test", "ab") is None
    (folder / "blocked").write_text("a file where the entries' folder would be")
    assert cache.store("blocked", "ab", {"scales": {}}) is None  # not written, and no error


def _compiled_bytes(res, path):
    res.program.meta = {}
    save_program(res.program, path)
    return path.read_bytes()


def test_a_second_compile_takes_the_scales_and_makes_the_same_program(folder, tmp_path):
    """The first FP8 compile calibrates and stores its scales; the second is told it takes them from the cache, and
    its --batch auto answer and Program are those of the first, byte for byte (it plans as beside a calibration)."""
    chip = load_chip("c600")
    build = lambda b: load_model("bert-tiny", batch=b)  # noqa: E731
    with warnings.catch_warnings(record=True) as first_notes:
        warnings.simplefilter("always")
        cold = compile_model("bert-tiny", chip, "auto", "fp8")
    assert not any("from the cache" in str(w.message) for w in first_notes)
    stored = list((folder / SCALES_ENTRY).glob("*.json"))
    assert len(stored) == 1
    with pytest.warns(TremulaNotice, match="FP8 scales from the cache"):
        job = calibration_job(build, None, None, chip)
    assert isinstance(job, Stored) and job() == json.loads(stored[0].read_text())["scales"]
    with pytest.warns(TremulaNotice, match="FP8 scales from the cache"):
        warm = compile_model("bert-tiny", chip, "auto", "fp8")
    assert (warm.batch, warm.auto, warm.cycles) == (cold.batch, cold.auto, cold.cycles)
    assert _compiled_bytes(warm, tmp_path / "warm") == _compiled_bytes(cold, tmp_path / "cold")


def test_other_calibration_inputs_are_calibrated(folder):
    """The user's own calibration arrays are part of the key: other arrays, another entry."""
    chip = load_chip("c600")
    build = lambda b: load_model("vit-tiny", batch=b)  # noqa: E731
    shape = build(2).types[build(2).inputs[0]].shape
    rng = np.random.default_rng(3)
    a = {"": rng.standard_normal(shape).astype(np.float32)}
    b = {"": rng.standard_normal(shape).astype(np.float32) * 4}
    scales_a = calibration_job(build, None, a, chip)()
    assert not isinstance(calibration_job(build, None, b, chip), Stored)
    with pytest.warns(TremulaNotice, match="from the cache"):
        again = calibration_job(build, None, a, chip)
    assert isinstance(again, Stored) and again() == scales_a

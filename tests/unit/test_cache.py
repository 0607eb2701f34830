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


def test_a_read_only_array_is_hashed_once_for_the_graphs_that_share_it(folder, monkeypatch):
    """Two graphs holding the same read-only weights (a compile's graph and its calibration's, rebatched from it) hash
    their bytes once; the keys are the ones hashing them again gives, and a writable array is hashed every time."""
    g = load_model("bert-tiny", batch=2)
    for name, c in list(g.constants.items()):
        a = c.value().copy()
        a.flags.writeable = False  # (as a model file's weights are imported, and seeded ones made)
        g.constants[name] = Constant(name, c.type, data=a)
    arrays = [c.data for c in g.constants.values()]
    hashed = []
    real = cache._value

    def value(h, v):
        if isinstance(v, np.ndarray):
            hashed.append(v)
        real(h, v)

    monkeypatch.setattr(cache, "_value", value)
    first = _key(g)
    n = sum(any(v is a for a in arrays) for v in hashed)
    assert n == len(arrays)
    hashed.clear()
    assert _key(g.copy()) == first and not any(any(v is a for a in arrays) for v in hashed)
    cache._DIGESTS.clear()  # hashed again from the bytes: the same key
    assert _key(g) == first
    w = g.constants[next(iter(g.constants))].data.copy()  # writable: never kept
    assert cache._array_digest(w) == cache._array_digest(w.copy()) and not cache._DIGESTS.holds(w)


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


def test_a_second_auto_compile_takes_the_scales_and_the_answer_and_makes_the_same_program(folder, tmp_path,
                                                                                         monkeypatch):
    """The first FP8 --batch auto calibrates and searches, and stores its scales and its answer; the second is told
    it takes both from the cache, searches no batch, and its answer and Program are those of the first, byte for
    byte. A compile with other options searches."""
    import tremula.compiler as compiler

    searched = []
    real = compiler.find_max_batch
    monkeypatch.setattr(compiler, "find_max_batch", lambda *a, **k: searched.append(1) or real(*a, **k))
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
    assert searched == [1]
    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        warm = compile_model("bert-tiny", chip, "auto", "fp8")
    told = " | ".join(str(w.message) for w in notes)
    assert "FP8 scales from the cache" in told and "the search's answer from the cache" in told
    assert searched == [1]  # no search the second time
    assert (warm.batch, warm.auto, warm.cycles) == (cold.batch, cold.auto, cold.cycles)
    assert _compiled_bytes(warm, tmp_path / "warm") == _compiled_bytes(cold, tmp_path / "cold")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compile_model("bert-tiny", chip, "auto", "fp8", partials="float")
    assert searched == [1, 1]


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
    for entry in (folder / SCALES_ENTRY).glob("*.json"):  # a field the note tells that is not a number: no error
        entry.write_text(entry.read_text().replace('"seconds": ', '"seconds": "x", "was": '))
    with pytest.warns(TremulaNotice, match="samples by an earlier run"):
        assert calibration_job(build, None, a, chip)() == scales_a


@pytest.mark.parametrize("model,dtype", [("bert-tiny", "fp16"), ("siglip-tiny", "fp8")])
def test_a_second_compile_at_a_batch_lowers_the_stored_recipe_once(folder, tmp_path, monkeypatch, model, dtype):
    """A compile at a fixed batch stores the Recipe of the plan it grew; the next one lowers it once (fp8: once with
    all-zero scales, once again with the calibrated ones, as a calibrating compile does) and makes the same Program.
    An entry that is not a Recipe is planned again, and replaced."""
    from tremula import pipeline
    from tremula.compiler import PLAN_ENTRY

    lowered = []
    real = pipeline._lowered
    monkeypatch.setattr(pipeline, "_lowered", lambda *a, **k: lowered.append(1) or real(*a, **k))
    chip = load_chip("c600")
    cold = compile_model(model, chip, 4, dtype)
    first = len(lowered)
    (entry,) = (folder / PLAN_ENTRY).glob("*.json")
    lowered.clear()
    with pytest.warns(TremulaNotice, match="plan's choices from the cache"):
        warm = compile_model(model, chip, 4, dtype)
    assert len(lowered) == (2 if dtype == "fp8" else 1) < first  # (cold: the budgets tried and growth steps)
    assert warm.cycles == cold.cycles
    assert _compiled_bytes(warm, tmp_path / "warm") == _compiled_bytes(cold, tmp_path / "cold")
    good = entry.read_text()
    entry.write_text(good.replace('"budget"', '"budgets"'))
    lowered.clear()
    again = compile_model(model, chip, 4, dtype)
    assert len(lowered) == first and entry.read_text() == good
    assert _compiled_bytes(again, tmp_path / "again") == _compiled_bytes(cold, tmp_path / "cold")

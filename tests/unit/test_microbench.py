"""AMP microbenchmark and calibration table: the model against the published measurements."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from tremula.chip import load_chip
from tremula.timing import calibrate
from tremula.timing.calibrate import calibration_rows, end_to_end_rows
from tremula.timing.microbench import MEASURED_AMP_TFLOPS, amp_microbench


def test_amp_curve_within_10_percent_on_bow():
    rows = amp_microbench(load_chip("bow"), [16, 128, 2048])
    assert [r["n"] for r in rows] == [16, 128, 2048]
    for r in rows:
        assert r["measured_tflops"] == MEASURED_AMP_TFLOPS["bow"][r["n"]]
        assert abs(r["error_pct"]) <= 10.0, r
        assert math.isclose(r["error_pct"], 100 * (r["model_tflops"] / r["measured_tflops"] - 1))


def test_amp_curve_rises_towards_peak():
    bow = load_chip("bow")
    rows = amp_microbench(bow, [16, 32, 64, 128, 512, 2048, 8192])
    pct = [r["model_pct_peak"] for r in rows]
    assert all(a < b for a, b in itertools.pairwise(pct))
    assert 0 < pct[0] < 30 and 90 < pct[-1] <= 100
    assert rows[1]["measured_tflops"] is None and rows[1]["error_pct"] is None  # no measurement at N=32


def test_amp_microbench_other_chips_have_no_measurement():
    rows = amp_microbench(load_chip("c600"), [128])
    assert rows[0]["measured_tflops"] is None and rows[0]["model_tflops"] > 0


def test_calibration_rows_without_models():
    rows = calibration_rows(include_models=False)
    keys = {"quantity", "source", "measured", "model", "unit", "error_pct", "note"}
    assert all(keys <= set(r) for r in rows)
    assert len([r for r in rows if r["quantity"].startswith("AMP")]) == 3
    assert any("exchange bytes per cycle" in r["quantity"] for r in rows)
    assert any("8 TB/s" in r["source"] for r in rows)
    assert any("SYNC_CYCLES" in r["source"] for r in rows)
    for r in rows:
        assert isinstance(r["model"], float | int) and r["error_pct"] is not None
        assert "ipu-hardware.md" in r["source"]
    elk = next(r for r in rows if "exchange bytes per cycle" in r["quantity"])
    assert math.isclose(elk["measured"], 1 / 0.28)


def test_end_to_end_rows_pending_without_compiler(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_compiler(name, *a, **k):
        if name == "tremula.compiler":
            raise ImportError("not yet")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_compiler)
    rows = end_to_end_rows()
    assert len(rows) == len(calibrate.END_TO_END) == 4
    assert all(r["model"] == "pending" and r["error_pct"] is None for r in rows)


def test_end_to_end_rows_use_the_compiler_cycles():
    class Fake:
        def __init__(self, cycles):
            self.cycles, self.fits = cycles, True

    calls = []

    def fake_compile(model, chip, batch, dtype, require_fit):
        calls.append((model, chip.name, batch, dtype, require_fit))
        return Fake(1_500_000)

    rows = end_to_end_rows(fake_compile)
    assert calls[0] == ("vit-base-patch16-224", "c600", 8, "fp16", False)
    # items/s = batch x clock / cycles = 8 x 1.5e9 / 1.5e6
    assert math.isclose(rows[0]["model"], 8000.0)
    assert math.isclose(rows[0]["error_pct"], 100 * (8000 / 2600 - 1))


def test_end_to_end_row_with_the_real_compiler():
    # Wiring only (a tiny model stands in for ViT-B/16 so the test is fast); `tremula calibrate` runs the real rows.
    compiler = pytest.importorskip("tremula.compiler")
    e = dataclasses.replace(calibrate.END_TO_END[0], model="vit-tiny", batch=2)
    r = end_to_end_rows(compiler.compile_model, entries=(e,))[0]
    res = compiler.compile_model("vit-tiny", load_chip("c600"), batch=2, dtype="fp16", require_fit=False)
    assert r["quantity"].startswith("vit-tiny") and math.isclose(r["model"], 2 * 1.5e9 / res.cycles)

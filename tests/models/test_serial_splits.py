"""On a chip with few small tiles the planner must split matmuls serially over M, and the result must still be exact."""

from pathlib import Path

from tremula.chip import load_chip
from tremula.compiler import check_model, compile_model

TINY16 = str(Path(__file__).resolve().parents[2] / "examples" / "chips" / "tiny16.toml")


def test_tiny16_plans_serial_splits_and_checks():
    chip = load_chip(TINY16)
    res = compile_model("vit-tiny", chip, 8, "fp32")
    serial = [s for s in res.strategies.values() if s.startswith("linear") and "serial=1 " not in s]
    assert serial, res.strategies
    assert res.peak_tile_bytes <= chip.sram_bytes_per_tile
    chk = check_model("vit-tiny", chip, 8, "fp32")
    assert chk.passed, chk.outputs

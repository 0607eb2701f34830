"""On a chip with few small tiles the planner must split matmuls serially over M, and the result must still be exact."""

from pathlib import Path

from tremula.check import check_model
from tremula.compiler import compile_model
from tremula.target.chip import load_chip

TINY16 = str(Path(__file__).resolve().parents[2] / "examples" / "chips" / "tiny16.toml")


def test_tiny16_plans_serial_splits_and_checks(tmp_path):
    # tiny16 with 80 KiB tiles at batch 16: since matmul operands keep to separate memory elements (plan/elements.py),
    # vit-tiny at batch 8 no longer fits tiny16's 64 KiB, and at batch 4 it needs no serial split.
    path = tmp_path / "tiny16-80k.toml"
    path.write_text(Path(TINY16).read_text().replace("sram_bytes_per_tile = 65536", "sram_bytes_per_tile = 81920"))
    chip = load_chip(str(path))
    res = compile_model("vit-tiny", chip, 16, "fp32")
    serial = [s for s in res.strategies.values() if s.startswith("linear") and "serial=1 " not in s]
    assert serial, res.strategies
    assert res.peak_tile_bytes <= chip.sram_bytes_per_tile
    chk = check_model("vit-tiny", chip, 16, "fp32")
    assert chk.passed, chk.outputs

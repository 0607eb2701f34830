"""Golden numbers: tiny BERT and ViT at batch 2 in fp16, compiled for every built-in chip, against the pins in
goldens.json (chip -> model -> cycles, steps, fullest tile, peak and memory by category).

The pins were computed once from the cost model, planner and memory plan and are kept as data, so any change to
cycles or memory fails here and shows as an explicit diff of goldens.json in review. If a change is intended, update
the numbers in the same change and say why in its description. A new built-in chip without pins fails too.
"""

import json
from pathlib import Path

import pytest

from tremula.compiler import compile_model
from tremula.target.chip import builtin_chip_names, load_chip

GOLDENS = json.loads((Path(__file__).with_name("goldens.json")).read_text())
CASES = [(chip, model) for chip in GOLDENS for model in sorted(GOLDENS[chip])]


def test_every_built_in_chip_has_pins():
    assert set(GOLDENS) == set(builtin_chip_names())


@pytest.mark.parametrize("chip,model", CASES, ids=[f"{c}-{m}" for c, m in CASES])
def test_golden(chip, model):
    want = GOLDENS[chip][model]
    # The pinned split must add up (a check on the literals themselves, not only on the compiler).
    assert want["compute"] + want["exchange"] + want["sync"] == want["cycles"]
    res = compile_model(model, load_chip(chip), batch=2, dtype="fp16")
    assert res.fits
    got = {
        "cycles": res.cycles, "compute": res.compute_cycles, "exchange": res.exchange_cycles, "sync": res.sync_cycles,
        "steps": res.steps, "fullest_tile": res.fullest_tile, "peak_tile_bytes": res.peak_tile_bytes,
        "memory_by_category": dict(res.memory_by_category),
    }
    assert got == want

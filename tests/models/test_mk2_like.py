"""Golden numbers for mk2: a tiny BERT and a tiny ViT (batch 2, fp16) compiled for the mk2 chip file.

The literals below are PINNED: they were computed once from the current cost model, planner and memory plan and
written here by hand, so that any change to cycles or memory shows up as a failing test and an explicit diff in review.
If a change is intended, update the numbers in the same change and say why in its description.
"""

import pytest

from tremula.chip import load_chip
from tremula.compiler import compile_model

CHIP = "mk2"
GOLDEN = {
    "bert-tiny": {
        "cycles": 39443, "compute": 27771, "exchange": 5772, "sync": 5900,
        "steps": 50, "fullest_tile": 24, "peak_tile_bytes": 26732,
        "memory_by_category": {
            "weights": 864, "activations": 96,
            "code": 22272, "vertex_state": 644, "exchange_code": 1600, "buffers": 1088},
    },
    "vit-tiny": {
        "cycles": 40249, "compute": 28791, "exchange": 5794, "sync": 5664,
        "steps": 48, "fullest_tile": 0, "peak_tile_bytes": 22776,
        "memory_by_category": {
            "weights": 1388, "activations": 32,
            "code": 18432, "vertex_state": 608, "exchange_code": 992, "buffers": 1120},
    },
}


@pytest.mark.parametrize("model", sorted(GOLDEN))
def test_mk2_golden(model):
    want = GOLDEN[model]
    res = compile_model(model, load_chip(CHIP), batch=2, dtype="fp16")
    got = {
        "cycles": res.cycles, "compute": res.compute_cycles, "exchange": res.exchange_cycles, "sync": res.sync_cycles,
        "steps": res.steps, "fullest_tile": res.fullest_tile, "peak_tile_bytes": res.peak_tile_bytes,
        "memory_by_category": dict(res.memory_by_category),
    }
    assert res.fits
    assert got == want
    # The pinned split must add up (a check on the literals themselves, not only on the compiler).
    assert want["compute"] + want["exchange"] + want["sync"] == want["cycles"]

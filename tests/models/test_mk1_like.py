"""Golden numbers for mk1: a tiny BERT and a tiny ViT (batch 2, fp16) compiled for the mk1 chip file.

The literals below are PINNED: they were computed once from the current cost model, planner and memory plan and
written here by hand, so that any change to cycles or memory shows up as a failing test and an explicit diff in review.
If a change is intended, update the numbers in the same change and say why in its description.
"""

import pytest

from tremula.chip import load_chip
from tremula.compiler import compile_model

CHIP = "mk1"
GOLDEN = {
    "bert-tiny": {
        "cycles": 39443, "compute": 27771, "exchange": 5772, "sync": 5900,
        "steps": 50, "fullest_tile": 24, "peak_tile_bytes": 25724,
        "memory_by_category": {
            "weights": 864, "activations": 96,
            "code": 21248, "vertex_state": 652, "exchange_code": 1608, "buffers": 1088},
    },
    "vit-tiny": {
        "cycles": 40274, "compute": 28797, "exchange": 5813, "sync": 5664,
        "steps": 48, "fullest_tile": 13, "peak_tile_bytes": 21032,
        "memory_by_category": {
            "weights": 766, "activations": 32,
            "code": 17408, "vertex_state": 536, "exchange_code": 968, "buffers": 1120},
    },
}


@pytest.mark.parametrize("model", sorted(GOLDEN))
def test_mk1_golden(model):
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

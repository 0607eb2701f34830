"""Golden numbers for mk2: a tiny BERT and a tiny ViT (batch 2, fp16) compiled for the mk2 chip file (pinned;
see golden.py for why and how to update them)."""

import pytest

from golden import check_golden

CHIP = "mk2"
GOLDEN = {
    "bert-tiny": {
        "cycles": 39465, "compute": 27771, "exchange": 5794, "sync": 5900,
        "steps": 50, "fullest_tile": 54, "peak_tile_bytes": 25368,
        "memory_by_category": {
            "weights": 668, "activations": 96,
            "code": 22272, "vertex_state": 536, "exchange_code": 536, "buffers": 1088},
    },
    "vit-tiny": {
        "cycles": 40313, "compute": 28791, "exchange": 5858, "sync": 5664,
        "steps": 48, "fullest_tile": 0, "peak_tile_bytes": 25340,
        "memory_by_category": {
            "weights": 1260, "activations": 96,
            "code": 21504, "vertex_state": 692, "exchange_code": 592, "buffers": 1120},
    },
}


@pytest.mark.parametrize("model", sorted(GOLDEN))
def test_mk2_golden(model):
    check_golden(CHIP, model, GOLDEN[model])

"""Golden numbers for mk1: a tiny BERT and a tiny ViT (batch 2, fp16) compiled for the mk1 chip file (pinned;
see golden.py for why and how to update them)."""

import pytest

from golden import check_golden

CHIP = "mk1"
GOLDEN = {
    "bert-tiny": {
        "cycles": 39091, "compute": 29687, "exchange": 4684, "sync": 4720,
        "steps": 40, "fullest_tile": 58, "peak_tile_bytes": 36564,
        "memory_by_category": {
            "weights": 212, "activations": 96,
            "code": 17792, "vertex_state": 708, "exchange_code": 1616, "buffers": 1088},
    },
    "vit-tiny": {
        "cycles": 39958, "compute": 30713, "exchange": 4761, "sync": 4484,
        "steps": 38, "fullest_tile": 0, "peak_tile_bytes": 37544,
        "memory_by_category": {
            "weights": 1494, "activations": 32,
            "code": 18016, "vertex_state": 592, "exchange_code": 1320, "buffers": 1120},
    },
}


@pytest.mark.parametrize("model", sorted(GOLDEN))
def test_mk1_golden(model):
    check_golden(CHIP, model, GOLDEN[model])

"""Golden numbers for bow: a tiny BERT and a tiny ViT (batch 2, fp16) compiled for the bow chip file (pinned;
see golden.py for why and how to update them)."""

import pytest

from golden import check_golden

CHIP = "bow"
GOLDEN = {
    "bert-tiny": {
        "cycles": 39082, "compute": 29687, "exchange": 4675, "sync": 4720,
        "steps": 40, "fullest_tile": 58, "peak_tile_bytes": 41724,
        "memory_by_category": {
            "weights": 604, "activations": 96,
            "code": 22912, "vertex_state": 540, "exchange_code": 1480, "buffers": 1088},
    },
    "vit-tiny": {
        "cycles": 39941, "compute": 30707, "exchange": 4750, "sync": 4484,
        "steps": 38, "fullest_tile": 0, "peak_tile_bytes": 36816,
        "memory_by_category": {
            "weights": 1196, "activations": 32,
            "code": 18016, "vertex_state": 376, "exchange_code": 1136, "buffers": 1120},
    },
}


@pytest.mark.parametrize("model", sorted(GOLDEN))
def test_bow_golden(model):
    check_golden(CHIP, model, GOLDEN[model])

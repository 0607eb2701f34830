"""Golden numbers for c600: a tiny BERT and a tiny ViT (batch 2, fp16) compiled for the c600 chip file (pinned;
see golden.py for why and how to update them)."""

import pytest

from golden import check_golden

CHIP = "c600"
GOLDEN = {
    "bert-tiny": {
        "cycles": 39485, "compute": 27783, "exchange": 5802, "sync": 5900,
        "steps": 50, "fullest_tile": 58, "peak_tile_bytes": 25376,
        "memory_by_category": {
            "weights": 604, "activations": 96,
            "code": 22272, "vertex_state": 540, "exchange_code": 604, "buffers": 1088},
    },
    "vit-tiny": {
        "cycles": 40341, "compute": 28803, "exchange": 5874, "sync": 5664,
        "steps": 48, "fullest_tile": 0, "peak_tile_bytes": 23588,
        "memory_by_category": {
            "weights": 668, "activations": 96,
            "code": 20480, "vertex_state": 508, "exchange_code": 640, "buffers": 1120},
    },
}


@pytest.mark.parametrize("model", sorted(GOLDEN))
def test_c600_golden(model):
    check_golden(CHIP, model, GOLDEN[model])

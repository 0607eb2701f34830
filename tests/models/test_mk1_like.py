"""Golden numbers for mk1: a tiny BERT and a tiny ViT (batch 2, fp16) compiled for the mk1 chip file (pinned;
see golden.py for why and how to update them)."""

import pytest

from golden import check_golden

CHIP = "mk1"
GOLDEN = {
    "bert-tiny": {
        "cycles": 39493, "compute": 27783, "exchange": 5810, "sync": 5900,
        "steps": 50, "fullest_tile": 26, "peak_tile_bytes": 24784,
        "memory_by_category": {
            "weights": 800, "activations": 96,
            "code": 21248, "vertex_state": 584, "exchange_code": 800, "buffers": 1088},
    },
    "vit-tiny": {
        "cycles": 40362, "compute": 28809, "exchange": 5889, "sync": 5664,
        "steps": 48, "fullest_tile": 0, "peak_tile_bytes": 20384,
        "memory_by_category": {
            "weights": 702, "activations": 32,
            "code": 17408, "vertex_state": 424, "exchange_code": 560, "buffers": 1120},
    },
}


@pytest.mark.parametrize("model", sorted(GOLDEN))
def test_mk1_golden(model):
    check_golden(CHIP, model, GOLDEN[model])

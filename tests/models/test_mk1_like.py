"""Golden numbers for mk1: a tiny BERT and a tiny ViT (batch 2, fp16) compiled for the mk1 chip file (pinned;
see golden.py for why and how to update them)."""

import pytest

from golden import check_golden

CHIP = "mk1"
GOLDEN = {
    "bert-tiny": {
        "cycles": 39465, "compute": 27771, "exchange": 5794, "sync": 5900,
        "steps": 50, "fullest_tile": 22, "peak_tile_bytes": 24740,
        "memory_by_category": {
            "weights": 864, "activations": 96,
            "code": 21248, "vertex_state": 544, "exchange_code": 732, "buffers": 1088},
    },
    "vit-tiny": {
        "cycles": 40334, "compute": 28797, "exchange": 5873, "sync": 5664,
        "steps": 48, "fullest_tile": 0, "peak_tile_bytes": 20520,
        "memory_by_category": {
            "weights": 766, "activations": 32,
            "code": 17408, "vertex_state": 536, "exchange_code": 520, "buffers": 1120},
    },
}


@pytest.mark.parametrize("model", sorted(GOLDEN))
def test_mk1_golden(model):
    check_golden(CHIP, model, GOLDEN[model])

"""The shared check of the per-chip golden tests (test_<chip>_like.py): compile a tiny model and compare with pins.

Each chip's file holds literals that were computed once from the current cost model, planner and memory plan and
written there by hand, so that any change to cycles or memory shows up as a failing test and an explicit diff in
review. If a change is intended, update the numbers in the same change and say why in its description.
"""

from tremula.chip import load_chip
from tremula.compiler import compile_model


def check_golden(chip: str, model: str, want: dict) -> None:
    """Tiny models at batch 2 in fp16 on `chip` must reproduce `want` exactly."""
    res = compile_model(model, load_chip(chip), batch=2, dtype="fp16")
    got = {
        "cycles": res.cycles, "compute": res.compute_cycles, "exchange": res.exchange_cycles, "sync": res.sync_cycles,
        "steps": res.steps, "fullest_tile": res.fullest_tile, "peak_tile_bytes": res.peak_tile_bytes,
        "memory_by_category": dict(res.memory_by_category),
    }
    assert res.fits
    assert got == want
    # The pinned split must add up (a check on the literals themselves, not only on the compiler).
    assert want["compute"] + want["exchange"] + want["sync"] == want["cycles"]

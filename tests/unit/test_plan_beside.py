"""An FP8 compile at a fixed batch plans beside its calibration: with all-zero scales, then lowered again with the
calibrated ones at the choices made. The Program is the one planning with the calibrated scales makes, byte for byte,
and a plan that no longer fits (or streams) is planned again with them."""

import pytest

import tremula.compiler as compiler
from tremula.beside import can_fork
from tremula.compiler import compile_model
from tremula.fp8_calibration import calibrate
from tremula.frontends import load_model
from tremula.program import save_program
from tremula.target.chip import load_chip

pytestmark = pytest.mark.skipif(not can_fork(), reason="the calibration runs beside the plan only where it can fork")


def _same_program(a, b, tmp_path) -> bool:
    for r, name in ((a, "a"), (b, "b")):
        r.program.meta = {}
        save_program(r.program, tmp_path / name)
    return (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


def _serial(model: str, batch: int):
    """The compile with the scales calibrated first (what a compile did before it planned beside them)."""
    chip = load_chip("c600")
    scales = calibrate(lambda b: load_model(model, batch=b), None, None, chip)
    return compile_model(model, chip, batch, "fp8", scales=scales)


@pytest.mark.parametrize("model,batch", [("siglip-tiny", 2), ("bert-tiny", 3)])
def test_planned_beside_the_calibration_is_the_plan_made_after_it(model, batch, tmp_path, monkeypatch):
    relowered = []
    real = compiler.relowered
    monkeypatch.setattr(compiler, "relowered", lambda *a, **k: relowered.append(1) or real(*a, **k))
    beside = compile_model(model, "c600", batch, "fp8")
    assert relowered == [1]  # the zero-scale plan was kept, lowered again with the calibrated scales
    # Scales given (a pipeline stage's, check_model's calibrated first) are planned the same way: all zeros, then
    # lowered again with them, so a compile's Program does not depend on how its scales were had.
    assert _same_program(beside, _serial(model, batch), tmp_path)
    assert relowered == [1, 1]


def test_a_plan_that_does_not_fit_with_the_calibrated_scales_is_planned_again(tmp_path, monkeypatch):
    planned = []
    real = compiler.plan_graph
    monkeypatch.setattr(compiler, "plan_graph", lambda *a, **k: planned.append(a[4]) or real(*a, **k))
    # as if the plan lowered again with the calibrated scales overflowed (or streamed its weights)
    monkeypatch.setattr(compiler, "relowered", lambda *a, **k: None)
    beside = compile_model("siglip-tiny", "c600", 2, "fp8")
    assert len(planned) == 2 and set(planned[0].values()) == {0} and planned[1] != planned[0]
    monkeypatch.undo()
    assert _same_program(beside, _serial("siglip-tiny", 2), tmp_path)


def test_a_caller_keeping_the_seeded_weights_calibrates_beside_too(monkeypatch, tmp_path):
    """check_model keeps the seeded weights the calibration makes: the calibration still runs beside the plan (its
    weights are made again in this process), and the Program is the one a compile outside the block makes."""
    from tremula.ir.graph import sharing_weights

    beside = []
    real = compiler._calibration_beside
    monkeypatch.setattr(compiler, "_calibration_beside", lambda *a, **k: beside.append(1) or real(*a, **k))
    with sharing_weights():
        kept = compile_model("siglip-tiny", "c600", 2, "fp8")
    assert kept.fits and beside == [1]
    assert _same_program(kept, compile_model("siglip-tiny", "c600", 2, "fp8"), tmp_path)


@pytest.mark.parametrize("cores,threads", [(1, (1, 1)), (2, (1, 2)), (4, (3, 4))])
def test_the_calibration_leaves_the_planner_a_core_until_it_waits(monkeypatch, cores, threads):
    """The calibration beside the planning runs its matmuls on every core this process may use but one (at least
    one), and on every core once the planner waits for its scales (its scales do not depend on it:
    tests/unit/test_blocked_matmul.py)."""
    import time

    import tremula.compiler as compiler

    def job(threads_now):
        first, t0 = threads_now(), time.perf_counter()
        while threads_now() == first and time.perf_counter() - t0 < 2.0:  # (the planner "plans" until scales())
            time.sleep(0.01)
        return first, threads_now()

    monkeypatch.setattr(compiler, "usable_cores", lambda: cores)
    scales = compiler._calibration_beside(job)
    time.sleep(0.1)
    assert scales() == threads

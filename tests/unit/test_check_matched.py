"""check_matched runs the reordered references only as far as the verdict needs them: they only raise the
tolerance, so once every output passes the rest cannot change it; when none suffices, all of them ran."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import tremula.sim.reference as reference
from tremula.check import MATCHED_MIN_REL_ERR, REORDER_MARGIN, check_matched
from tremula.numerics import amp

REF = np.linspace(1.0, 2.0, 16, dtype=np.float32)


def _run(monkeypatch, got_err: float, spreads: dict[str, float], ready: tuple[str, ...] = ()):
    """check_matched on one output `got_err` (relative) away from the reference, each reordering `spreads[r]` away
    (those in `ready` computed before, as check_model's speculative one); returns (checks, the reorderings run in
    order)."""
    ran = []

    def fake(graph, split_sums, feeds, reorder=None):
        if reorder is not None:
            ran.append(reorder)
        return {"y": REF + np.float32(spreads[reorder] * 2.0) if reorder else REF.copy()}

    monkeypatch.setattr(reference, "matched_reference", fake)
    res = SimpleNamespace(graph=SimpleNamespace(outputs=["y"]), split_sums={})
    done = {r: {"y": REF + np.float32(spreads[r] * 2.0)} for r in ready}
    checks = check_matched(res, {}, {"y": REF + np.float32(got_err * 2.0)}, ready=done)  # (max |ref| is 2)
    return checks, ran


def test_no_reordering_below_the_resolution_floor(monkeypatch):
    checks, ran = _run(monkeypatch, MATCHED_MIN_REL_ERR / 2, {"reversed": 1.0, "float64": 1.0})
    assert checks[0].passed and ran == []


def test_the_second_reordering_is_skipped_once_the_first_suffices(monkeypatch):
    err = 1e-2
    checks, ran = _run(monkeypatch, err, {"reversed": err, "float64": 0.0})
    assert checks[0].passed and ran == ["reversed"]
    assert checks[0].threshold == pytest.approx(REORDER_MARGIN * err, rel=1e-3)


def test_every_reordering_runs_when_the_first_is_not_enough(monkeypatch):
    err = 1e-2
    checks, ran = _run(monkeypatch, err, {"reversed": 0.0, "float64": err})  # the second one's spread passes it
    assert checks[0].passed and ran == ["reversed", "float64"]
    checks, ran = _run(monkeypatch, err, {"reversed": 0.0, "float64": 0.0})  # none does: it fails, all ran
    assert not checks[0].passed and ran == ["reversed", "float64"]


def test_a_reordering_computed_before_is_used_only_where_it_would_have_run(monkeypatch):
    err = 1e-2
    checks, ran = _run(monkeypatch, err, {"reversed": err, "float64": 0.0}, ready=("reversed",))
    assert checks[0].passed and ran == []  # used, not run again
    assert checks[0].threshold == pytest.approx(REORDER_MARGIN * err, rel=1e-3)
    checks, ran = _run(monkeypatch, MATCHED_MIN_REL_ERR / 2, {"reversed": 1.0, "float64": 1.0}, ready=("reversed",))
    assert checks[0].passed and ran == [] and checks[0].threshold == MATCHED_MIN_REL_ERR  # not needed: not counted


@pytest.mark.parametrize("matched_first", [True, False])
def test_a_long_simulation_speculates_only_while_it_runs(monkeypatch, matched_first):
    """When the matched reference is made while a long simulation (here every one counts as long) still runs, the
    first reordered reference is made next, beside it; made after the simulation, a reordering runs only if the
    verdict needs it (bert-tiny fp16 matches the matched reference bit for bit: none). The verdict is the same. (The
    references run in a forked process: the events and the record of reorderings are the process-shared kind.)"""
    import multiprocessing

    import tremula.check as check
    import tremula.sim.functional as functional

    if check.usable_cores() < 2:
        pytest.skip("the references run beside the simulation only on two or more cores")
    # (bit for bit on every CPU with each AMP group summed exactly: numerics/amp.py)
    monkeypatch.setattr(amp, "EXACT_GROUP_SUMS", True)
    made, speculated = multiprocessing.Event(), multiprocessing.Event()
    real_ref, real_sim = reference.matched_reference, functional.simulate
    record = multiprocessing.SimpleQueue()  # the reorderings run, in either process
    flags = []  # check_model's own: the first it makes says the simulation has ended
    real_event = multiprocessing.Event
    monkeypatch.setattr(check.multiprocessing, "Event", lambda: flags.append(real_event()) or flags[-1])

    def matched(graph, split_sums, feeds, reorder=None):
        if reorder is not None:
            record.put(reorder)
            speculated.set()
            return real_ref(graph, split_sums, feeds, reorder=reorder)
        if not matched_first:  # made once the simulation has ended
            assert flags[0].wait(120)
        out = real_ref(graph, split_sums, feeds)
        made.set()
        return out

    def simulate(*args, **kwargs):
        out = real_sim(*args, **kwargs)
        if matched_first:  # (still running when the matched reference is made, until the reordering starts)
            assert made.wait(120) and speculated.wait(120)
        return out

    monkeypatch.setattr(reference, "matched_reference", matched)
    monkeypatch.setattr(functional, "simulate", simulate)
    monkeypatch.setattr(check, "SPECULATE_AFTER_SECONDS", -1.0)
    res = check.check_model("bert-tiny", "c600", 2, "fp16")
    assert res.passed and res.matched and all(m.rel_err == 0.0 for m in res.matched)
    reorders = []
    while not record.empty():
        reorders.append(record.get())
    assert reorders == ([check.FIRST_REORDERING] if matched_first else [])


@pytest.mark.parametrize("cores", [1, 2])
def test_the_references_run_beside_the_simulation_only_where_a_second_core_is_usable(monkeypatch, cores):
    """check_model counts the cores it may run on (beside.usable_cores: its affinity), not the machine's: on one it
    makes the references after the simulation, in its own process and with BLAS's own threads."""
    import tremula.check as check

    started = []
    real = check.beside
    monkeypatch.setattr(check, "usable_cores", lambda: cores)
    monkeypatch.setattr(check, "beside", lambda *a, **k: started.append(k.get("name")) or real(*a, **k))
    res = check.check_model("bert-tiny", "c600", 1, "fp16")
    assert res.passed
    assert started == (["tremula-references"] if cores > 1 else [])


def test_a_checks_weights_are_made_before_the_calibration_is_forked_and_once(monkeypatch):
    """check_model compiles with weights_ahead: at a fixed batch the seeded weights are made on every core before the
    FP8 calibration is forked, and held (sharing_weights), so that the calibration (in its process) and the graphs
    checked read those arrays: none is made again in this process."""
    import tremula.check as check
    import tremula.compiler as compiler
    import tremula.ir.graph as graph_mod
    from tremula.frontends import load_model

    made, real_make = [], graph_mod.LazyInit._make
    monkeypatch.setattr(graph_mod.LazyInit, "_make", lambda self, t: made.append((self, t.shape)) or real_make(self, t))
    at_fork = []
    real_beside = compiler._calibration_beside

    def calibration_beside(job):
        lazy = [c for c in load_model("vit-tiny", batch=3).constants.values() if isinstance(c.init, graph_mod.LazyInit)]
        at_fork.append((bool(lazy) and all((c.init, c.type.shape, c.type.dtype) in graph_mod._MADE for c in lazy),
                        len(made)))
        return real_beside(job)

    monkeypatch.setattr(compiler, "_calibration_beside", calibration_beside)
    res = check.check_model("vit-tiny", "c600", 2, "fp8")
    assert res.passed and at_fork == [(True, len(made))] and len(made) == len(set(made))


def test_a_check_the_compile_refuses_makes_no_weight(monkeypatch):
    """The weights are made ahead only once the compile knows the batch is not refused: a batch over the lower bound
    is refused in a line, as before, having made none."""
    import tremula.check as check
    import tremula.ir.graph as graph_mod
    from tremula.limits import TooBig

    made = []
    monkeypatch.setattr(graph_mod.LazyInit, "_make", lambda self, t: made.append(self) or np.zeros(t.shape, t.dtype))
    with pytest.raises(TooBig):
        check.check_model("vit-tiny", "c600", 1 << 20, "fp8")
    assert not made

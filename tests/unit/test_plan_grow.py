"""pipeline._grown: a plan that fits has its operand budget grown into the bytes it left free, on a synthetic planner
whose peak and cycles are functions of the budget."""

from dataclasses import dataclass

import pytest

from tremula import pipeline


@dataclass
class _MP:
    peak_bytes: int
    fits: bool
    code_region_used: None = None
    code_region_bytes: None = None


@dataclass
class _Chip:
    sram_bytes_per_tile: int = 1000


def _planner(monkeypatch, peak, cycles):
    tried: list[float] = []

    class Lowerer:
        def __init__(self, g, chip, progress, temp_fraction, level_weights=False, **kw):
            self.tf, self.level_weights = temp_fraction, level_weights

        def lower(self):
            tried.append(self.tf)
            return self

    def memory_plan(state, chip, streaming=None, both_orders=False):
        p = int(peak(state.tf))
        return _MP(p, p <= chip.sram_bytes_per_tile), None, None

    monkeypatch.setattr(pipeline, "memory_plan", memory_plan)
    monkeypatch.setattr(pipeline, "state_cycles", lambda state, chip: (int(cycles(state.tf)), 0, 0))
    return tried, Lowerer, memory_plan


def _grow(monkeypatch, peak, cycles, tf0, steps=3):
    tried, Lowerer, memory_plan = _planner(monkeypatch, peak, cycles)
    first = Lowerer(None, None, None, temp_fraction=tf0)
    plan = (first, *memory_plan(first, _Chip()))

    def lower(budget, level):  # (plan_graph's)
        return Lowerer(None, None, None, temp_fraction=budget[0], level_weights=level).lower()

    state, mp, _, _ = pipeline._grown(lower, _Chip(), plan, (tf0, None, True, "free"), steps)
    return tried, state.tf, mp


def test_growth_gives_the_free_bytes_to_the_temporaries_and_keeps_the_fastest(monkeypatch):
    # fits up to 0.5; each step gives 0.6 of the free fraction (TEMP_FRACTION / BUFFER_FRACTION) to the budget
    tried, tf, mp = _grow(monkeypatch, lambda t: 500 + 1000 * t, lambda t: 1000 - 100 * int(t * 10), 0.2)
    assert tried == pytest.approx([0.38, 0.452, 0.4808])
    assert tf == pytest.approx(0.452) and mp.fits  # 0.4808 is no faster: the first of the fastest is kept


def test_a_budget_that_overflows_halves_the_step_and_is_never_passed(monkeypatch):
    # fits up to 0.25: 0.28 does not, 0.19 (halfway back) does with 0.12 free, 0.262 does not, 0.226 does
    tried, tf, mp = _grow(monkeypatch, lambda t: 500 + 2000 * t, lambda t: 1000 - 1000 * t, 0.1, steps=4)
    assert tried == pytest.approx([0.28, 0.19, 0.262, 0.226])
    assert tf == pytest.approx(0.226) and mp.fits and mp.peak_bytes == 952


def test_growth_stops_at_the_first_plan_the_budget_does_not_change(monkeypatch):
    tried, tf, _ = _grow(monkeypatch, lambda t: 600, lambda t: 1000, 0.2)
    assert tried == pytest.approx([0.44]) and tf == pytest.approx(0.2)

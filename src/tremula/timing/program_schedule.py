"""Timetables for every exchange of a Program: each step's makespan against its lower bound, and the exchange code
the timetables need per tile. The reports charge these makespans instead of the planner's bound when given."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tremula.program import Program
from tremula.target.chip import Chip
from tremula.timing.timetable import schedule_exchange


@dataclass(frozen=True)
class StepExchange:
    step: int
    label: str
    makespan: int  # cycles of the scheduled timetable, fixed cost included
    lower_bound: int  # busiest port's bytes / bandwidth + fixed cost
    # Exchange code bytes per tile of this step's timetable: its chunks priced by the chip's encoding model, as the
    # memory plan prices whole transfers (Timetable.exchange_code_bytes); None when not kept.
    code_bytes: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def ratio(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound else 1.0

    def to_json(self) -> dict:
        return {"step": self.step, "label": self.label, "makespan": self.makespan, "lower_bound": self.lower_bound,
                "ratio": self.ratio}


@dataclass(frozen=True)
class ScheduleSummary:
    """Totals over a program's timetables and the step furthest above its bound."""

    exchanges: int
    makespan: int
    lower_bound: int
    worst_step: int
    worst_label: str
    worst_ratio: float

    @property
    def ratio(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound else 1.0

    def to_json(self) -> dict:
        return {**self.__dict__, "ratio": self.ratio}


def schedule_program(program: Program, chip: Chip,
                     progress: Callable[[str, int, int], None] | None = None) -> list[StepExchange]:
    """Schedule every step's exchange (steps with the same traffic up to tile names are scheduled once, see
    schedule_exchange)."""
    rows = []
    for k, step in enumerate(program.steps):
        if progress:
            progress("timetables", k, len(program.steps))
        if len(step.exchange):
            tt = schedule_exchange(step.exchange, chip)
            rows.append(StepExchange(k, step.label, int(tt.makespan), int(tt.lower_bound),
                                     tt.exchange_code_bytes(chip).astype(np.int64)))
    if progress:
        progress("timetables", len(program.steps), len(program.steps))
    return rows


def summarize(exchanges: list[StepExchange]) -> ScheduleSummary | None:
    """Total makespan vs total bound, and the worst step (first of equals); None when nothing was scheduled."""
    if not exchanges:
        return None
    worst = max(exchanges, key=lambda e: e.ratio)
    return ScheduleSummary(len(exchanges), sum(e.makespan for e in exchanges), sum(e.lower_bound for e in exchanges),
                           worst.step, worst.label, worst.ratio)


def timetable_line(t: dict) -> str:
    """One line for ScheduleSummary.to_json(): totals and the worst step (the CLI prints it, the report shows it)."""
    return (f"{t['exchanges']} exchanges: {t['makespan']:,} cycles scheduled vs {t['lower_bound']:,} lower bound "
            f"({t['ratio']:.3f}x); worst step {t['worst_step']} ({t['worst_label']}) {t['worst_ratio']:.3f}x")


def cycles_with_timetables(cycles: int, exchange_cycles: int, exchanges: list[StepExchange]) -> int:
    """A program's cycles with each exchange at its timetable's makespan instead of its priced `exchange_cycles`
    (their total over the program). Every step with transfers has a StepExchange, so the priced total is replaced
    whole."""
    return cycles - exchange_cycles + sum(e.makespan for e in exchanges)


def exchange_code_per_tile(exchanges: list[StepExchange], tiles: int, shared=()) -> np.ndarray | None:
    """Exchange code bytes per tile summed over all steps (every step's code stays resident, as in the memory
    plan's estimate) but the `shared` steps, which run another step's code; None when a step's code was not kept."""
    if any(e.code_bytes is None for e in exchanges):
        return None
    total = np.zeros(tiles, np.int64)
    skip = {int(k) for k in shared}
    for e in exchanges:
        if e.step not in skip:
            total += e.code_bytes
    return total

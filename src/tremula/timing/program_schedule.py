"""Timetables for every exchange of a Program, and their makespans against the lower bounds the planner prices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tremula.chip import Chip
from tremula.program import Program
from tremula.timing.timetable import schedule_exchange


@dataclass(frozen=True)
class StepExchange:
    step: int
    label: str
    makespan: int  # cycles of the scheduled timetable, fixed cost included
    lower_bound: int  # busiest port's bytes / bandwidth + fixed cost

    @property
    def ratio(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound else 1.0


def schedule_program(program: Program, chip: Chip,
                     progress: Callable[[str, int, int], None] | None = None) -> list[StepExchange]:
    """Schedule every step's exchange (identical traffic patterns are scheduled once, see schedule_exchange)."""
    rows = []
    for k, step in enumerate(program.steps):
        if progress:
            progress("timetables", k, len(program.steps))
        if len(step.exchange):
            tt = schedule_exchange(step.exchange, chip)
            rows.append(StepExchange(k, step.label, int(tt.makespan), int(tt.lower_bound)))
    return rows

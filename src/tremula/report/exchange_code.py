"""Exchange code per tile from the scheduled timetables, set against the memory plan's estimate of it.

The memory plan reserves exchange code per whole transfer by the chip's encoding model (target/overheads.reserved_bytes;
chip file [exchange_code], ipu-stack-facts §1.2). A timetable splits transfers into chunks and orders each tile's
receives in time; each chunk needs its own sends and receives by the same model (target/overheads.chunk_code_bytes), so
the timetables' code is what a loaded program would hold. This only reports the difference (largest tile of each, the
largest ratio, and the fullest tile if the plan had used the timetables' code); the memory plan itself is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tremula.timing.program_schedule import StepExchange, exchange_code_per_tile

I64 = np.int64


@dataclass
class ExchangeCode:
    timetable: list[int]  # bytes per tile: every step's timetable code (Timetable.exchange_code_bytes), summed
    planned: list[int]  # bytes per tile the memory plan reserves (reserved_bytes(...)["exchange_code"])
    timetable_max_tile: int
    timetable_max_bytes: int
    planned_max_tile: int
    planned_max_bytes: int
    max_ratio: float  # max over tiles with planned code of timetable / planned
    max_ratio_tile: int  # -1 when no tile has planned code
    unplanned_tiles: int  # tiles with timetable code but none planned
    peak_tile: int  # fullest tile if each tile's planned exchange code were replaced by the timetables'
    peak_tile_bytes: int

    def to_json(self) -> dict:
        return dict(self.__dict__)

    def sentence(self) -> str:
        return (f"Exchange code from the timetables: up to {self.timetable_max_bytes:,} B (tile "
                f"{self.timetable_max_tile}) vs the memory plan's estimate of up to {self.planned_max_bytes:,} B (tile "
                f"{self.planned_max_tile}); largest ratio {self.max_ratio:.2f}x (tile {self.max_ratio_tile})"
                + (f", {self.unplanned_tiles} tiles with code the plan did not reserve" if self.unplanned_tiles else "")
                + f"; with the timetables' code the fullest tile would hold {self.peak_tile_bytes:,} B "
                f"(tile {self.peak_tile}).")


def exchange_code(exchanges: list[StepExchange], tile_memory: dict[str, np.ndarray], shared=()) -> ExchangeCode | None:
    """Compare the timetables' exchange code with the planned one; `tile_memory` is the profile's bytes per tile by
    category (its "exchange_code" is the plan's estimate); `shared` steps run another step's code. None when the
    timetables' code was not kept."""
    planned = np.asarray(tile_memory["exchange_code"], I64)
    code = exchange_code_per_tile(exchanges, len(planned), shared)
    if code is None:
        return None
    has = planned > 0
    ratio = np.where(has, code / np.maximum(planned, 1), 0.0)
    worst = int(np.argmax(ratio)) if has.any() else -1
    total = sum(np.asarray(v, I64) for v in tile_memory.values()) - planned + code
    peak = int(np.argmax(total))
    return ExchangeCode(
        timetable=code.tolist(), planned=planned.tolist(), timetable_max_tile=int(np.argmax(code)),
        timetable_max_bytes=int(code.max()), planned_max_tile=int(np.argmax(planned)),
        planned_max_bytes=int(planned.max()), max_ratio=float(ratio[worst]) if worst >= 0 else 0.0,
        max_ratio_tile=worst, unplanned_tiles=int(((code > 0) & ~has).sum()), peak_tile=peak,
        peak_tile_bytes=int(total[peak]))

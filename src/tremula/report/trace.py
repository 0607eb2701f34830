"""Chrome Trace Event JSON of a Profile (opens in Perfetto / chrome://tracing): BSP steps over time, tiles grouped.

Layout: process 1 "BSP" has a "steps" track (one event per step, its whole duration) and a "sync / exchange" track;
process 2 "tiles" has one track per group of consecutive tiles, with one event per step lasting the busiest tile of
the group's compute cycles. Grouping keeps a full 1472-tile chip to ~16 tracks. Times are µs (cycles / clock).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np

from tremula.program import Program

DEFAULT_TILE_GROUPS = 16
PID_BSP, PID_TILES = 1, 2
TID_STEPS, TID_PHASES = 1, 2


def _us(cycles: int, clock_hz: float) -> float:
    return cycles * 1e6 / clock_hz


def tile_group_bounds(tiles: int, groups: int) -> list[tuple[int, int]]:
    """[lo, hi) tile ranges of at most `groups` nearly equal groups of consecutive tiles."""
    groups = max(1, min(groups, tiles))
    cuts = np.linspace(0, tiles, groups + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in pairwise(cuts) if b > a]


@dataclass
class TraceInput:
    """What a trace needs: a Profile has it all; a bare Program gets it from `step_rows` and its chip."""

    chip: str
    model: str
    batch: int
    dtype: str
    tiles: int
    clock_hz: float
    cycles: int
    steps: list  # StepRows
    tile_compute: list | None  # per step, per tile compute cycles


def trace_input(profile_or_program, chip=None) -> TraceInput:
    if isinstance(profile_or_program, TraceInput):
        return profile_or_program
    if isinstance(profile_or_program, Program):
        from tremula.report.profile import step_rows

        prog = profile_or_program
        if chip is None:
            from tremula.target.chip import load_chip

            chip = load_chip(prog.chip)
        rows, per_tile, _ = step_rows(prog, chip)
        return TraceInput(chip.name, str(prog.meta.get("model", "")), prog.batch, prog.dtype, prog.tiles, chip.clock_hz,
                          sum(r.total for r in rows), rows, per_tile)
    s = profile_or_program.summary
    return TraceInput(s.chip, s.model, s.batch, s.dtype, s.tiles, s.clock_hz, s.cycles, profile_or_program.steps,
                      profile_or_program.tile_compute)


def trace_events(profile_or_program, tile_groups: int = DEFAULT_TILE_GROUPS, chip=None) -> list[dict]:
    """Trace events of a Profile, or of a Program (priced on `chip`, default: the built-in chip it names)."""
    s = trace_input(profile_or_program, chip)
    clock = s.clock_hz
    bounds = tile_group_bounds(s.tiles, tile_groups)
    ev: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": PID_BSP, "tid": 0, "args": {"name": f"BSP ({s.chip})"}},
        {"ph": "M", "name": "thread_name", "pid": PID_BSP, "tid": TID_STEPS, "args": {"name": "steps"}},
        {"ph": "M", "name": "thread_name", "pid": PID_BSP, "tid": TID_PHASES, "args": {"name": "sync / exchange"}},
        {"ph": "M", "name": "process_name", "pid": PID_TILES, "tid": 0, "args": {"name": "tiles (compute)"}},
    ]
    for gi, (lo, hi) in enumerate(bounds):
        ev.append({"ph": "M", "name": "thread_name", "pid": PID_TILES, "tid": gi + 1,
                   "args": {"name": f"tiles {lo}-{hi - 1}"}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": PID_TILES, "tid": gi + 1, "args": {"sort_index": gi}})
    tc = s.tile_compute
    for r in s.steps:
        t0 = r.start
        if r.total:
            ev.append({"ph": "X", "name": r.label or f"step {r.index}", "cat": "step", "pid": PID_BSP,
                       "tid": TID_STEPS, "ts": _us(t0, clock), "dur": _us(r.total, clock),
                       "args": {"step": r.index, "node": r.node, "compute_cycles": r.compute, "sync_cycles": r.sync,
                                "exchange_cycles": r.exchange, "start_cycle": t0, "tiles_used": r.tiles_used,
                                "balance": round(r.balance, 3)}})
        if r.sync:
            ev.append({"ph": "X", "name": "sync", "cat": "sync", "pid": PID_BSP, "tid": TID_PHASES,
                       "ts": _us(t0 + r.compute, clock), "dur": _us(r.sync, clock),
                       "args": {"step": r.index, "cycles": r.sync, "start_cycle": t0 + r.compute}})
        if r.exchange:
            ev.append({"ph": "X", "name": "exchange", "cat": "exchange", "pid": PID_BSP, "tid": TID_PHASES,
                       "ts": _us(t0 + r.compute + r.sync, clock), "dur": _us(r.exchange, clock),
                       "args": {"step": r.index, "cycles": r.exchange, "bytes": r.exchange_bytes,
                                "start_cycle": t0 + r.compute + r.sync}})
        if tc is None or not r.compute:
            continue
        cyc = np.asarray(tc[r.index])
        for gi, (lo, hi) in enumerate(bounds):
            g = cyc[lo:hi]
            busy = int(g.max())
            if busy:
                ev.append({"ph": "X", "name": r.label, "cat": "compute", "pid": PID_TILES, "tid": gi + 1,
                           "ts": _us(t0, clock), "dur": _us(busy, clock),
                           "args": {"step": r.index, "max_tile_cycles": busy, "start_cycle": t0,
                                    "active_tiles": int((g > 0).sum()), "mean_active_cycles": float(g[g > 0].mean())}})
    return ev


def write_trace(profile_or_program, path: str | Path, tile_groups: int = DEFAULT_TILE_GROUPS, chip=None) -> Path:
    """Write the Chrome Trace Event JSON of a Profile or a Program to `path`; returns the path."""
    path = Path(path)
    s = trace_input(profile_or_program, chip)
    doc = {"traceEvents": trace_events(s, tile_groups), "displayTimeUnit": "ns",
           "otherData": {"chip": s.chip, "model": s.model, "batch": s.batch, "dtype": s.dtype, "cycles": s.cycles,
                         "clock_hz": s.clock_hz}}
    path.write_text(json.dumps(doc, separators=(",", ":")))
    return path

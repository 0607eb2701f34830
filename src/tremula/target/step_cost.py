"""The price of one BSP step: the one function the planner's totals, the driver and the profile all charge.

A step costs its busiest tile's compute (its vertices' cycle estimates summed, after a shared layer's call has
rewritten its fields and set its weight base), one sync, and its exchange at the cost model's bound (busiest tile's
bytes sent or received / bandwidth + fixed cost; timing/program_schedule may replace the bound by a timetable's
makespan). A vertex's estimate is its codelet's cycle formula: each codelet registers it here
(codelets.register), so this layer prices a step without importing the codelets above it.

Steps are duck-typed (program.Step): `compute` (vertex groups with codelet, dtypes, tiles, params, shapes),
`exchange` (a transfer table), `call`, `patch_words(tiles)` and `base_tiles(tiles)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tremula.errors import TremulaError
from tremula.sorting import unique_rows
from tremula.target import cost_terms

I64 = np.int64
CyclesFn = Callable[..., int]  # (chip, params, shapes, dtypes) -> cycles of one vertex

VERTEX_CYCLES: dict[str, CyclesFn] = {}  # codelet name -> its cycle formula, filled by codelets.register


def register_vertex_cycles(name: str, cycles: CyclesFn) -> None:
    VERTEX_CYCLES[name] = cycles


def distinct_vertices(group) -> tuple[list[tuple[int, ...]], list[list[tuple[int, ...]]], np.ndarray]:
    """(params, operand shapes) of each distinct vertex of a group and, per vertex, the index of its distinct one:
    a group's vertices are priced once per distinct (params, shapes)."""
    keys = np.concatenate([group.params, group.shapes.reshape(len(group), -1)], axis=1)
    uniq, inv = unique_rows(keys)
    p = group.params.shape[1]
    params = [tuple(int(x) for x in u[:p]) for u in uniq]
    shapes = [[tuple(int(y) for y in s) for s in u[p:].reshape(-1, 2)] for u in uniq]
    return params, shapes, inv.reshape(-1)


def vertex_cycles(chip, group, memo: dict | None = None) -> np.ndarray:
    """int64 [n]: each vertex's cycle estimate, by its codelet's registered formula. `memo` (a caller's dict): groups
    holding the very same params and shapes arrays are priced once (a copied layer's steps share them with its
    template's, plan/replay.py); it keeps those arrays, so their ids are not reused while it lives."""
    key = None
    if memo is not None:
        key = (group.codelet, group.dtypes, id(group.params), id(group.shapes))
        if key in memo:
            return memo[key][2]
    fn = VERTEX_CYCLES.get(group.codelet)
    if fn is None:
        raise TremulaError(f"no cycle estimate for codelet {group.codelet!r}: its module in tremula.codelets "
                           f"registers one when imported")
    like = None if memo is None else (group.codelet, group.dtypes, id(group.shapes), group.params.shape)
    params = _as_like(group.params, memo.get(like)) if like is not None else None
    if params is None:
        params, shapes, inv = distinct_vertices(group)
        if memo is not None:
            memo[like] = (group.params, params, shapes, inv, group.shapes)  # (kept: its id is in the key)
    else:
        _, _, shapes, inv, _ = memo[like]
    out = np.array([fn(chip, pr, sh, group.dtypes) for pr, sh in zip(params, shapes)], I64)[inv]
    if memo is not None:
        memo[key] = (group.params, group.shapes, out)
    return out


def _as_like(params: np.ndarray, seen: tuple | None) -> list[tuple[int, ...]] | None:
    """The distinct params of a group whose params differ from an earlier group's (`seen`: its params, distinct
    params, distinct shapes, inverse and shapes array, the same as this group's) only in columns that hold one value
    on every vertex of both (a shared layer's FP8 scale, plan/replay.py's PER_LAYER_PARAMS): its vertices group as
    the earlier one's do, in the same order, with those columns' values its own. None when they differ otherwise
    (distinct_vertices)."""
    if seen is None or not len(params):
        return None
    p0 = seen[0]
    cols = np.flatnonzero((params != p0).any(axis=0))
    if not all((params[:, c] == params[0, c]).all() and (p0[:, c] == p0[0, c]).all() for c in cols.tolist()):
        return None
    own = {int(c): int(params[0, c]) for c in cols.tolist()}
    return [tuple(own.get(i, x) for i, x in enumerate(pr)) for pr in seen[1]]


@dataclass
class StepCost:
    tile_compute: np.ndarray  # int64 [tiles]: each tile's compute cycles (vertices, plus a call's patch and base)
    compute: int  # the busiest tile's: what the step charges
    exchange: int  # the cost model's bound
    sync: int
    max_sent: int  # busiest tile's bytes sent, and received (what the bound prices)
    max_received: int

    @property
    def cycles(self) -> tuple[int, int, int]:
        return self.compute, self.exchange, self.sync


def price_step(chip, step, tiles: int | None = None, memo: dict | None = None) -> StepCost:
    """The cost of one step on a chip of `tiles` tiles (the chip's own by default); `memo`: as in vertex_cycles."""
    tiles = chip.tiles if tiles is None else tiles
    comp = np.zeros(tiles, I64)
    for g in step.compute:
        if len(g):
            comp += np.bincount(g.tiles, weights=vertex_cycles(chip, g, memo), minlength=tiles).astype(I64)
    if step.call is not None:  # a shared layer: rewriting its fields and setting its weight base come first
        comp += cost_terms.call_cycles(step.patch_words(tiles), step.base_tiles(tiles))
    ex = step.exchange
    sent = recv = exc = 0
    if len(ex):
        nb = ex.rows * ex.row_bytes
        sent = int(np.bincount(ex.src_tile, weights=nb).max())
        recv = int(np.bincount(ex.d_tile, weights=np.repeat(nb, np.diff(ex.dst_start))).max())
        exc = cost_terms.exchange_cycles(chip, sent, recv)
    return StepCost(comp, int(comp.max(initial=0)), exc, cost_terms.sync_cycles(chip), sent, recv)


def step_cycles(chip, step, memo: dict | None = None) -> tuple[int, int, int]:
    """(compute, exchange, sync) cycles of one step: busiest tile's vertices, busiest tile's exchange, one sync."""
    return price_step(chip, step, memo=memo).cycles

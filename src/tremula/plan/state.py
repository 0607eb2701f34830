"""The lowering state: buffers, symbolic steps (addresses = buffer + offset), weight images and host streams.

Ops are lowered one by one into this state (plan/lower_ops.py); the memory plan then gives every buffer an offset and
`finalize.py` turns symbolic addresses into tile addresses. A step is a compute set followed by an exchange: an
exchange is always appended to the last step (after its compute), a compute set always opens a new step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tremula.plan.exchange import SymTransfers
from tremula.plan.layout import Layout, block_rel_offsets, distinct, even_cuts
from tremula.program import Origin

I64 = np.int64
ROW_PARTS_PER_SQRT_TILES = 2


@dataclass
class BufSpec:
    name: str
    category: str  # weights | activations | buffers
    tiles: np.ndarray  # int64 [k]
    sizes: np.ndarray  # int64 [k] bytes on each of those tiles


@dataclass
class SymGroup:
    codelet: str
    dtypes: tuple[str, ...]
    tiles: np.ndarray  # [n]
    params: np.ndarray  # [n, P]
    bufs: np.ndarray  # [n, A]
    rels: np.ndarray  # [n, A]
    shapes: np.ndarray  # [n, A, 2]

    def __len__(self) -> int:  # vertices, as program.VertexGroup (target/step_cost.py prices either)
        return len(self.tiles)


@dataclass
class SymStep:
    groups: list[SymGroup] = field(default_factory=list)
    transfers: list[SymTransfers] = field(default_factory=list)
    label: str = ""
    origin: Origin | None = None  # what its compute set computes (None: an exchange-only step)
    owners: list[str] = field(default_factory=list)  # per transfer table: the node whose lowering asked for it
    group_owners: list[str] = field(default_factory=list)  # per vertex group: the node it computes


@dataclass
class SymConst:
    name: str
    tiles: np.ndarray
    buf: int
    rels: np.ndarray
    r0: np.ndarray
    r1: np.ndarray
    c0: np.ndarray
    c1: np.ndarray
    dtype: str


@dataclass
class SymStream:
    name: str
    layout: Layout  # the blocks of the value; one stream per block


def operand(buf, rel, rows, cols) -> tuple:
    return (buf, rel, rows, cols)


class LoweringState:
    def __init__(self, tiles: int):
        self.owner = ""  # the node being lowered (its name): exchanges are attributed to it for diagnoses
        self.op = ""  # and its op
        self.T = tiles
        self.bufs: list[BufSpec] = []
        self.steps: list[SymStep] = []
        self.consts: list[SymConst] = []
        self.host_in: list[SymStream] = []
        self.host_out: list[SymStream] = []
        self.layouts: dict[str, Layout] = {}
        self.strategies: dict[str, str] = {}
        # node (its first output) -> (what, cuts) of each sum the plan splits, which changes its arithmetic: "k" (a
        # Linear's K parts, summed in part order), "columns" (a LayerNorm's column blocks, combined moments), "keys"
        # (an attention's key blocks, combined partials). The precision-matched reference (sim/reference.py) follows
        # these cuts.
        self.split_sums: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.row_cursor = 0
        self.wload = np.zeros(tiles, I64)  # resident weight bytes on each tile, as placement choices see them
        self.placed = np.zeros(tiles, I64)  # resident weight bytes on each tile (differs from wload in shared layers)
        self.row_block_bytes = 0  # cap on one row-layout block (0: no cap); the Lowerer sets it from the chip
        # Row layouts over every tile (up to one row each) instead of about 2 sqrt(T) blocks: the Lowerer sets it
        # for its first, unbudgeted plan (row ops then run on all tiles); budgeted plans keep the fewer blocks.
        self.spread_rows = False

    def least_loaded(self, n: int) -> np.ndarray:
        """n consecutive tiles (mod T) whose resident weights so far are the fewest (first such window on ties)."""
        n = min(n, self.T)
        c = np.concatenate([[0], np.cumsum(np.concatenate([self.wload, self.wload[: n - 1]]))])
        start = int(np.argmin(c[n: n + self.T] - c[: self.T]))
        return (start + np.arange(n, dtype=I64)) % self.T

    # ------------------------------------------------------------------------------------------------ buffers
    def new_buffer(self, name: str, category: str, tiles, sizes) -> int:
        tiles = np.asarray(tiles, I64).reshape(-1)
        sizes = np.broadcast_to(np.asarray(sizes, I64), tiles.shape)
        if not distinct(tiles):  # several pieces on one tile: add them up
            u, inv = np.unique(tiles, return_inverse=True)
            sizes = np.bincount(inv, weights=(sizes + 7) // 8 * 8, minlength=len(u)).astype(I64)
            tiles = u
        self.bufs.append(BufSpec(name, category, tiles.copy(), np.asarray(sizes, I64).copy()))
        return len(self.bufs) - 1

    def alloc_layout(self, name: str, rows: int, cols: int, dtype: str, row_cuts, col_cuts, tiles_grid,
                     category: str = "activations") -> Layout:
        row_cuts, col_cuts = np.asarray(row_cuts, I64), np.asarray(col_cuts, I64)
        tiles_grid = np.asarray(tiles_grid, I64).reshape(len(row_cuts) - 1, len(col_cuts) - 1)
        isz = np.dtype(dtype).itemsize
        nbytes = np.outer(np.diff(row_cuts), np.diff(col_cuts)) * isz
        rel, used = block_rel_offsets(tiles_grid, nbytes)
        buf = self.new_buffer(name, category, *used)
        return Layout(rows, cols, dtype, row_cuts, col_cuts, tiles_grid, rel, buf)

    def row_parts(self, rows: int, cols: int, dtype: str) -> int:
        """How many row blocks row_layout makes by default."""
        parts = ROW_PARTS_PER_SQRT_TILES * int(np.ceil(np.sqrt(self.T)))
        if self.row_block_bytes:  # big activations: more parts, so no tile holds a large share of one value
            parts = max(parts, -(-rows * cols * np.dtype(dtype).itemsize // self.row_block_bytes))
        if self.spread_rows:
            parts = self.T
        return min(parts, self.T, max(rows, 1))

    def row_layout(self, name: str, rows: int, cols: int, dtype: str, parts: int | None = None,
                   category: str = "activations", first_tile: int | None = None) -> Layout:
        """Whole rows per tile, rows split evenly over `parts` tiles (default: ROW_PARTS_PER_SQRT_TILES * sqrt(T)).

        Why not always every tile (spread_rows): a matmul reading this value gathers column slices of all rows, so
        every one of its tiles receives one transfer per row block; sqrt(T)-many row blocks balance that exchange
        code against the parallelism of the row ops themselves, which a plan under a memory budget needs. The first,
        unbudgeted plan spreads rows over every tile: its row ops (LayerNorm, residual Adds) run rows / T per tile
        instead of rows / 190 (ViT-B/16 fp16 batch 8: LayerNorm 15,053 -> 5,909 cycles of compute a step), and the
        gathers out of them send from every tile instead of a few.
        """
        parts = self.row_parts(rows, cols, dtype) if parts is None else min(parts, self.T, max(rows, 1))
        if category == "weights":  # a constant's home: where the fewest weights are
            first_tile = int(self.least_loaded(parts)[0])
        elif first_tile is None:  # rotate, so consecutive values (and their exchanges) land on different tiles
            first_tile = self.row_cursor
            self.row_cursor = (self.row_cursor + parts) % self.T
        cuts = even_cuts(rows, parts)
        tiles = (first_tile + np.arange(len(cuts) - 1)) % self.T
        return self.alloc_layout(name, rows, cols, dtype, cuts, [0, cols], tiles[:, None], category)

    # ------------------------------------------------------------------------------------------------ steps
    def exchange(self, t: SymTransfers) -> None:
        if len(t) == 0:
            return
        if not self.steps:
            self.steps.append(SymStep(label="exchange"))
        self.steps[-1].transfers.append(t.compact())
        self.steps[-1].owners.append(self.owner)

    def compute(self, groups: list[SymGroup], value: str, phase: str = "", part: str = "") -> None:
        """A compute step of the node being lowered, writing `value` (in `phase` of the op's lowering; `part`, e.g.
        " (2/3)", tells the step's round in its label only)."""
        groups = [g for g in groups if len(g.tiles)]
        if groups:
            label = f"{self.op} {value}" + (f" {phase}" if phase else "") + part
            self.steps.append(SymStep(groups, [], label, Origin(self.owner, self.op, value, phase),
                                      group_owners=[self.owner] * len(groups)))

    def group(self, codelet: str, dtypes: tuple[str, ...], tiles, params, operands: list[tuple]) -> SymGroup:
        """operands: per operand (buf, rel, rows, cols), each scalar or an array over the vertices."""
        tiles = np.asarray(tiles, I64).reshape(-1)
        n = len(tiles)
        params = np.asarray(params, I64)
        if params.ndim == 1:  # the same parameters for every vertex
            params = np.tile(params, (n, 1))
        bufs = np.stack([np.broadcast_to(np.asarray(o[0], I64), (n,)) for o in operands], axis=1)
        rels = np.stack([np.broadcast_to(np.asarray(o[1], I64), (n,)) for o in operands], axis=1)
        shapes = np.stack([np.stack([np.broadcast_to(np.asarray(o[2], I64), (n,)),
                                     np.broadcast_to(np.asarray(o[3], I64), (n,))], axis=1) for o in operands], axis=1)
        return SymGroup(codelet, tuple(dtypes), tiles, np.ascontiguousarray(params), bufs, rels, shapes)

    # ------------------------------------------------------------------------------------------------ weights
    def count_weights(self, buf: int) -> None:
        """Add a weight buffer's bytes to the per-tile weight loads (the true one and the one choices see)."""
        spec = self.bufs[buf]
        self.wload[spec.tiles] += spec.sizes
        self.placed[spec.tiles] += spec.sizes

    def resident(self, name: str, const: str, dtype: str, tiles, r0, r1, c0, c1) -> tuple[int, np.ndarray]:
        """Put block [r0:r1, c0:c1] of constant `const` on each of `tiles`; returns (buffer, byte offset per tile)."""
        tiles, r0, r1, c0, c1 = np.broadcast_arrays(*[np.asarray(x, I64).reshape(-1) for x in (tiles, r0, r1, c0, c1)])
        nbytes = (r1 - r0) * (c1 - c0) * np.dtype(dtype).itemsize
        rel, used = block_rel_offsets(tiles, nbytes)
        buf = self.new_buffer(name, "weights", *used)
        self.count_weights(buf)
        self.consts.append(SymConst(const, tiles.copy(), buf, rel, r0.copy(), r1.copy(), c0.copy(), c1.copy(), dtype))
        return buf, rel

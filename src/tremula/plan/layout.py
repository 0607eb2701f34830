"""Layouts: a value viewed as a 2-D [rows, cols] matrix, cut into a grid of blocks, each block on one tile.

Block (i, j) holds rows row_cuts[i]:row_cuts[i+1] and cols col_cuts[j]:col_cuts[j+1], row-major inside the block,
on tile tiles[i, j] at byte `rel[i, j]` inside buffer `buf` (a buffer has one global offset; see plan/memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def view2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view of a shape: cols = last dim, rows = product of the others (a scalar is [1, 1])."""
    if len(shape) == 0:
        return 1, 1
    return int(np.prod(shape[:-1], dtype=np.int64)), int(shape[-1])


def even_cuts(n: int, parts: int) -> np.ndarray:
    """Boundaries splitting range(n) into `parts` nearly equal contiguous pieces (the first ones one longer)."""
    parts = max(1, min(parts, max(n, 1)))
    base, extra = divmod(n, parts)
    sizes = np.full(parts, base, np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


@dataclass
class Layout:
    rows: int
    cols: int
    dtype: str
    row_cuts: np.ndarray  # int64 [nr + 1]
    col_cuts: np.ndarray  # int64 [nc + 1]
    tiles: np.ndarray  # int64 [nr, nc]
    rel: np.ndarray  # int64 [nr, nc] byte offset of the block inside the buffer on its tile
    buf: int

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def is_rows(self) -> bool:
        """Whole rows per block (one column block)."""
        return len(self.col_cuts) == 2

    @property
    def even_col_parts(self) -> int:
        """The number of column blocks when they are even_cuts(cols, n) (what a matmul with n K parts cuts), else 0."""
        n = len(self.col_cuts) - 1
        return n if np.array_equal(self.col_cuts, even_cuts(self.cols, n)) else 0

    def block_shape(self, i: int, j: int) -> tuple[int, int]:
        return int(self.row_cuts[i + 1] - self.row_cuts[i]), int(self.col_cuts[j + 1] - self.col_cuts[j])

    def _luts(self) -> tuple[np.ndarray, np.ndarray]:
        """Block index of every row and every column (cached: lookups beat binary search on big index maps)."""
        if getattr(self, "_lut", None) is None:
            rb = np.repeat(np.arange(len(self.row_cuts) - 1), np.diff(self.row_cuts))
            cb = np.repeat(np.arange(len(self.col_cuts) - 1), np.diff(self.col_cuts))
            self._lut = (rb, cb)
        return self._lut

    def locate(self, r: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tile, byte offset inside the buffer) of elements (r, c)."""
        rb, cb = self._luts()
        bi = rb[r]
        if self.is_rows:  # (whole rows: no column block to look up)
            return self.tiles[bi, 0], self.rel[bi, 0] + ((r - self.row_cuts[bi]) * self.cols + c) * self.itemsize
        bj = cb[c]
        width = np.diff(self.col_cuts)[bj]
        off = ((r - self.row_cuts[bi]) * width + (c - self.col_cuts[bj])) * self.itemsize
        return self.tiles[bi, bj], self.rel[bi, bj] + off

    def locate_flat(self, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.is_rows:  # element e is byte (e - the block's first element) * itemsize of its row block
            bi = self._luts()[0][e // self.cols]
            return self.tiles[bi, 0], self.rel[bi, 0] + (e - self.row_cuts[bi] * self.cols) * self.itemsize
        return self.locate(e // self.cols, e % self.cols)

    def same_blocks(self, other: Layout) -> bool:
        return (self.rows == other.rows and self.cols == other.cols and np.array_equal(self.row_cuts, other.row_cuts)
                and np.array_equal(self.col_cuts, other.col_cuts) and np.array_equal(self.tiles, other.tiles))


def block_rel_offsets(tiles: np.ndarray, nbytes: np.ndarray,
                      align: int = 8) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Place blocks (in row-major block order) one after another on their tiles: byte offset per block, and (tiles in
    order of first use, bytes used on each)."""
    flat_t, flat_n = np.asarray(tiles, np.int64).reshape(-1), np.asarray(nbytes, np.int64).reshape(-1)
    if distinct(flat_t):  # the usual case: one block per tile, all at offset 0
        return np.zeros(np.shape(tiles), np.int64), (flat_t.copy(), flat_n.copy())
    size = (flat_n + align - 1) // align * align
    order = np.argsort(flat_t, kind="stable")  # each tile's blocks together, in block order
    st, ss = flat_t[order], size[order]
    end = np.cumsum(ss)
    first = np.flatnonzero(np.concatenate([[True], st[1:] != st[:-1]]))
    base = np.repeat(end[first] - ss[first], np.diff(np.concatenate([first, [len(st)]])))
    rel = np.empty(len(flat_t), np.int64)
    rel[order] = end - ss - base
    used = np.add.reduceat(ss, first)
    by_first_use = np.argsort(order[first], kind="stable")
    return rel.reshape(np.shape(tiles)), (st[first][by_first_use], used[by_first_use])


def distinct(tiles: np.ndarray) -> bool:
    """Whether no tile appears twice (tile numbers are small non-negative integers: a count beats hashing)."""
    return len(tiles) < 2 or int(np.bincount(tiles).max()) == 1


def reshape_free(layout: Layout, rows: int, cols: int) -> Layout | None:
    """The same bytes seen as [rows, cols], if every block stays a whole-row range of the new view; else None."""
    if cols == layout.cols and rows == layout.rows:
        return layout
    if not layout.is_rows:
        return None
    starts = layout.row_cuts * layout.cols
    if np.any(starts % cols):
        return None
    return Layout(rows, cols, layout.dtype, starts // cols, np.array([0, cols], np.int64), layout.tiles, layout.rel,
                  layout.buf)


def blocks(layout: Layout) -> tuple[np.ndarray, ...]:
    """Flat per-block arrays in row-major block order: tiles, rel, r0, r1, c0, c1."""
    rc, cc = layout.row_cuts, layout.col_cuts
    nr, nc = len(rc) - 1, len(cc) - 1
    return (layout.tiles.reshape(-1), layout.rel.reshape(-1), np.repeat(rc[:-1], nc), np.repeat(rc[1:], nc),
            np.tile(cc[:-1], nr), np.tile(cc[1:], nr))

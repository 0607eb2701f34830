"""The global memory plan: every buffer's address on every tile it lives on, from liveness over the whole program.

Weights are always live and packed first, per tile; above them, activations and temporary buffers get one offset
(the same on each of their tiles, relative to the tile's weight end) first-fit among the buffers whose live ranges overlap (times are half-steps: 2k = compute of step k, 2k+1 = its exchange). Code, vertex
state and exchange code sit at the top of each tile's SRAM. Offsets are aligned to ALIGN bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ALIGN = 8  # 64-bit loads/stores need 8-byte aligned operands (ref §2: 64-bit data path)
CATEGORIES = ("weights", "activations", "code", "vertex_state", "exchange_code", "buffers")


def align(n: np.ndarray | int):
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class MemoryPlan:
    offset: np.ndarray  # [n_bufs] activations/buffers: offset above the tile's weights; weights: unused
    act_base: np.ndarray  # [tiles] where a tile's activation region starts (the end of its weights)
    weight_addr: np.ndarray  # [n_weight_bufs, tiles] address of each weight buffer on each tile (-1: not there)
    weight_row: np.ndarray  # [n_bufs] row of weight_addr for weight buffers, -1 for others
    tile_used: np.ndarray  # [tiles] bytes from 0 to the highest buffer end, plus the reserved bytes at the top
    fits: bool
    fullest_tile: int
    peak_time: int  # half-step at which the fullest tile holds the most live bytes
    by_category: dict[str, int]  # live bytes on the fullest tile at peak_time, per category

    @property
    def peak_bytes(self) -> int:
        return int(self.tile_used.max())

    def resolve(self, bufs: np.ndarray, tiles: np.ndarray) -> np.ndarray:
        """Tile address of buffer bufs[i] on tiles[i] (same shapes)."""
        bufs, tiles = np.broadcast_arrays(np.asarray(bufs, np.int64), np.asarray(tiles, np.int64))
        row = self.weight_row[bufs]
        w = row >= 0
        out = self.act_base[tiles] + self.offset[bufs]
        if w.any():
            out = np.where(w, self.weight_addr[np.maximum(row, 0), tiles], out)
        return out


def first_fit(sizes: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Offsets such that two buffers whose [first, last] ranges intersect never share bytes."""
    n = len(sizes)
    offset = np.zeros(n, np.int64)
    order = np.lexsort((-sizes, first))
    active: list[tuple[int, int, int]] = []  # (offset, end, last) of allocated, possibly expired, buffers
    for b in order.tolist():
        f = int(first[b])
        active = [a for a in active if a[2] >= f]
        active.sort()
        size = int(sizes[b])
        pos = 0
        for off, end, _ in active:
            if off - pos >= size:
                break
            pos = max(pos, end)
        offset[b] = pos
        active.append((pos, pos + size, int(last[b])))
    return offset


def plan_memory(cats: list[str], tiles_of: list[np.ndarray], sizes_of: list[np.ndarray], first: np.ndarray,
                last: np.ndarray, n_tiles: int, reserved: dict[str, np.ndarray], sram: int) -> MemoryPlan:
    n = len(cats)
    is_w = np.array([c == "weights" for c in cats], bool)
    # Weights: always live, packed per tile in placement order.
    w_idx = np.flatnonzero(is_w)
    weight_row = np.full(n, -1, np.int64)
    weight_row[w_idx] = np.arange(len(w_idx))
    weight_addr = np.full((len(w_idx), n_tiles), -1, np.int64)
    cursor = np.zeros(n_tiles, np.int64)
    for r, b in enumerate(w_idx.tolist()):
        t = tiles_of[b]
        weight_addr[r, t] = cursor[t]
        cursor[t] += align(sizes_of[b])
    act_base = align(cursor)
    # Activations and temporaries: one offset above each tile's weights, first fit over live ranges.
    maxsize = np.array([align(int(s.max())) if len(s) else 0 for s in sizes_of], np.int64)
    offset = np.zeros(n, np.int64)
    a_idx = np.flatnonzero(~is_w)
    offset[a_idx] = first_fit(maxsize[a_idx], first[a_idx], last[a_idx])
    # Highest byte used on each tile.
    counts = np.array([len(t) for t in tiles_of], np.int64)
    all_t = np.concatenate(tiles_of).astype(np.int64) if n else np.zeros(0, np.int64)
    all_s = np.concatenate(sizes_of).astype(np.int64) if n else np.zeros(0, np.int64)
    all_b = np.repeat(np.arange(n), counts)
    hw = act_base.copy()
    act = ~is_w[all_b]
    np.maximum.at(hw, all_t[act], act_base[all_t[act]] + offset[all_b[act]] + all_s[act])
    used = hw + sum(reserved.values())
    fullest = int(np.argmax(used))
    # Live bytes by category on the fullest tile over time.
    on = all_t == fullest
    bidx, bsize = all_b[on], all_s[on]
    by_cat = {c: 0 for c in CATEGORIES}
    peak_time = 0
    if len(bidx):
        times = np.unique(np.concatenate([first[bidx], last[bidx]]))
        live = (first[bidx][None, :] <= times[:, None]) & (last[bidx][None, :] >= times[:, None])
        tot = live.astype(np.int64) @ bsize
        ti = int(np.argmax(tot))
        peak_time = int(times[ti])
        for b, sz in zip(bidx[live[ti]].tolist(), bsize[live[ti]].tolist()):
            by_cat[cats[b]] += int(sz)
    for k, v in reserved.items():
        by_cat[k] = int(v[fullest])
    return MemoryPlan(offset, act_base, weight_addr, weight_row, used, bool(used.max() <= sram), fullest, peak_time,
                      by_cat)

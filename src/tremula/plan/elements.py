"""The memory-element rule: a matmul vertex's left operand and its output never share an SRAM memory element.

The AMP streams its left operand in while it writes results out, and one memory element serves one access per cycle,
so the two must sit in different elements: Poplar states it as a codelet constraint (`elem(**in) != elem(**out)`,
../shared/reference/ipu-hardware.md §2) and a stack that generates its own C600 code found GEMMs need it
(../shared/reference/ipu-stack-facts.md §3). Elements are `memory_element_bytes` in the non-interleaved region at the
bottom of a tile's memory and `interleaved_element_bytes` above it (ipu-stack-facts §3: 16 KiB, and 32 KiB effective
where elements are interleaved in pairs).

The memory plan (plan/memory.py) keeps every pair apart on every tile; `conflicts` counts, in a finished Program, the
vertices that break the rule, so a test can hold the plan to it.
"""

from __future__ import annotations

import numpy as np

from tremula.program import Program, storage_dtype

I64 = np.int64
# Codelets whose operand 0 is the AMP's streamed left operand and whose last operand is its output.
APART = ("matmul", "matmul_partial", "matmul_fp8")


def element_index(addr, chip) -> np.ndarray:
    """The memory element holding each tile-local byte address."""
    a = np.asarray(addr, I64)
    r0, e0 = chip.non_interleaved_bytes_per_tile, chip.memory_element_bytes
    return np.where(a < r0, a // e0, r0 // e0 + (a - r0) // chip.interleaved_element_bytes)


def element_end(addr, chip) -> np.ndarray:
    """The first address past the element holding each address."""
    a = np.asarray(addr, I64)
    r0, e0, e1 = chip.non_interleaved_bytes_per_tile, chip.memory_element_bytes, chip.interleaved_element_bytes
    return np.where(a < r0, np.minimum((a // e0 + 1) * e0, r0), r0 + ((a - r0) // e1 + 1) * e1)


def share_element(lo_a, hi_a, lo_b, hi_b, chip) -> np.ndarray:
    """Whether byte ranges [lo_a, hi_a) and [lo_b, hi_b) (non-empty, on one tile) touch a common element."""
    ea0, ea1 = element_index(lo_a, chip), element_index(np.asarray(hi_a, I64) - 1, chip)
    eb0, eb1 = element_index(lo_b, chip), element_index(np.asarray(hi_b, I64) - 1, chip)
    return (ea0 <= eb1) & (eb0 <= ea1)


def apart_pairs(steps) -> list[tuple[int, int, np.ndarray]]:
    """(left operand buffer, output buffer, tiles where a vertex uses both) over a plan's SymSteps."""
    tiles_of: dict[tuple[int, int], list[np.ndarray]] = {}
    for s in steps:
        for g in s.groups:
            if g.codelet in APART and len(g.tiles):
                for (a, b), t in _by_pair(g.bufs[:, 0], g.bufs[:, -1], g.tiles):
                    if a != b:  # one buffer holding both: no placement separates them (conflicts() reports it)
                        tiles_of.setdefault((a, b), []).append(t)
    return [(a, b, _tile_set(np.concatenate(ts))) for (a, b), ts in tiles_of.items()]


def _tile_set(tiles: np.ndarray) -> np.ndarray:
    """np.unique of tile ids (int64, small and non-negative) by marking them, not sorting them."""
    if not len(tiles):
        return np.unique(tiles)
    seen = np.zeros(int(tiles.max()) + 1, bool)
    seen[tiles] = True
    return np.flatnonzero(seen).astype(tiles.dtype, copy=False)


def _by_pair(a: np.ndarray, b: np.ndarray, tiles: np.ndarray):
    """((a, b), tiles) for each distinct pair of a vertex group's operand buffers."""
    key = (np.asarray(a, I64) << 32) | np.asarray(b, I64)  # buffer ids are far below 2**31
    uniq, inv = np.unique(key, return_inverse=True)
    inv = inv.reshape(-1)
    order = np.argsort(inv, kind="stable")
    parts = np.split(np.asarray(tiles, I64)[order], np.cumsum(np.bincount(inv))[:-1])
    for k, t in zip(uniq.tolist(), parts):
        yield (k >> 32, k & 0xFFFFFFFF), t


def conflicts(program: Program, chip) -> int:
    """Vertices of the Program whose left operand and output share a memory element (a shared layer's call runs
    its template's vertices with the layer's fields, so each call is counted as it runs)."""
    n = 0
    for step in program.steps:
        for g in step.compute:
            if g.codelet not in APART or len(g) == 0:
                continue
            size = [g.shapes[:, a, 0] * g.shapes[:, a, 1] * storage_dtype(g.dtypes[a]).itemsize for a in (0, -1)]
            lo_x, lo_y = g.addrs[:, 0], g.addrs[:, -1]
            n += int(share_element(lo_x, lo_x + size[0], lo_y, lo_y + size[1], chip).sum())
    return n

"""Strategy search: enumerate candidate partitions of an op over the tiles and keep the cheapest by the cost model.

The memory fractions below are the planner's budgets for one op's share of a tile (a search heuristic, not a chip fact);
whether the whole program fits is decided by the real memory plan afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tremula.plan import cost_terms

WEIGHT_FRACTION = 0.5  # of a tile's SRAM that all resident matmul weights together may take
TEMP_FRACTION = 0.12  # of a tile's SRAM that one op's gathered operand block may take (serial splits beyond that)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LinearStrategy:
    pm: int  # M (rows) split over tiles
    pn: int  # N (output columns) split over tiles
    pk: int  # K split over tiles: partial sums, then a reduce step on the owner of each row slice
    serial: int  # rounds over each tile's rows, so the gathered x block fits the temp budget
    cycles: int  # estimated cycles (compute + exchange + sync) of the whole op
    bytes_per_tile: int  # weights + gathered operands + partials + output on the busiest tile

    def __str__(self) -> str:
        return (f"linear pm={self.pm} pn={self.pn} pk={self.pk} serial={self.serial} ~{self.cycles} cycles "
                f"~{self.bytes_per_tile} B/tile")


def _candidates(n: int, limit: int) -> list[int]:
    """Split counts worth trying: powers of two, and the counts that make equal blocks of power-of-two-ish sizes."""
    c = {1, min(n, limit)}
    p = 1
    while p <= min(n, limit):
        c.add(p)
        c.add(cdiv(n, cdiv(n, p)))  # the fewest parts with blocks of size ceil(n / p)
        p *= 2
    for d in (3, 6, 12, 24, 48, 96, 192, 384, 768):
        if d <= min(n, limit):
            c.add(d)
    return sorted(x for x in c if 1 <= x <= min(n, limit))


@lru_cache(maxsize=4096)
def choose_linear(chip, m: int, k: int, n: int, dtype: str, pm_max: int,
                  temp_fraction: float = TEMP_FRACTION) -> LinearStrategy:
    """Pick (pm, pn, pk, serial) minimising estimated cycles, subject to the weight and temp budgets.

    Cached on its arguments: identical layers (same shapes) are planned once.
    """
    tiles, sram = chip.tiles, chip.sram_bytes_per_tile
    isz = np.dtype(dtype).itemsize
    temp_budget = max(temp_fraction * sram, 1)
    sync = cost_terms.sync_cycles(chip)
    best: tuple | None = None
    for pn in _candidates(n, tiles):
        nj = cdiv(n, pn)
        for pk in _candidates(k, tiles // pn):
            kl = cdiv(k, pk)
            pm = max(1, min(m, tiles // (pn * pk), pm_max))
            mi = cdiv(m, pm)
            serial = max(1, min(mi, cdiv(mi * kl * isz, int(temp_budget))))
            rows = cdiv(mi, serial)
            comp = cost_terms.matmul_cycles(chip, rows, kl, nj, dtype)
            recv = rows * kl * isz
            sent = cdiv(m * k * isz, min(tiles, m * pk)) // serial
            ex = cost_terms.exchange_cycles(chip, sent, recv) + sync
            mem = k * n * isz // (pn * pk) + rows * kl * isz + mi * nj * isz // pk
            if pk > 1:
                sub = cdiv(rows, pk)
                part = rows * nj * 4
                comp += cost_terms.vector_cycles(chip, "add", sub * nj * pk, "float32")
                ex += cost_terms.exchange_cycles(chip, part - sub * nj * 4, (pk - 1) * sub * nj * 4) + sync
                mem += part + (pk - 1) * sub * nj * 4
            total = serial * (comp + ex)
            over = max(0, mem - (WEIGHT_FRACTION + temp_fraction) * sram)
            key = (over, total)
            if best is None or key < best[0]:
                best = (key, LinearStrategy(pm, pn, pk, serial, int(total), int(mem)))
    assert best is not None
    return best[1]

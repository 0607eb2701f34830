"""Codelets: the vertex programs a tile runs. Each works on NumPy views of its own tile's SRAM bytes.

A codelet is registered with the indices of the operands it writes (so the simulator can check reads of unwritten
bytes and overlapping writes) and a cycle estimate that calls the one cost model (`tremula.plan.cost_terms`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

RunFn = Callable[[list[np.ndarray], Sequence[int]], None]
CyclesFn = Callable[..., int]  # (chip, params, shapes, dtypes) -> cycles


@dataclass(frozen=True)
class Codelet:
    name: str
    run: RunFn  # views of the operands (each [rows, cols] in its dtype), the vertex's int params; writes outputs
    writes: tuple[int, ...]  # operand indices it writes (negative = from the end)
    cycles: CyclesFn
    batchable: bool = True  # run() also accepts a stack of vertices ([n, rows, cols] operands, the same params)

    def written(self, n_ops: int) -> list[int]:
        return sorted(i % n_ops for i in self.writes)


CODELETS: dict[str, Codelet] = {}


def register(name: str, run: RunFn, writes: tuple[int, ...], cycles: CyclesFn, batchable: bool = True) -> None:
    CODELETS[name] = Codelet(name, run, writes, cycles, batchable)


def codelet(name: str) -> Codelet:
    if not CODELETS:
        _load()
    return CODELETS[name]


def f2i(x: float) -> int:
    """A float parameter carried in an int64 vertex parameter (bit pattern of the float64)."""
    return int(np.array(x, np.float64).view(np.int64))


def i2f(x: int) -> float:
    return float(np.array(x, np.int64).view(np.float64))


def _load() -> None:
    from tremula.codelets import attention, elementwise, embed, fp8, matmul, norm  # noqa: F401  (registration)


_load()

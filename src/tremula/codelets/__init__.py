"""Codelets: the vertex programs a tile runs. Each works on NumPy arrays of its operands' bytes in tile SRAM.

A codelet runs a stack of vertices at once: every operand is [n, rows, cols] (vertex i's block at index i) and params
is [n, P] (one row per vertex). A single vertex may also be passed as [rows, cols] operands and a 1-D params row. The
simulator stacks only vertices whose operand shapes and `uniform` params agree (the params that pick a code path:
an op id, has_bias, a format); the others (a query block's start, a seed) vary per vertex and are read with `column`.

A codelet is registered with the indices of the operands it writes (so the simulator can check reads of unwritten
bytes and overlapping writes) and a cycle estimate that calls the one cost model (`tremula.target.cost_terms`);
registering it also gives the estimate to `tremula.target.step_cost`, which prices whole steps with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tremula.target.step_cost import CyclesFn, register_vertex_cycles

RunFn = Callable[[list[np.ndarray], Sequence[int] | np.ndarray], None]


@dataclass(frozen=True)
class Codelet:
    name: str
    run: RunFn  # stacked operands ([n, rows, cols] in their dtypes) and params [n, P]; writes the outputs in place
    writes: tuple[int, ...]  # operand indices it writes (negative = from the end)
    cycles: CyclesFn
    uniform: tuple[int, ...] = ()  # params that must agree within one stacked call (those that pick the code path)

    def written(self, n_ops: int) -> list[int]:
        return sorted(i % n_ops for i in self.writes)


CODELETS: dict[str, Codelet] = {}


def register(name: str, run: RunFn, writes: tuple[int, ...], cycles: CyclesFn, uniform: tuple[int, ...] = ()) -> None:
    CODELETS[name] = Codelet(name, run, writes, cycles, uniform)
    register_vertex_cycles(name, cycles)


def codelet(name: str) -> Codelet:
    if not CODELETS:
        _load()
    return CODELETS[name]


def first(params, j: int) -> int:
    """Param j of the first vertex (a `uniform` param: the same for every vertex of the call)."""
    p = np.asarray(params)
    return int(p[j] if p.ndim == 1 else p[0, j])


def optional(params, j: int) -> int:
    """Param j of the first vertex, 0 when the vertices have fewer params (a Program saved before the param, or a
    trailing flag left off)."""
    p = np.asarray(params)
    return first(p, j) if p.shape[-1] > j else 0


def column(params, j: int) -> np.ndarray:
    """Param j of every vertex, shaped to broadcast against [n, rows, cols] operands ([1, 1] for a single vertex)."""
    return np.asarray(params, np.int64)[..., j, None, None]


def f2i(x: float) -> int:
    """A float parameter carried in an int64 vertex parameter (bit pattern of the float64)."""
    return int(np.array(x, np.float64).view(np.int64))


def i2f(x: int) -> float:
    return float(np.array(x, np.int64).view(np.float64))


def _load() -> None:
    from tremula.codelets import attention, elementwise, embed, fp8, matmul, norm  # noqa: F401  (registration)


_load()

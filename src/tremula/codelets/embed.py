"""The embedding lookup codelet: rows of a tile's column slice of a table, picked by token ids read from SRAM."""

from __future__ import annotations

import numpy as np

from tremula.codelets import register
from tremula.plan import cost_terms


class IndexOutOfRange(Exception):
    """A token id outside the table: a runtime error of the program's input, reported by the simulator."""


def _embed(ops, params) -> None:
    # operands: ids [1, n] (integer), table [V, c], out [n, c]
    ids, table, out = ops
    v = table.shape[0]
    idx = ids.reshape(-1).astype(np.int64)
    idx = np.where(idx < 0, idx + v, idx)
    if np.any(idx < 0) or np.any(idx >= v):
        raise IndexOutOfRange(f"Gather index out of range [0, {v})")
    out[...] = table[idx]


def _embed_cycles(chip, params, shapes, dtypes) -> int:
    n, c = shapes[-1]
    return n * cost_terms.copy_cycles(chip, c * np.dtype(dtypes[1]).itemsize)


register("embed", _embed, (-1,), _embed_cycles, batchable=False)

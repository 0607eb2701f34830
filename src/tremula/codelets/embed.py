"""The embedding lookup codelet: rows of a tile's column slice of a table, picked by token ids read from SRAM."""

from __future__ import annotations

import numpy as np

from tremula.codelets import register
from tremula.target import cost_terms


class IndexOutOfRange(Exception):
    """A token id outside the table: a runtime error of the program's input, reported by the simulator."""


def _embed(ops, params) -> None:
    # operands: ids [1, m] (integer), table [V, c], out [m, c]; stacked: [n, 1, m], [n, V, c], [n, m, c]
    ids, table, out = ops
    v = table.shape[-2]
    idx = ids.reshape(ids.shape[:-2] + (-1,)).astype(np.int64)
    idx = np.where(idx < 0, idx + v, idx)
    if np.any(idx < 0) or np.any(idx >= v):
        raise IndexOutOfRange(f"Gather index out of range [0, {v})")
    if table.ndim == 2:
        out[...] = table[idx]
    else:  # vertex i picks rows of its own table
        out[...] = table[np.arange(len(table))[:, None], idx]


def _embed_cycles(chip, params, shapes, dtypes) -> int:
    n, c = shapes[-1]
    return n * cost_terms.copy_cycles(chip, c * np.dtype(dtypes[1]).itemsize)


register("embed", _embed, (-1,), _embed_cycles)

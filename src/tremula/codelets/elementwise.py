"""Element-wise codelets (unary, binary with 2-D broadcasting, where, cast) on rows held by one tile.

Each calls the kernel of the op's row in `tremula.ir.ops` (its `kernels`, with the op ids a Program stores, and its
`cost`), so the simulator and the reference interpreter compute an op with one definition.
Operands are stacks of vertices ([n, rows, cols]); the op id is a uniform param, so one call applies one function.
"""

from __future__ import annotations

import numpy as np

from tremula.codelets import first, register
from tremula.ir.ops import OPS
from tremula.numerics.amp import store
from tremula.target import cost_terms


def _bound(name: str) -> tuple[dict[str, object], list[tuple[tuple[str, int], ...]]]:
    """The kernels the codelet `name` runs, by variant in the order of their op ids (the ids a Program stores, given
    in each op's row of ir/ops.py), and each one's cost per element."""
    rows = sorted((op_id, variant, fn, d.cost) for d in OPS.values() if d.codelet == name
                  for variant, op_id, fn in d.kernels)
    if [r[0] for r in rows] != list(range(len(rows))):
        raise AssertionError(f"the {name} codelet's op ids are not 0..{len(rows) - 1}: {[r[:2] for r in rows]}")
    return {variant: fn for _, variant, fn, _ in rows}, [c for *_, c in rows]


UNARY, _UNARY_COST = _bound("unary")
UNARY_IDS = {name: i for i, name in enumerate(UNARY)}
_UNARY_FNS = list(UNARY.values())
BINARY, _BINARY_COST = _bound("binary")
BINARY_IDS = {name: i for i, name in enumerate(BINARY)}
_BINARY_FNS = list(BINARY.values())
_WHERE_COST = OPS["Where"].cost


_TABLES: dict[tuple[int, str, str], np.ndarray] = {}


def _table(op: int, x_dtype: np.dtype, out_dtype: np.dtype) -> np.ndarray:
    """The op's result for every value of a one- or two-byte input type, indexed by the input's bits."""
    key = (op, x_dtype.str, out_dtype.str)
    if key not in _TABLES:
        every = np.arange(1 << (8 * x_dtype.itemsize), dtype=np.uint8 if x_dtype.itemsize == 1 else np.uint16)
        with np.errstate(all="ignore"):  # the table covers inf and NaN inputs too
            _TABLES[key] = np.asarray(_UNARY_FNS[op](every.view(x_dtype))).astype(out_dtype)
    return _TABLES[key]


def _unary(ops, params) -> None:
    x, out = ops
    op = first(params, 0)
    if op in (UNARY_IDS["Gelu"], UNARY_IDS["Erf"]):  # fast and exact already (numerics/erf.py)
        store(out, _UNARY_FNS[op](x))
        return
    if x.dtype == np.float16 and x.size > 1 << 16:
        # A half input has 65536 values: the op's result for each, computed once with the same formula, is looked up
        # by the input's bits (the same bits as evaluating it here, at a fraction of the float64 work).
        out[...] = _table(op, x.dtype, out.dtype)[x.view(np.uint16)]
        return
    store(out, _UNARY_FNS[op](x))


def _unary_cycles(chip, params, shapes, dtypes) -> int:
    r, c = shapes[-1]
    return cost_terms.sequence_cycles(chip, _UNARY_COST[params[0]], r * c, dtypes[-1])


def _binary(ops, params) -> None:
    a, b, out = ops
    store(out, _BINARY_FNS[first(params, 0)](a, b))


def _binary_cycles(chip, params, shapes, dtypes) -> int:
    r, c = shapes[-1]
    return cost_terms.sequence_cycles(chip, _BINARY_COST[params[0]], r * c, dtypes[0])


def _where(ops, params) -> None:
    c, a, b, out = ops
    store(out, np.where(c, a, b))


def _where_cycles(chip, params, shapes, dtypes) -> int:
    r, c = shapes[-1]
    return cost_terms.sequence_cycles(chip, _WHERE_COST, r * c, dtypes[-1])


register("unary", _unary, (-1,), _unary_cycles, uniform=(0,))
register("binary", _binary, (-1,), _binary_cycles, uniform=(0,))
register("where", _where, (-1,), _where_cycles)

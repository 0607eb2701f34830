"""Element-wise codelets (unary, binary with 2-D broadcasting, where, cast) on rows held by one tile.

Each calls the kernel of the op's reference row in `tremula.ir.ops` (UNARY_KERNELS, BINARY_KERNELS, ...), so the
simulator and the reference interpreter compute an op with one definition.
Operands are stacks of vertices ([n, rows, cols]); the op id is a uniform param, so one call applies one function.
"""

from __future__ import annotations

import numpy as np

from tremula.codelets import first, register
from tremula.ir.ops import BINARY_KERNELS, COMPARE_KERNELS, GELU_KERNELS, UNARY_KERNELS
from tremula.target import cost_terms

# The reference's own kernels (ir/ops.py) by name. A Program stores an op's index in this order as its op id: a new
# op is appended, never inserted. Cast converts in the output's assignment.
_UNARY_ORDER = ("Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Tanh", "Erf", "Sigmoid", "Relu", "Not", "Identity",
                "Cast", "Gelu", "GeluTanh")
_UNARY_BY_NAME = {**UNARY_KERNELS, "Cast": lambda x: x, **GELU_KERNELS}
UNARY: dict[str, object] = {n: _UNARY_BY_NAME[n] for n in _UNARY_ORDER}
UNARY_IDS = {name: i for i, name in enumerate(UNARY)}
_UNARY_FNS = list(UNARY.values())
_UNARY_KIND = ["neg", "abs", "exp", "log", "sqrt", "reciprocal", "tanh", "erf", "sigmoid", "relu", "not", "copy",
               "cast", "gelu", "gelu"]

# As UNARY: the reference's kernels in the stored order of their op ids.
_BINARY_ORDER = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "Equal", "Less", "Greater", "And", "Or")
_BINARY_BY_NAME = {**BINARY_KERNELS, **COMPARE_KERNELS}
BINARY: dict[str, object] = {n: _BINARY_BY_NAME[n] for n in _BINARY_ORDER}
BINARY_IDS = {name: i for i, name in enumerate(BINARY)}
_BINARY_FNS = list(BINARY.values())
_BINARY_KIND = ["add", "sub", "mul", "div", "pow", "max", "min", "mod", "cmp", "cmp", "cmp", "and", "or"]


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
        out[...] = np.asarray(_UNARY_FNS[op](x)).astype(out.dtype, copy=False)
        return
    if x.dtype == np.float16 and x.size > 1 << 16:
        # A half input has 65536 values: the op's result for each, computed once with the same formula, is looked up
        # by the input's bits (the same bits as evaluating it here, at a fraction of the float64 work).
        out[...] = _table(op, x.dtype, out.dtype)[x.view(np.uint16)]
        return
    out[...] = np.asarray(_UNARY_FNS[op](x)).astype(out.dtype, copy=False)


def _unary_cycles(chip, params, shapes, dtypes) -> int:
    r, c = shapes[-1]
    return cost_terms.vector_cycles(chip, _UNARY_KIND[params[0]], r * c, dtypes[-1])


def _binary(ops, params) -> None:
    a, b, out = ops
    out[...] = np.asarray(_BINARY_FNS[first(params, 0)](a, b)).astype(out.dtype, copy=False)


def _binary_cycles(chip, params, shapes, dtypes) -> int:
    r, c = shapes[-1]
    return cost_terms.vector_cycles(chip, _BINARY_KIND[params[0]], r * c, dtypes[0])


def _where(ops, params) -> None:
    c, a, b, out = ops
    out[...] = np.where(c, a, b).astype(out.dtype, copy=False)


def _where_cycles(chip, params, shapes, dtypes) -> int:
    r, c = shapes[-1]
    return cost_terms.vector_cycles(chip, "select", r * c, dtypes[-1])


register("unary", _unary, (-1,), _unary_cycles, uniform=(0,))
register("binary", _binary, (-1,), _binary_cycles, uniform=(0,))
register("where", _where, (-1,), _where_cycles)

"""Element-wise codelets (unary, binary with 2-D broadcasting, where, cast) on rows held by one tile.

Each mirrors the formula of the op's reference row in `tremula.ir.ops` so results agree bit for bit where NumPy allows.
"""

from __future__ import annotations

import numpy as np

from tremula.codelets import register
from tremula.ir.ops import _erf, _gelu, _sigmoid
from tremula.plan import cost_terms

UNARY: dict[str, object] = {
    "Neg": np.negative, "Abs": np.abs, "Exp": np.exp, "Log": np.log, "Sqrt": np.sqrt, "Reciprocal": np.reciprocal,
    "Tanh": np.tanh, "Erf": _erf, "Sigmoid": _sigmoid, "Relu": lambda x: np.maximum(x, 0).astype(x.dtype),
    "Not": np.logical_not, "Identity": lambda x: x, "Cast": lambda x: x,
    "Gelu": lambda x: _gelu(x, "none"), "GeluTanh": lambda x: _gelu(x, "tanh"),
}
UNARY_IDS = {name: i for i, name in enumerate(UNARY)}
_UNARY_FNS = list(UNARY.values())
_UNARY_KIND = ["neg", "abs", "exp", "log", "sqrt", "reciprocal", "tanh", "erf", "sigmoid", "relu", "not", "copy",
               "cast", "gelu", "gelu"]

BINARY: dict[str, object] = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply,
    "Div": lambda x, y: (x // y) if np.issubdtype(x.dtype, np.integer) else np.divide(x, y),
    "Pow": lambda x, y: np.power(x, y).astype(x.dtype), "Max": np.maximum, "Min": np.minimum, "Mod": np.fmod,
    "Equal": np.equal, "Less": np.less, "Greater": np.greater, "And": np.logical_and, "Or": np.logical_or,
}
BINARY_IDS = {name: i for i, name in enumerate(BINARY)}
_BINARY_FNS = list(BINARY.values())
_BINARY_KIND = ["add", "sub", "mul", "div", "pow", "max", "min", "mod", "cmp", "cmp", "cmp", "and", "or"]


def _unary(ops, params) -> None:
    x, out = ops
    out[...] = np.asarray(_UNARY_FNS[params[0]](x)).astype(out.dtype)


def _unary_cycles(chip, params, shapes, dtypes) -> int:
    r, c = shapes[-1]
    return cost_terms.vector_cycles(chip, _UNARY_KIND[params[0]], r * c, dtypes[-1])


def _binary(ops, params) -> None:
    a, b, out = ops
    out[...] = np.asarray(_BINARY_FNS[params[0]](a, b)).astype(out.dtype)


def _binary_cycles(chip, params, shapes, dtypes) -> int:
    r, c = shapes[-1]
    return cost_terms.vector_cycles(chip, _BINARY_KIND[params[0]], r * c, dtypes[0])


def _where(ops, params) -> None:
    c, a, b, out = ops
    out[...] = np.where(c, a, b).astype(out.dtype)


def _where_cycles(chip, params, shapes, dtypes) -> int:
    r, c = shapes[-1]
    return cost_terms.vector_cycles(chip, "select", r * c, dtypes[-1])


register("unary", _unary, (-1,), _unary_cycles)
register("binary", _binary, (-1,), _binary_cycles)
register("where", _where, (-1,), _where_cycles)

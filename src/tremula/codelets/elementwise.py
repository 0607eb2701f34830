"""Element-wise codelets (unary, binary with 2-D broadcasting, where, cast) on rows held by one tile.

Each mirrors the formula of the op's reference row in `tremula.ir.ops` so results agree bit for bit where NumPy allows.
Operands are stacks of vertices ([n, rows, cols]); the op id is a uniform param, so one call applies one function.
"""

from __future__ import annotations

import math

import numpy as np

from tremula.codelets import first, register
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


_TABLES: dict[tuple[int, str, str], np.ndarray] = {}


def _table(op: int, x_dtype: np.dtype, out_dtype: np.dtype) -> np.ndarray:
    """The op's result for every value of a one- or two-byte input type, indexed by the input's bits."""
    key = (op, x_dtype.str, out_dtype.str)
    if key not in _TABLES:
        every = np.arange(1 << (8 * x_dtype.itemsize), dtype=np.uint8 if x_dtype.itemsize == 1 else np.uint16)
        with np.errstate(all="ignore"):  # the table covers inf and NaN inputs too
            _TABLES[key] = np.asarray(_UNARY_FNS[op](every.view(x_dtype))).astype(out_dtype)
    return _TABLES[key]


# erf by cubic Hermite interpolation on a 2**-10 grid of [0, 6]: |error| <= h**4 / 384 * max |4th derivative of erf|
# (about 1e-14) plus rounding; ERF_ERROR bounds it generously. Used only to decide float32 results the bound makes
# certain.
_ERF_STEP = 2.0**-10
_ERF_NODES = np.arange(6 * 1024 + 2) * _ERF_STEP
_ERF_F = np.array([math.erf(z) for z in _ERF_NODES])
_ERF_D = 2 / math.sqrt(math.pi) * np.exp(-(_ERF_NODES**2)) * _ERF_STEP
_ERF_LIMIT = 6.0
ERF_ERROR = 4e-14


def _erf_interp(z: np.ndarray) -> np.ndarray:
    """erf(z) within ERF_ERROR for |z| < 6 (float64)."""
    u = np.abs(z) / _ERF_STEP
    i = np.minimum(u.astype(np.int64), len(_ERF_NODES) - 2)
    t = u - i
    t2 = t * t
    t3 = t2 * t
    p = ((2 * t3 - 3 * t2 + 1) * _ERF_F[i] + (t3 - 2 * t2 + t) * _ERF_D[i] + (3 * t2 - 2 * t3) * _ERF_F[i + 1]
         + (t3 - t2) * _ERF_D[i + 1])
    return np.copysign(p, z)


def _erf_f32(x: np.ndarray, gelu: bool) -> np.ndarray:
    """_erf_block over cache-sized pieces of x (some thirty float64 passes each, so they should stay in cache)."""
    flat = x.reshape(-1)
    step = 1 << 14
    return np.concatenate([_erf_block(flat[i: i + step], gelu) for i in range(0, len(flat), step)]).reshape(x.shape)


def _erf_block(x: np.ndarray, gelu: bool) -> np.ndarray:
    """The reference's float32 Erf or exact Gelu of float32 x, bit for bit, without calling math.erf per element.

    The reference computes in float64 with math.erf and rounds to float32 once. Here erf is interpolated (within
    ERF_ERROR), the same float64 formula follows, and a result whose distance to both float32 rounding boundaries
    exceeds the error bound rounds to the same float32 as the reference's; the rare others (and |z| >= 6, inf, NaN)
    go through the reference itself."""
    x64 = x.astype(np.float64)
    z = x64 / math.sqrt(2.0) if gelu else x64
    with np.errstate(all="ignore"):
        e = _erf_interp(np.where(np.abs(z) < _ERF_LIMIT, z, 0.0))
        y = 0.5 * x64 * (1.0 + e) if gelu else e
        tol = (0.5 * np.abs(x64) * (ERF_ERROR + 4.5e-16) if gelu else ERF_ERROR) + 4 * np.spacing(np.abs(y))
        y32 = y.astype(np.float32)
        lo = (y32.astype(np.float64) + np.nextafter(y32, np.float32(-np.inf))) * 0.5
        hi = (y32.astype(np.float64) + np.nextafter(y32, np.float32(np.inf))) * 0.5
        sure = (y - lo > tol) & (hi - y > tol) & (np.abs(z) < _ERF_LIMIT)
    if not sure.all():
        rest = ~sure
        y32[rest] = _gelu(x[rest], "none") if gelu else _erf(x[rest])
    return y32


def _unary(ops, params) -> None:
    x, out = ops
    op = first(params, 0)
    if x.dtype == np.float32 and op in (UNARY_IDS["Gelu"], UNARY_IDS["Erf"]):
        out[...] = _erf_f32(x, op == UNARY_IDS["Gelu"]).astype(out.dtype, copy=False)
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

"""erf and the exact Gelu, bit for bit as float64 math.erf rounded once to the input's type, without a Python call
per element.

NumPy has no erf and SciPy is not a dependency, so the defining formula calls math.erf (exact to float64) per element
(`erf_exact`, `gelu_exact`). That is the reference; the fast paths below return its bits: a half input has only 65536
values, so its results are a table made with the reference once; a float32 input is interpolated with a proven error
bound, and a result that bound cannot place on one side of a float32 rounding boundary goes through the reference.
Both the reference interpreter (ir/ops.py) and the simulator's codelets (codelets/elementwise.py) use them.
"""

from __future__ import annotations

import math

import numpy as np

from tremula.numerics import jit


def erf_exact(x: np.ndarray) -> np.ndarray:
    """erf in float64 (math.erf), rounded to x's type."""
    return np.vectorize(math.erf, otypes=[np.float64])(np.asarray(x).astype(np.float64)).astype(np.asarray(x).dtype)


def gelu_exact(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    """Gelu in float64 (exact with erf, or the tanh approximation), rounded to x's type."""
    if approximate == "tanh":
        return _gelu_tanh(np.asarray(x))
    x64 = x.astype(np.float64)
    y = 0.5 * x64 * (1.0 + erf_exact(x64 / math.sqrt(2.0)))
    return y.astype(x.dtype)


_TANH_CHUNK = 1 << 14  # elements: the float64 temporaries of one piece stay in cache


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    """The tanh Gelu in float64, rounded to x's type, over cache-sized pieces of x (each element's operations are
    the same either way, so are its bits). x * x * x, not x**3: NumPy's float64 pow took 0.97 of the 1.26 s of SigLIP
    so400m's Gelu on four samples (the FP8 calibration runs 27 of them); the product differs from pow by an ulp of
    float64 at most. The pieces: the whole-array passes took 11.3 s of that calibration's 74 s."""
    flat = x.reshape(-1)
    out = np.empty(flat.shape, x.dtype)
    c = math.sqrt(2.0 / math.pi)
    for i in range(0, len(flat), _TANH_CHUNK):
        x64 = flat[i: i + _TANH_CHUNK].astype(np.float64)
        out[i: i + _TANH_CHUNK] = 0.5 * x64 * (1.0 + np.tanh(c * (x64 + 0.044715 * (x64 * x64 * x64))))
    return out.reshape(x.shape)


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
    """_erf_block over cache-sized pieces of x (some thirty float64 passes each, so they should stay in cache), or
    numerics/jit.py's one pass of the same formula."""
    fast = jit.erf_block(x, gelu, _ERF_F, _ERF_D, _ERF_STEP, _ERF_LIMIT, ERF_ERROR)
    if fast is not None:
        y32, rest = fast
        if rest.any():
            y32[rest] = gelu_exact(x[rest], "none") if gelu else erf_exact(x[rest])
        return y32
    flat = x.reshape(-1)
    step = 1 << 14
    parts = [_erf_block(flat[i: i + step], gelu) for i in range(0, len(flat), step)]
    return (np.concatenate(parts) if parts else flat.copy()).reshape(x.shape)


def _erf_block(x: np.ndarray, gelu: bool) -> np.ndarray:
    """erf_exact or gelu_exact of float32 x, bit for bit: erf is interpolated (within ERF_ERROR), the same float64
    formula follows, and a result whose distance to both float32 rounding boundaries exceeds the error bound rounds
    to the same float32 as the reference's; the rare others (and |z| >= 6, inf, NaN) go through the reference."""
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
        y32[rest] = gelu_exact(x[rest], "none") if gelu else erf_exact(x[rest])
    return y32


_HALF_TABLES: dict[str, np.ndarray] = {}


def _half_table(name: str) -> np.ndarray:
    """The reference's result for every half value, indexed by its bits."""
    if name not in _HALF_TABLES:
        every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
        with np.errstate(all="ignore"):  # inf and NaN inputs too
            _HALF_TABLES[name] = erf_exact(every) if name == "erf" else gelu_exact(every, "none")
    return _HALF_TABLES[name]


def erf(x: np.ndarray) -> np.ndarray:
    """erf_exact's result, fast for half and float32 inputs."""
    x = np.asarray(x)
    if x.dtype == np.float16:
        return _half_table("erf")[x.view(np.uint16)]
    if x.dtype == np.float32:
        return _erf_f32(x, gelu=False)
    return erf_exact(x)


def gelu(x: np.ndarray, approximate: str = "none") -> np.ndarray:
    """gelu_exact's result, fast for half and float32 inputs (the tanh form is vectorised already)."""
    x = np.asarray(x)
    if approximate != "tanh" and x.dtype == np.float16:
        return _half_table("gelu")[x.view(np.uint16)]
    if approximate != "tanh" and x.dtype == np.float32:
        return _erf_f32(x, gelu=True)
    return gelu_exact(x, approximate)

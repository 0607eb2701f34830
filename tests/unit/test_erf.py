"""numerics/erf.py: the fast erf and Gelu give the bits of float64 math.erf rounded once, for every half value and
for float32 values where interpolation is hardest to decide."""

import math

import numpy as np
import pytest

from tremula.numerics.erf import erf, erf_exact, gelu, gelu_exact

EVERY_HALF = np.arange(1 << 16, dtype=np.uint16).view(np.float16)


@pytest.mark.parametrize("fast,exact", [(erf, erf_exact), (lambda x: gelu(x), lambda x: gelu_exact(x, "none")),
                                        (lambda x: gelu(x, "tanh"), lambda x: gelu_exact(x, "tanh"))])
def test_every_half_value(fast, exact):
    with np.errstate(all="ignore"):
        assert fast(EVERY_HALF).tobytes() == exact(EVERY_HALF).tobytes()
        two_d = EVERY_HALF[:4096].reshape(64, 64)
        assert fast(two_d).shape == (64, 64) and fast(two_d).tobytes() == exact(two_d).tobytes()


@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "jit"])
def test_float32_near_rounding_boundaries_and_the_range_end(compiled, monkeypatch):
    # Values whose results sit next to a float32 rounding boundary fall back to math.erf; the others must agree too.
    # Both the NumPy passes and numerics/jit.py's one-pass kernel (when numba is installed).
    from tremula.numerics import jit

    if compiled and jit.numba is None:
        pytest.skip("numba is not installed (pip install tremula[fast]): the compiled kernel is not there to test")
    monkeypatch.setattr(jit, "ENABLED", compiled)
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.standard_normal(1 << 15).astype(np.float32) * s for s in (1e-3, 0.5, 3, 20)]
                       + [np.float32([0, -0.0, 1e-30, -1e-30, 5.999, 6, 6.001, 8.485, -8.485, np.inf, -np.inf,
                                      np.nan])])
    with np.errstate(all="ignore"):
        assert erf(x).tobytes() == erf_exact(x).tobytes()
        assert gelu(x).tobytes() == gelu_exact(x, "none").tobytes()
    assert erf(np.float32([0.5]))[0] == np.float32(math.erf(0.5))


def test_other_types_use_the_definition():
    x = np.linspace(-3, 3, 7)
    assert erf(x).dtype == np.float64 and np.array_equal(erf(x), [math.erf(v) for v in x])
    assert gelu(np.zeros((0, 3), np.float32)).shape == (0, 3)


def test_tanh_gelu_in_pieces_is_the_whole_array_formula():
    """gelu_exact's tanh form runs on cache-sized pieces: the same float64 operations on each element, so the same
    bits as the formula on the whole array, for every float type (a piece boundary inside the array included)."""
    rng = np.random.default_rng(3)
    for dt in (np.float16, np.float32, np.float64):
        x = (rng.standard_normal((5, 7001)) * 4).astype(dt)
        x.reshape(-1)[:4] = [np.inf, -np.inf, np.nan, 0]
        x64 = x.astype(np.float64)
        whole = (0.5 * x64 * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * (x64 * x64 * x64))))
                 ).astype(dt)
        got = gelu_exact(x, "tanh")
        assert got.dtype == dt and got.shape == x.shape
        assert np.array_equal(got.view(np.uint8), whole.view(np.uint8))

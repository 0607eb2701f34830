"""FP8 (QUARTER) casts against ml_dtypes: rounding, saturation, NaN, scale, and unbiased stochastic rounding."""

import numpy as np
import pytest

from tremula.errors import TremulaError
from tremula.numerics.fp8 import NAN_CODE, Fp8Format, cast_to_half, dequantize, max_abs, quantize, scale_for_max_abs

ALL_HALVES = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)


@pytest.mark.parametrize("fmt", list(Fp8Format))
def test_nearest_is_bit_exact_with_ml_dtypes_for_every_in_range_half(fmt):
    x = ALL_HALVES[np.isfinite(ALL_HALVES) & (np.abs(ALL_HALVES.astype(np.float32)) <= fmt.max)]
    ours = quantize(x.astype(np.float32), fmt)
    theirs = x.astype(fmt.np_dtype).view(np.uint8)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("fmt", list(Fp8Format))
def test_every_code_round_trips(fmt):
    codes = np.arange(256, dtype=np.uint16).astype(np.uint8)
    vals = dequantize(codes, fmt)
    finite = ~np.isnan(vals)
    assert np.count_nonzero(~finite) == 1 and np.isnan(vals[NAN_CODE])
    back = quantize(vals[finite], fmt)
    # 0x00 and the fnuz formats' lack of -0 mean every finite code maps to itself.
    np.testing.assert_array_equal(back, codes[finite])


@pytest.mark.parametrize("fmt,top", [(Fp8Format.F143, 240.0), (Fp8Format.F152, 57344.0)])
def test_saturates_instead_of_nan(fmt, top):
    x = np.array([1e6, -1e6, np.inf, -np.inf, top * 1.5], np.float32)
    y = dequantize(quantize(x, fmt), fmt)
    np.testing.assert_array_equal(y, [top, -top, top, -top, top])
    # ml_dtypes itself would give NaN here: the reason we clip first.
    assert np.isnan(np.float32(1e6).astype(fmt.np_dtype).astype(np.float32))


def test_nan_maps_to_the_nan_code():
    codes = quantize(np.array([np.nan, 1.0], np.float32), Fp8Format.F143)
    assert codes[0] == NAN_CODE and codes[1] != NAN_CODE


def test_scale_multiplies_by_power_of_two():
    x = np.array([0.001, 0.5, 3.0], np.float32)
    for s in (-6, 0, 4):
        np.testing.assert_array_equal(
            dequantize(quantize(x, Fp8Format.F143, s), Fp8Format.F143, s),
            dequantize(quantize(x * 2.0**-s, Fp8Format.F143), Fp8Format.F143) * np.float32(2.0**s),
        )


def test_scale_for_max_abs_fits_the_range():
    for m in (1e-3, 0.7, 240.0, 241.0, 5e4):
        s = scale_for_max_abs(m, Fp8Format.F143)
        assert m * 2.0**-s <= 240.0 < m * 2.0 ** -(s - 1)
    assert scale_for_max_abs(0.0, Fp8Format.F143) == 0


def test_max_abs_of_halves_from_their_bits_equals_numpys():
    finite = ALL_HALVES[np.isfinite(ALL_HALVES)]
    for x in (finite, finite[::-1].reshape(-1, 4).T, finite[:7], -finite[finite > 0][:100], np.zeros(3, np.float16)):
        want = float(np.abs(x.astype(np.float32)).max())
        assert max_abs(x) == want and max_abs(x.astype(np.float32)) == want
    with_inf = np.array([1.0, -np.inf, 3.0], np.float16)
    assert max_abs(with_inf) == np.inf
    for nan in (np.float16(np.nan), -np.float16(np.nan), ALL_HALVES[0x7C01]):  # any NaN pattern, either sign
        assert np.isnan(max_abs(np.array([1.0, nan, np.inf], np.float16)))
    assert max_abs(np.zeros(0, np.float16)) == 0.0


@pytest.mark.parametrize("fmt", list(Fp8Format))
def test_stochastic_rounding_is_unbiased_and_seeded(fmt):
    # A value between two representable neighbours: the mean of many stochastic casts converges to it.
    x = np.full(200_000, 1.1, np.float32)
    a = dequantize(quantize(x, fmt, rounding="stochastic", rng=np.random.default_rng(7)), fmt)
    b = dequantize(quantize(x, fmt, rounding="stochastic", rng=np.random.default_rng(7)), fmt)
    np.testing.assert_array_equal(a, b)
    assert len(np.unique(a)) == 2  # only the two neighbours appear
    nearest = float(dequantize(quantize(x[:1], fmt), fmt)[0])
    lo, hi = float(a.min()), float(a.max())
    se = (hi - lo) / 2 / np.sqrt(x.size)  # standard error of a Bernoulli mean, at most
    assert abs(float(a.astype(np.float64).mean()) - float(np.float16(1.1))) < 5 * se
    assert abs(nearest - 1.1) > 5 * se  # round-to-nearest is biased here; the test would catch a nearest fallback


def test_stochastic_needs_a_generator():
    with pytest.raises(TremulaError):
        quantize(np.ones(3, np.float32), Fp8Format.F143, rounding="stochastic")


def test_half_cast_saturates_and_rounds_stochastically_without_bias():
    x = np.array([1e6, -1e6, 1.0], np.float32)
    np.testing.assert_array_equal(cast_to_half(x), np.array([65504, -65504, 1], np.float16))
    v = np.full(200_000, 1.0 + 2.0**-12, np.float32)  # a quarter of a half ULP above 1
    y = cast_to_half(v, "stochastic", np.random.default_rng(3)).astype(np.float64)
    assert set(np.unique(y)) == {1.0, 1.0 + 2.0**-10}
    assert abs(y.mean() - (1.0 + 2.0**-12)) < 5 * (2.0**-10 / 2) / np.sqrt(v.size)


def test_format_parse():
    assert Fp8Format.parse("f152") is Fp8Format.F152
    with pytest.raises(TremulaError):
        Fp8Format.parse("F161")

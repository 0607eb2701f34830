"""The table-driven quantize and the float32 AMP matmul against the straightforward float16 forms they replaced."""

import numpy as np
import pytest

from tremula.numerics import jit
from tremula.numerics.fp8 import Fp8Format, amp_fp8_matmul, cast_to_half, dequantize, fake_quantize, quantize

F16_MAX = float(np.finfo(np.float16).max)


def quantize_oracle(x, fmt, scale=0, rounding="nearest", rng=None):
    """The former quantize: half cast, clip, ml_dtypes cast or searchsorted stochastic rounding."""
    from tremula.numerics.fp8 import _GRIDS, NAN_CODE

    half = cast_to_half(np.asarray(x, np.float32) * np.float32(2.0**-scale))
    nan = np.isnan(half)
    h = np.clip(np.nan_to_num(half, nan=0.0), -fmt.max, fmt.max)
    if rounding == "nearest":
        codes = h.astype(fmt.np_dtype).view(np.uint8).copy()
    else:
        vals, grid_codes = _GRIDS[fmt]
        mag = np.abs(h.astype(np.float64))
        hi_idx = np.clip(np.searchsorted(vals, mag, side="left"), 0, len(vals) - 1)
        lo_idx = np.where(vals[hi_idx] > mag, hi_idx - 1, hi_idx)
        lo, hi = vals[lo_idx], vals[hi_idx]
        p_up = np.where(hi > lo, (mag - lo) / np.where(hi > lo, hi - lo, 1.0), 0.0)
        up = rng.random(mag.shape) < p_up
        codes = grid_codes[np.where(up, hi_idx, lo_idx)].astype(np.uint8)
        codes = np.where((h < 0) & (codes != 0), codes | 0x80, codes).astype(np.uint8)
    codes[nan] = NAN_CODE
    return codes


def amp_oracle(xc, wc, xf, wf, xs, ws, group):
    """The former amp_fp8_matmul: the running sum in half arrays."""
    x = np.asarray(xc, np.uint8).view(xf.np_dtype).astype(np.float16).astype(np.float32)
    w = np.asarray(wc, np.uint8).view(wf.np_dtype).astype(np.float16).astype(np.float32)
    scale = np.float32(2.0 ** (xs + ws))
    acc = np.zeros(x.shape[:-1] + (w.shape[-1],), np.float16)
    for k0 in range(0, x.shape[-1], group):
        part = np.matmul(x[..., k0: k0 + group], w[..., k0: k0 + group, :]) * scale
        acc = np.clip(acc.astype(np.float32) + part, -F16_MAX, F16_MAX).astype(np.float16)
    return acc.astype(np.float32)


def edge_floats(rng, n=50_000):
    """Every half (as float32), halves' midpoints (ties), values past the half range, NaN, inf, random spreads."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    fin = halves[np.isfinite(halves)]
    srt = np.unique(fin)
    mids = ((srt[:-1].astype(np.float64) + srt[1:]) / 2).astype(np.float32)
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 65504, 65519, 65520, 1e6, -1e6, 0.0, -0.0, 1e-30, -1e-30,
                        2.0**-24, 2.0**-25, 3 * 2.0**-26], np.float32)
    spread = (rng.standard_normal(n) * 10.0 ** rng.uniform(-9, 6, n)).astype(np.float32)
    return np.concatenate([halves, mids, np.nextafter(mids, np.float32(np.inf)),
                           np.nextafter(mids, np.float32(-np.inf)), special, spread])


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("fmt", list(Fp8Format))
@pytest.mark.parametrize("scale", [-12, -3, 0, 5, 20])
def test_quantize_nearest_matches_the_half_path(fmt, scale):
    x = edge_floats(np.random.default_rng(1))
    same_bits(quantize(x, fmt, scale), quantize_oracle(x, fmt, scale))
    x16 = x[:4000].astype(np.float16).reshape(-1, 4)  # half inputs and 2-D shapes too
    same_bits(quantize(x16, fmt, scale), quantize_oracle(x16, fmt, scale))


@pytest.mark.parametrize("fmt", list(Fp8Format))
@pytest.mark.parametrize("scale", [-4, 0, 3])
def test_quantize_stochastic_draws_the_same_numbers(fmt, scale):
    x = edge_floats(np.random.default_rng(2))[:-10].reshape(-1, 2)
    got = quantize(x, fmt, scale, "stochastic", np.random.default_rng(11))
    same_bits(got, quantize_oracle(x, fmt, scale, "stochastic", np.random.default_rng(11)))


@pytest.mark.parametrize("fmt", list(Fp8Format))
def test_dequantize_matches_the_half_path(fmt):
    codes = np.arange(256, dtype=np.uint16).astype(np.uint8)
    for scale in (-20, 0, 7):
        want = (codes.view(fmt.np_dtype).astype(np.float16).astype(np.float32) * np.float32(2.0**scale))
        for dt in ("float32", "float16"):
            same_bits(dequantize(codes, fmt, scale, dt), want.astype(dt))


@pytest.mark.parametrize("fmt", list(Fp8Format))
@pytest.mark.parametrize("scale", [-12, 0, 5, 20])
def test_fake_quantize_is_quantize_then_dequantize(fmt, scale):
    """The one-pass round trip (through a table of every half pattern) gives the two steps' bits, NaNs included."""
    x = edge_floats(np.random.default_rng(3))[:306_000].reshape(-1, 6)[:, 1:]  # (a strided view as well)
    want = dequantize(quantize(x, fmt, scale), fmt, scale, "float32")
    assert jit.ENABLED, "numba is installed with the test extra: the one-pass kernel must be the one tested"
    same_bits(fake_quantize(x, fmt, scale), want)
    x16 = x[:1000].astype(np.float16)  # half: the two steps
    same_bits(fake_quantize(x16, fmt, scale), dequantize(quantize(x16, fmt, scale), fmt, scale, "float16"))


@pytest.mark.parametrize("xf,wf", [(Fp8Format.F143, Fp8Format.F143), (Fp8Format.F152, Fp8Format.F143),
                                   (Fp8Format.F143, Fp8Format.F152)])
@pytest.mark.parametrize("xs,ws,group", [(-4, -7, 16), (0, 0, 16), (3, 4, 8), (-12, -14, 16), (0, 0, 5)])
def test_amp_matmul_matches_the_half_path(xf, wf, xs, ws, group):
    rng = np.random.default_rng(abs(xs * 100 + ws) + group)
    for xshape, wshape in (((2, 7, 48), (48, 33)), ((9, 64), (64, 20)), ((3, 5, 37), (3, 37, 6))):
        xc = rng.integers(0, 256, xshape).astype(np.uint8)
        wc = rng.integers(0, 256, wshape).astype(np.uint8)
        xc[xc == 0x80] = 0  # NaN codes are tested on their own
        wc[wc == 0x80] = 1
        same_bits(amp_fp8_matmul(xc, wc, xf, wf, xs, ws, group), amp_oracle(xc, wc, xf, wf, xs, ws, group))


def test_amp_matmul_nan_codes_and_saturation_match():
    rng = np.random.default_rng(5)
    xc = rng.integers(0, 256, (4, 32)).astype(np.uint8)
    wc = rng.integers(0, 256, (32, 8)).astype(np.uint8)
    xc[0, 3] = 0x80
    f = Fp8Format.F152
    for xs, ws in ((0, 0), (10, 12), (100, 100)):  # 2**200 overflows float32: inf scale, 0 * inf NaNs
        same_bits(amp_fp8_matmul(xc, wc, f, f, xs, ws, 16), amp_oracle(xc, wc, f, f, xs, ws, 16))

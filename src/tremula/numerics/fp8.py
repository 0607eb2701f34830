"""FP8 as the C600 (ipu21) has it: QUARTER codes with a format (F143 / F152) and an integer power-of-two scale.

value = decode(code) * 2**scale. F143 at scale 0 is ml_dtypes.float8_e4m3fnuz, F152 is float8_e5m2fnuz (bias 8 / 16,
one NaN code 0x80, no -0, no Inf; ipu-hardware.md section 5). The hardware has no float<->quarter instruction: casts go
float -> half -> quarter (and back), with round-to-nearest-even or stochastic rounding, and saturate to the largest
finite value instead of producing NaN as ml_dtypes does on overflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import ml_dtypes
import numpy as np

from tremula.errors import TremulaError


class Fp8Format(Enum):
    F143 = "F143"
    F152 = "F152"

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(ml_dtypes.float8_e4m3fnuz if self is Fp8Format.F143 else ml_dtypes.float8_e5m2fnuz)

    @property
    def max(self) -> float:
        return float(ml_dtypes.finfo(self.np_dtype).max)

    @staticmethod
    def parse(name: str) -> Fp8Format:
        try:
            return Fp8Format(name.upper())
        except ValueError:
            raise TremulaError(f"unknown FP8 format {name!r} (use F143 or F152)") from None


NAN_CODE = 0x80  # the single NaN of both fnuz formats


@dataclass(frozen=True)
class Fp8Tensor:
    """FP8 data as the IPU stores it: one byte per element plus the tensor's format and scale."""

    codes: np.ndarray  # uint8
    fmt: Fp8Format
    scale: int

    def decode(self, dtype: str = "float32") -> np.ndarray:
        return dequantize(self.codes, self.fmt, self.scale, dtype)


def _positive_grid(fmt: Fp8Format) -> tuple[np.ndarray, np.ndarray]:
    """All non-negative finite values of the format, ascending, with their codes (for stochastic rounding)."""
    codes = np.arange(0, 0x80, dtype=np.uint8)
    vals = codes.view(fmt.np_dtype).astype(np.float64)
    order = np.argsort(vals, kind="stable")
    return vals[order], codes[order]


_GRIDS = {f: _positive_grid(f) for f in Fp8Format}


def scale_for_max_abs(max_abs: float, fmt: Fp8Format) -> int:
    """The integer scale that puts max_abs at or just below the format's largest value (0 for an all-zero tensor)."""
    if not np.isfinite(max_abs) or max_abs <= 0:
        return 0
    return int(np.ceil(np.log2(max_abs / fmt.max)))


def quantize(
    x: np.ndarray,
    fmt: Fp8Format,
    scale: int = 0,
    rounding: str = "nearest",
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """float -> FP8 codes (uint8) the way the hardware does it: through half, saturating, NaN to the NaN code.

    rounding="stochastic" rounds |x| up to the next representable value with probability equal to its distance from
    the lower one (so the result is unbiased); it needs an explicit, seeded `rng` to stay deterministic.
    """
    half = cast_to_half(np.asarray(x, np.float32) * np.float32(2.0**-scale))
    nan = np.isnan(half)
    h = np.clip(np.nan_to_num(half, nan=0.0), -fmt.max, fmt.max)  # saturate (also maps +-inf to +-max)
    if rounding == "nearest":
        codes = h.astype(fmt.np_dtype).view(np.uint8).copy()
    elif rounding == "stochastic":
        if rng is None:
            raise TremulaError("stochastic rounding needs a seeded random generator")
        vals, grid_codes = _GRIDS[fmt]
        mag = np.abs(h.astype(np.float64))
        hi_idx = np.clip(np.searchsorted(vals, mag, side="left"), 0, len(vals) - 1)
        lo_idx = np.where(vals[hi_idx] > mag, hi_idx - 1, hi_idx)
        lo, hi = vals[lo_idx], vals[hi_idx]
        p_up = np.where(hi > lo, (mag - lo) / np.where(hi > lo, hi - lo, 1.0), 0.0)
        up = rng.random(mag.shape) < p_up
        pick = np.where(up, hi_idx, lo_idx)
        codes = grid_codes[pick].astype(np.uint8)
        negative = (h < 0) & (codes != 0)  # fnuz has no -0: a negative value that rounds to zero is +0
        codes = np.where(negative, codes | 0x80, codes).astype(np.uint8)
    else:
        raise TremulaError(f"unknown rounding mode {rounding!r} (use nearest or stochastic)")
    codes[nan] = NAN_CODE
    return codes


def dequantize(codes: np.ndarray, fmt: Fp8Format, scale: int = 0, dtype: str = "float32") -> np.ndarray:
    """FP8 codes -> values: quarter -> half is exact; the power-of-two scale is applied after, as the hardware does."""
    half = np.asarray(codes, np.uint8).view(fmt.np_dtype).astype(np.float16)
    return (half.astype(np.float32) * np.float32(2.0**scale)).astype(dtype)


def cast_to_half(x: np.ndarray, rounding: str = "nearest", rng: np.random.Generator | None = None) -> np.ndarray:
    """float32 -> float16, saturating (the IPU clamps instead of overflowing to inf), nearest or stochastic rounding."""
    f16max = float(np.finfo(np.float16).max)
    x = np.asarray(x, np.float32)
    clipped = np.where(np.isnan(x), x, np.clip(x, -f16max, f16max))
    if rounding == "nearest":
        return clipped.astype(np.float16)
    if rng is None:
        raise TremulaError("stochastic rounding needs a seeded random generator")
    # Drop the 13 low mantissa bits of the float32 after adding uniform random bits: unbiased for normal halves.
    # Subnormal halves fall back to nearest rounding, which is what the low bits of a tiny value amount to.
    bits = clipped.view(np.uint32).astype(np.uint64)
    noise = rng.integers(0, 1 << 13, size=x.shape, dtype=np.uint64)
    rounded = (((bits + noise) >> 13) << 13).astype(np.uint32).view(np.float32)
    tiny = np.abs(clipped) < np.finfo(np.float16).tiny
    out = np.where(tiny | np.isnan(clipped), clipped, np.clip(rounded, -f16max, f16max))
    return out.astype(np.float16)


def amp_fp8_matmul(x_codes: np.ndarray, w_codes: np.ndarray, x_fmt: Fp8Format, w_fmt: Fp8Format, x_scale: int,
                   w_scale: int, group: int) -> np.ndarray:
    """[.., m, k] codes @ [.., k, n] codes -> float32 values of the half partials the AMP writes.

    The quarter -> half AMP sums `group` input channels (its weights per conv unit) exactly, scales that by the two
    tensors' 2**scale (exact: a power of two) and adds it into a half partial: so the running sum is rounded to half
    after every group of k, and it is the scaled sum that must fit in half (unscaled F143 products reach 240 x 240,
    which a few dozen terms would overflow). Decoding quarter to half is exact.
    """
    x = dequantize(x_codes, x_fmt, 0, "float32")
    w = dequantize(w_codes, w_fmt, 0, "float32")
    k = x.shape[-1]
    scale = np.float32(2.0 ** (x_scale + w_scale))
    f16max = float(np.finfo(np.float16).max)
    acc = np.zeros(x.shape[:-1] + (w.shape[-1],), np.float16)
    for k0 in range(0, k, group):
        part = np.matmul(x[..., k0: k0 + group], w[..., k0: k0 + group, :]) * scale
        acc = np.clip(acc.astype(np.float32) + part, -f16max, f16max).astype(np.float16)  # partials saturate
    return acc.astype(np.float32)

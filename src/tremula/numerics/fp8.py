"""FP8 as the C600 (ipu21) has it: QUARTER codes with a format (F143 / F152) and an integer power-of-two scale.

value = decode(code) * 2**scale. F143 at scale 0 is ml_dtypes.float8_e4m3fnuz, F152 is float8_e5m2fnuz (bias 8 / 16,
one NaN code 0x80, no -0, no Inf; ipu-hardware.md section 5). The hardware has no float<->quarter instruction: casts go
float -> half -> quarter (and back), with round-to-nearest-even or stochastic rounding, and saturate to the largest
finite value instead of producing NaN as ml_dtypes does on overflow.
"""

from __future__ import annotations

from enum import Enum

import ml_dtypes
import numpy as np

from tremula.errors import TremulaError
from tremula.numerics import jit
from tremula.numerics.amp import F16_MAX, as_half, half_partial_sums


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
# FP8 as a dtype: each format's ml_dtypes name, in the order of the codelets' format ids (codelets/fp8.FORMATS).
# A Graph's, a plan's and a Program's FP8 tensors have these dtypes; tile memory holds one code byte per element.
FP8_DTYPES = tuple(f.np_dtype.name for f in Fp8Format)  # ("float8_e4m3fnuz", "float8_e5m2fnuz")


def is_fp8(dtype) -> bool:
    """Whether `dtype` (a name or a NumPy dtype) is an FP8 format."""
    return str(dtype) in FP8_DTYPES


def fp8_format(dtype) -> Fp8Format:
    """The FP8 format of an FP8 dtype (its name or a NumPy dtype)."""
    name = str(dtype)
    if name not in FP8_DTYPES:
        raise TremulaError(f"{name} is not an FP8 dtype (FP8 dtypes: {', '.join(FP8_DTYPES)})")
    return list(Fp8Format)[FP8_DTYPES.index(name)]


def code_bytes(x: np.ndarray) -> np.ndarray:
    """An FP8 array's code bytes (uint8, the same memory); uint8 codes pass through."""
    return x.view(np.uint8) if is_fp8(x.dtype) else np.asarray(x, np.uint8)


def _positive_grid(fmt: Fp8Format) -> tuple[np.ndarray, np.ndarray]:
    """All non-negative finite values of the format, ascending, with their codes (for stochastic rounding)."""
    codes = np.arange(0, 0x80, dtype=np.uint8)
    vals = codes.view(fmt.np_dtype).astype(np.float64)
    order = np.argsort(vals, kind="stable")
    return vals[order], codes[order]


_GRIDS = {f: _positive_grid(f) for f in Fp8Format}


def max_abs(x: np.ndarray) -> float:
    """max |x| (0 for an empty array, NaN when x holds one), from its max and min: np.abs would first write a copy of
    x, and calibration takes this of every activation an FP8 cast reads (tens of MB each in SigLIP so400m)."""
    x = np.asarray(x)
    if x.size == 0:
        return 0.0
    if x.dtype == np.float16:
        # NumPy's half max and min are scalar loops (SigLIP so400m's FP8 weight codes are made from half weights:
        # 9.8 of the 17 s their making took); a half's magnitude orders as its bits without the sign, so the max of
        # those as uint16 is exact, and any above infinity's pattern is a NaN
        top = int(np.bitwise_and(x.reshape(-1).view(np.uint16), 0x7FFF).max())
        return float("nan") if top > 0x7C00 else float(np.uint16(top).view(np.float16))
    return max(float(x.max()), -float(x.min()))


def scale_for_max_abs(max_abs: float, fmt: Fp8Format) -> int:
    """The integer scale that puts max_abs at or just below the format's largest value (0 for an all-zero tensor)."""
    if not np.isfinite(max_abs) or max_abs <= 0:
        return 0
    return int(np.ceil(np.log2(max_abs / fmt.max)))


def _nearest_table(fmt: Fp8Format) -> np.ndarray:
    """half bit pattern -> FP8 code, round to nearest even: saturate, NaN to the NaN code (every half at once, so
    quantize costs one half cast and one table lookup instead of several passes of NumPy's slow float16 ops)."""
    h = _ALL_HALVES
    codes = np.clip(np.nan_to_num(h, nan=0.0), -fmt.max, fmt.max).astype(fmt.np_dtype).view(np.uint8).copy()
    codes[np.isnan(h)] = NAN_CODE
    return codes


def _stochastic_tables(fmt: Fp8Format) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """half bit pattern -> (code rounded down in magnitude, code rounded up, probability of rounding up), signs and
    NaN folded in: a stochastic cast then draws one uniform per element and picks, as the searchsorted form did."""
    h = _ALL_HALVES
    nan = np.isnan(h)
    h = np.clip(np.nan_to_num(h, nan=0.0), -fmt.max, fmt.max)
    vals, grid_codes = _GRIDS[fmt]
    mag = np.abs(h.astype(np.float64))
    hi_idx = np.clip(np.searchsorted(vals, mag, side="left"), 0, len(vals) - 1)
    lo_idx = np.where(vals[hi_idx] > mag, hi_idx - 1, hi_idx)
    lo, hi = vals[lo_idx], vals[hi_idx]
    p_up = np.where(hi > lo, (mag - lo) / np.where(hi > lo, hi - lo, 1.0), 0.0)

    def signed(idx: np.ndarray) -> np.ndarray:
        codes = grid_codes[idx].astype(np.uint8)
        codes = np.where((h < 0) & (codes != 0), codes | 0x80, codes).astype(np.uint8)  # fnuz has no -0
        codes[nan] = NAN_CODE
        return codes

    return signed(lo_idx), signed(hi_idx), p_up


_ALL_HALVES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
_NEAREST = {f: _nearest_table(f) for f in Fp8Format}
_STOCHASTIC = {f: _stochastic_tables(f) for f in Fp8Format}


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
    if rounding not in ("nearest", "stochastic"):
        raise TremulaError(f"unknown rounding mode {rounding!r} (use nearest or stochastic)")
    if rounding == "stochastic" and rng is None:
        raise TremulaError("stochastic rounding needs a seeded random generator")
    # No clip before the half cast: a value past 65504 becomes inf instead of 65504, and the tables saturate both
    # to the format's largest code (its max is below 65504).
    with np.errstate(over="ignore"):  # the overflow to inf is the saturation above, not an error
        bits = as_half(np.asarray(x, np.float32) * np.float32(2.0**-scale)).view(np.uint16)
    if rounding == "nearest":
        return table_lookup(_NEAREST[fmt], bits)
    lo, hi, p_up = _STOCHASTIC[fmt]
    up = rng.random(bits.shape) < np.take(p_up, bits)  # one draw per element, in order, as before
    return np.where(up, np.take(hi, bits), np.take(lo, bits))


def table_lookup(table: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """table[idx] for uint8 / uint16 indices (numerics/jit.py: one pass; else np.take)."""
    out = jit.lookup(table, idx)
    return np.take(table, idx) if out is None else out


def decode(codes: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    """FP8 codes -> their float32 values at scale 0 (exact)."""
    return table_lookup(_DECODE[fmt], np.asarray(codes, np.uint8))


def dequantize(codes: np.ndarray, fmt: Fp8Format, scale: int = 0, dtype: str = "float32") -> np.ndarray:
    """FP8 codes -> values: quarter -> half is exact; the power-of-two scale is applied after, as the hardware does."""
    out = decode(codes, fmt)  # a new array: scaled in place (the same float32 product), no copy for float32
    out *= np.float32(2.0**scale)
    return out.astype(dtype, copy=False)


# code -> float32 value at scale 0 (quarter -> half -> float, all exact; the NaN code decodes to NaN)
_DECODE = {f: np.arange(256, dtype=np.uint16).astype(np.uint8).view(f.np_dtype).astype(np.float16).astype(np.float32)
           for f in Fp8Format}


def _grid(fmt: Fp8Format) -> tuple[int, float, float]:
    """(mantissa bits, smallest normal binade, largest binade) of an FP8 format, read from ml_dtypes."""
    info = ml_dtypes.finfo(fmt.np_dtype)
    return int(info.nmant), float(info.smallest_normal), float(2.0 ** np.floor(np.log2(float(info.max))))


def fake_quantize(x: np.ndarray, fmt: Fp8Format, scale: int = 0) -> np.ndarray:
    """dequantize(quantize(x, fmt, scale), fmt, scale, x.dtype), rounding to nearest: the values an FP8 operand
    holds. Float32 in one pass (numerics/jit.py) that rounds to half and then to the format's grid by arithmetic, the
    same float32 products, so the same bits (tests/unit/test_fp8_fast.py: every half, their midpoints, edge values;
    checked once over every float32 pattern, both formats, scales -5, 0 and 9); else the two steps."""
    x = np.asarray(x)
    if x.dtype == np.float32:
        mant, lo, hi = _grid(fmt)
        with np.errstate(over="ignore"):
            out = jit.fp8_round_trip(x, 2.0**-scale, mant, lo, hi, fmt.max, _DECODE[fmt][NAN_CODE], 2.0**scale)
        if out is not None:
            return out
    return dequantize(quantize(x, fmt, scale), fmt, scale, x.dtype)


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

    The half partials are numerics/amp.half_partial_sums: one float32 BLAS matmul per group, the running sum in
    float32 holding half values, the same numbers as half arrays in a fraction of NumPy's float16 time (a group's
    sum of FP8 products is exact in float32).
    """
    x, w = decode(x_codes, x_fmt), decode(w_codes, w_fmt)
    scale = np.float32(2.0 ** (x_scale + w_scale))
    acc = half_partial_sums(x, w, group, scale)
    if np.isnan(acc).any():  # NaN codes: carry the NaNs through half arrays so their bits stay as they were
        return _amp_through_half(x, w, scale, group)
    return acc


def _amp_through_half(x: np.ndarray, w: np.ndarray, scale: np.float32, group: int) -> np.ndarray:
    acc = np.zeros(x.shape[:-1] + (w.shape[-1],), np.float16)
    for k0 in range(0, x.shape[-1], group):
        part = np.matmul(x[..., k0: k0 + group], w[..., k0: k0 + group, :]) * scale
        acc = np.clip(acc.astype(np.float32) + part, -F16_MAX, F16_MAX).astype(np.float16)
    return acc.astype(np.float32)

"""FP8 codelets: the cast matches the number format, the quarter->half AMP matmul rounds partials to half per group."""

import numpy as np
import pytest

from tremula.codelets import codelet
from tremula.codelets.fp8 import amp_fp8_matmul, format_id
from tremula.errors import TremulaError
from tremula.numerics.fp8 import FP8_DTYPES, Fp8Format, dequantize, quantize
from tremula.target.chip import load_chip


def test_cast_codelet_writes_the_codes_of_the_format():
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float16)
    out = np.zeros((4, 8), np.uint8)
    codelet("fp8_cast").run([x, out], (format_id("F143"), -3, 0, 0))
    np.testing.assert_array_equal(out, quantize(x, Fp8Format.F143, -3))


def test_amp_fp8_matmul_is_close_to_exact_and_exact_within_one_group():
    rng = np.random.default_rng(1)
    xc = quantize(rng.standard_normal((8, 96)), Fp8Format.F143, -4)
    wc = quantize(rng.standard_normal((96, 5)) * 0.1, Fp8Format.F143, -7)
    exact = dequantize(xc, Fp8Format.F143, -4).astype(np.float64) @ dequantize(wc, Fp8Format.F143, -7)
    y = amp_fp8_matmul(xc, wc, Fp8Format.F143, Fp8Format.F143, -4, -7, group=32)
    assert np.max(np.abs(y - exact)) <= 4 * 2.0**-11 * np.max(np.abs(exact))  # a few half ulps of rounding
    # One group: the sum is exact in float32 and rounded to half once.
    y1 = amp_fp8_matmul(xc[:, :32], wc[:32], Fp8Format.F143, Fp8Format.F143, -4, -7, group=32)
    e1 = dequantize(xc[:, :32], Fp8Format.F143, 0).astype(np.float32) @ dequantize(wc[:32], Fp8Format.F143, 0)
    np.testing.assert_array_equal(y1, e1.astype(np.float16).astype(np.float32) * np.float32(2.0**-11))


def test_matmul_fp8_codelet_reads_the_weight_scale_from_tile_memory():
    rng = np.random.default_rng(2)
    xc = quantize(rng.standard_normal((3, 40)), Fp8Format.F143, -5)
    wc = quantize(rng.standard_normal((40, 6)), Fp8Format.F152, -2)
    out = np.zeros((3, 6), np.float16)
    codelet("matmul_fp8").run([xc, wc, np.array([[-2]], np.int8), out], (0, 0, 1, -5, 32))
    ref = amp_fp8_matmul(xc, wc, Fp8Format.F143, Fp8Format.F152, -5, -2, 32)
    np.testing.assert_array_equal(out, ref.astype(np.float16))


def test_fp8_matmul_cycles_use_the_c600_quarter_rate_and_fail_elsewhere():
    c600 = load_chip("c600")
    cl = codelet("matmul_fp8")
    shapes = [(64, 512), (512, 64), (1, 1), (64, 64)]
    fp8 = cl.cycles(c600, (0, 0, 0, 0, 32), shapes, (FP8_DTYPES[0], FP8_DTYPES[0], "int8", "float16"))
    fp16 = codelet("matmul").cycles(c600, (0,), [(64, 512), (512, 64), (64, 64)], ("float16",) * 3)
    assert fp8 < fp16
    with pytest.raises(TremulaError):
        cl.cycles(load_chip("mk2"), (0, 0, 0, 0, 32), shapes, (FP8_DTYPES[0], FP8_DTYPES[0], "int8", "float16"))


def test_layernorm_over_column_blocks_matches_two_pass():
    """LayerNorm split in column parts (moments per part, combined per row) equals the one-block two-pass codelet, also
    for rows whose mean is a thousand times their spread (where sum-of-squares formulas lose every digit)."""
    import numpy as np

    from tremula.codelets import codelet, f2i
    from tremula.plan.layout import even_cuts

    rng = np.random.default_rng(0)
    rows, cols, parts = 5, 37, 4
    x = (rng.standard_normal((rows, cols)) * 0.1 + np.array([[100], [0], [-5], [1], [30]])).astype(np.float32)
    g = rng.standard_normal((1, cols)).astype(np.float32)
    b = rng.standard_normal((1, cols)).astype(np.float32)
    cuts = even_cuts(cols, parts)
    mom = np.zeros((parts * rows, 2), np.float32)
    for j in range(parts):
        codelet("layernorm_moments").run([x[:, cuts[j]:cuts[j + 1]], mom[j * rows:(j + 1) * rows]], [0])
    got = np.zeros_like(x)
    eps = 1e-6
    for j in range(parts):
        c = slice(cuts[j], cuts[j + 1])
        out = np.zeros((rows, cuts[j + 1] - cuts[j]), np.float32)
        codelet("layernorm_apply").run([x[:, c], mom, g[:, c], b[:, c], out], [f2i(eps), 1, parts, cols])
        got[:, c] = out
    want = np.zeros_like(x)
    codelet("layernorm").run([x, g, b, want], [f2i(eps), 1])
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    sq = (x.astype(np.float32) ** 2).mean(-1) - x.astype(np.float32).mean(-1) ** 2  # the formula it avoids
    assert abs(sq[0] - np.var(x[0].astype(np.float64))) > 0.1 * np.var(x[0].astype(np.float64))

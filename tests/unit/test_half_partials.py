"""Half partials (numerics/amp.py): the running sum rounded to half after every group of K, in the reference and the
codelets alike, and a split-K sum in half in part order. Every test runs twice: on NumPy's passes and on the compiled
kernels of numerics/jit.py (when numba is installed), which must give the same bits."""

import numpy as np
import pytest

from tremula.codelets import codelet
from tremula.numerics import jit
from tremula.numerics.amp import half_partials_matmul


@pytest.fixture(params=[False, True], ids=["numpy", "jit"], autouse=True)
def kernels(request, monkeypatch):
    if request.param and jit.numba is None:
        pytest.skip("numba is not installed (pip install tremula[fast]): the compiled kernels are not there to test")
    monkeypatch.setattr(jit, "ENABLED", request.param)
    return request.param


def _slow(x, w, group):
    """The definition, in half arrays: partial = half(partial + float32 sum of the group's products), saturating."""
    acc = np.zeros((x.shape[0], w.shape[1]), np.float16)
    for k0 in range(0, x.shape[1], group):
        part = x[:, k0:k0 + group].astype(np.float32) @ w[k0:k0 + group].astype(np.float32)
        acc = np.clip(acc.astype(np.float32) + part, -65504, 65504).astype(np.float16)
    return acc


@pytest.mark.parametrize("k,group", [(64, 16), (50, 16), (768, 16), (96, 32)])
def test_running_sum_is_rounded_to_half_after_every_group(k, group):
    rng = np.random.default_rng(k)
    x = rng.standard_normal((37, k)).astype(np.float16)
    w = (rng.standard_normal((k, 29)) / 8).astype(np.float16)
    got = half_partials_matmul(x, w, group)
    assert got.dtype == np.float16 and got.tobytes() == _slow(x, w, group).tobytes()
    once = (x.astype(np.float32) @ w.astype(np.float32)).astype(np.float16)  # float partials: one rounding
    assert (got != once).any()  # (K is several groups: the extra roundings show in some element)


def test_exact_group_sums_are_the_float64_sums_rounded_once_whatever_the_blocks(monkeypatch):
    """EXACT_GROUP_SUMS: each group's products summed exactly (float64 here, with values whose products are exact in
    it) and rounded once to float32; a stack of row blocks (the simulator's vertices) gives the bits of the whole
    matrix (the reference's)."""
    from tremula.numerics import amp

    monkeypatch.setattr(amp, "EXACT_GROUP_SUMS", True)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((12, 96)) * np.exp2(rng.integers(-12, 8, (12, 96)))).astype(np.float16)
    w = rng.standard_normal((96, 40)).astype(np.float16)
    want = np.zeros((12, 40), np.float32)
    for k0 in range(0, 96, 16):
        part = (x[:, k0:k0 + 16].astype(np.float64) @ w[k0:k0 + 16].astype(np.float64)).astype(np.float32)
        want = amp.saturate_round_half(want + part)
    whole = amp.half_partial_sums(x.astype(np.float32), w.astype(np.float32), 16)
    assert np.array_equal(whole.view(np.uint32), want.view(np.uint32))
    xs = x.astype(np.float32).reshape(6, 2, 96)  # six vertices of two rows each, the same weights
    stacked = amp.half_partial_sums(xs, np.broadcast_to(w.astype(np.float32), (6, 96, 40)).copy(), 16)
    assert np.array_equal(stacked.reshape(12, 40).view(np.uint32), want.view(np.uint32))


def test_one_group_is_one_rounding_and_overflow_saturates():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((5, 16)).astype(np.float16), rng.standard_normal((16, 3)).astype(np.float16)
    once = (x.astype(np.float32) @ w.astype(np.float32)).astype(np.float16)
    assert np.array_equal(half_partials_matmul(x, w, 16), once)
    big = np.full((1, 64), 60000, np.float16), np.ones((64, 1), np.float16)
    assert half_partials_matmul(*big, 16)[0, 0] == np.float16(65504)  # saturates, as the hardware's conversions do


def test_matmul_codelet_with_group_is_the_reference_and_without_is_float():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 9, 96)).astype(np.float16)  # a stack of 4 vertices
    w = (rng.standard_normal((4, 96, 12)) / 8).astype(np.float16)
    out = np.zeros((4, 9, 12), np.float16)
    codelet("matmul").run([x, w, out], np.array([[0, 16]] * 4))
    assert all(np.array_equal(out[i], half_partials_matmul(x[i], w[i], 16)) for i in range(4))
    codelet("matmul").run([x, w, out], np.array([[0]] * 4))  # a Program saved before partials were a choice
    assert np.array_equal(out, np.matmul(x.astype(np.float32), w.astype(np.float32)).astype(np.float16))


def test_reduce_in_half_sums_the_parts_in_part_order():
    """Each owner's own part sits at its index among the received ones: the sum is part 0 + part 1 + ... rounded
    after every add, whichever part the vertex owns."""
    rng = np.random.default_rng(3)
    pk, m, n = 4, 3, 5
    parts = (rng.standard_normal((pk, m, n)) * 300).astype(np.float16)
    want = parts[0].astype(np.float32)
    for q in range(1, pk):
        want = (want + parts[q].astype(np.float32)).astype(np.float16).astype(np.float32)
    for mine in range(pk):
        recv = np.concatenate([parts[q] for q in range(pk) if q != mine])
        out = np.zeros((m, n), np.float16)
        codelet("reduce_partials").run([parts[mine], recv, out], (pk, 0, 1, mine))
        assert np.array_equal(out, want.astype(np.float16)), mine


def test_reduce_in_half_on_a_stack_of_vertices_owning_different_parts():
    """A stack of vertices, each owning another part, with sums that saturate: each vertex's parts in part order."""
    rng = np.random.default_rng(4)
    nv, pk, m, n = 7, 5, 2, 9
    parts = (rng.standard_normal((nv, pk, m, n)) * 3e4).astype(np.float16)
    mine = np.arange(nv) % pk
    own = np.stack([parts[v, mine[v]] for v in range(nv)])
    recv = np.stack([np.concatenate([parts[v, q] for q in range(pk) if q != mine[v]]) for v in range(nv)])
    out = np.zeros((nv, m, n), np.float16)
    params = np.array([(pk, 0, 1, mine[v]) for v in range(nv)], np.int64)
    codelet("reduce_partials").run([own, recv, out], params)
    for v in range(nv):
        want = parts[v, 0].astype(np.float32)
        for q in range(1, pk):
            want = np.clip(want + parts[v, q].astype(np.float32), -65504, 65504).astype(np.float16).astype(np.float32)
        assert np.array_equal(out[v], want.astype(np.float16)), v


def _round_by_definition(v):
    """The rounding as first written (abs, clip, binade, add/sub 2**13 x binade, copysign): the bits to match."""
    v = v.copy()
    a = np.minimum(np.abs(v), np.float32(65504))
    m = np.maximum((a.view(np.uint32) & np.uint32(0x7F800000)).view(np.float32), np.float32(2.0**-14))
    m *= np.float32(2.0**13)
    return np.copysign((a + m) - m, v)


def test_saturate_round_half_is_the_definition_on_random_bits_and_edges():
    """(A one-off run compared all 2**32 float32 patterns.)"""
    from tremula.numerics.amp import saturate_round_half

    rng = np.random.default_rng(4)
    bits = rng.integers(0, 1 << 32, 1 << 22, dtype=np.uint64).astype(np.uint32)
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h = np.sort(h[np.isfinite(h)].astype(np.float32))
    mid = ((h[1:].astype(np.float64) + h[:-1]) / 2).astype(np.float32)  # the ties between neighbouring halves
    edges = np.array([np.nan, -np.nan, np.inf, -np.inf, 65504, -65504, 65519.99, -65519.99, 65520, -65520, 0.0, -0.0,
                      2.0**-14, -(2.0**-14), 2.0**-24, -(2.0**-24), 2.0**-25, -(2.0**-25), 1.5 * 2.0**-25, 1e-40,
                      -1e-40, 3e38, -3e38], np.float32)
    with np.errstate(invalid="ignore", under="ignore"):  # (NaN arithmetic, tiny products: expected)
        x = np.concatenate([bits.view(np.float32), h, mid, np.nextafter(mid, np.float32(np.inf)),
                            np.nextafter(mid, np.float32(-np.inf)), edges, (bits.view(np.float32) * 1e-30)])
        want = _round_by_definition(x)
    with np.errstate(invalid="ignore"):  # (signalling NaNs among the random bits)
        got = saturate_round_half(x.copy())
    assert got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()


def test_half_conversions_are_numpys_casts():
    """from_half on every half, to_half on every half value and quiet NaN payloads: NumPy's bits."""
    from tremula.numerics.amp import from_half, to_half

    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    f = h.astype(np.float32)
    finite = np.isfinite(h)
    assert from_half(h).view(np.uint32).tobytes() == f.view(np.uint32).tobytes()  # (inf/NaN: NumPy's cast)
    big = np.tile(h[finite], 3).reshape(3, 1, -1)  # several chunks, the fast path
    assert from_half(big).view(np.uint32).tobytes() == big.astype(np.float32).view(np.uint32).tobytes()
    rng = np.random.default_rng(5)
    nans = (rng.integers(0, 1 << 32, 4096, dtype=np.uint64).astype(np.uint32) | np.uint32(0x7FC00000)).view(np.float32)
    v = np.concatenate([f[finite], nans, np.float32([np.inf, -np.inf])])
    out = np.empty(v.shape, np.float16)
    assert to_half(v, out) is out and out.view(np.uint16).tobytes() == v.astype(np.float16).view(np.uint16).tobytes()


def test_scaled_add_and_round_is_numpys_passes(kernels):
    """acc = round(acc + p x scale) with one scale, one per entry and none: the FP8 AMP's step (a power of two
    scale) and the split-K sums' (none), on random magnitudes from tiny to past half's range, NaN and inf."""
    from tremula.numerics.amp import half_partial_sums, saturate_round_half

    rng = np.random.default_rng(6)
    acc = (rng.standard_normal((6, 7, 50)) * 10.0 ** rng.uniform(-9, 6, (6, 7, 50))).astype(np.float32)
    p = (rng.standard_normal(acc.shape) * 10.0 ** rng.uniform(-9, 6, acc.shape)).astype(np.float32)
    acc.reshape(-1)[:6] = [np.nan, np.inf, -np.inf, -0.0, 65504, -65520]
    for scale in (None, np.float32(0.125), (2.0 ** rng.integers(-6, 6, (6, 1, 1))).astype(np.float32)):
        want = acc + (p if scale is None else p * scale)
        with np.errstate(invalid="ignore"):
            jit_enabled, jit.ENABLED = jit.ENABLED, False
            saturate_round_half(want)
            jit.ENABLED = jit_enabled
            got = acc.copy()
            assert jit.add_round_half(got, p, scale) == kernels
        if kernels:
            assert got.view(np.uint32).tobytes() == want.view(np.uint32).tobytes()
    x = rng.standard_normal((3, 5, 64)).astype(np.float32)
    w = rng.standard_normal((3, 64, 4)).astype(np.float32)
    sc = np.float32([[[0.5]], [[4.0]], [[2.0 ** -20]]])
    got = half_partial_sums(x, w, 16, sc)
    want = np.zeros_like(got)
    for k0 in range(0, 64, 16):
        want = (want + (x[..., k0:k0 + 16] @ w[..., k0:k0 + 16, :]) * sc).astype(np.float16).astype(np.float32)
    assert got.tobytes() == want.tobytes()


def test_cast_to_half_is_numpys_cast(kernels):
    """amp.as_half / amp.store (the codelets' float32 -> half stores): NumPy's astype bits on random float32 patterns
    (quiet NaNs only: a signalling one comes out quiet), the ties between halves, overflow to inf and the subnormals."""
    from tremula.numerics.amp import as_half, store

    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    nan = (bits & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    bits[nan] |= np.uint32(0x00400000)  # quiet
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h = np.sort(h[np.isfinite(h)].astype(np.float32))
    mid = ((h[1:].astype(np.float64) + h[:-1]) / 2).astype(np.float32)
    edges = np.float32([65504, 65519.99, 65520, -65520, 1e9, -np.inf, 2.0**-25, -(2.0**-25), 1.5 * 2.0**-24, -0.0])
    v = np.concatenate([bits.view(np.float32), h, mid, np.nextafter(mid, np.float32(np.inf)), edges]).reshape(2, -1)
    with np.errstate(over="ignore", invalid="ignore"):
        want = v.astype(np.float16)
        got = as_half(v)
        out = np.empty_like(want)
        store(out, v)
    assert got.dtype == np.float16 and got.view(np.uint16).tobytes() == want.view(np.uint16).tobytes()
    assert out.view(np.uint16).tobytes() == want.view(np.uint16).tobytes()


def test_fp8_decode_and_nearest_quantize_are_table_lookups():
    """FP8 codes decode to ml_dtypes' values (every code of both formats, NaN codes to NaN), and nearest quantizing
    is the half-pattern table's entry for each value, on either path."""
    from tremula.numerics.fp8 import _NEAREST, Fp8Format, decode, quantize

    codes = np.arange(256, dtype=np.uint8).reshape(16, 16)
    x = np.random.default_rng(7).standard_normal((33, 65)).astype(np.float32) * 40
    for fmt in Fp8Format:
        want = codes.view(fmt.np_dtype).astype(np.float32)
        got = decode(codes, fmt)
        assert got.dtype == np.float32 and got.shape == codes.shape
        assert np.array_equal(got, want, equal_nan=True)
        bits = x.astype(np.float16).view(np.uint16)
        assert np.array_equal(quantize(x, fmt, 0), np.take(_NEAREST[fmt], bits))

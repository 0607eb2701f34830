"""Attention with half partials (numerics/attention.py): QK and PV rounded to half after every group, the softmax in
half with a float32 row sum, the same in the reference rule and the codelets; float partials as before."""

import numpy as np
import pytest

from tremula.codelets import codelet, f2i
from tremula.codelets.attention import scores_dtype
from tremula.ir.ops import _softmax
from tremula.numerics.amp import half_partials_matmul
from tremula.numerics.attention import attention, causal_allowed, probabilities, scores

F16, F32 = np.float16, np.float32


def _by_halves(q, k, v, scale, mask, group):
    """The definition in half arrays, one head: every rounding an astype to float16."""
    s = half_partials_matmul(q, k.T, group)
    s = (s.astype(F32) * F32(scale)).astype(F16)
    if mask is not None:
        s = (s.astype(F32) + mask.astype(F32)).astype(F16)
    e = np.exp(s.astype(F32) - s.max(-1, keepdims=True).astype(F32)).astype(F16)
    total = e.astype(F32).sum(-1, keepdims=True)
    p = (e.astype(F32) * (F32(1) / total)).astype(F16)
    return half_partials_matmul(p, v, group)


def _head(rng, sq=13, sk=40, d=24, dv=20):
    q = rng.standard_normal((sq, d)).astype(F16)
    k = rng.standard_normal((sk, d)).astype(F16)
    v = rng.standard_normal((sk, dv)).astype(F16)
    mask = np.where(rng.random((1, sk)) < 0.2, -65504, 0).astype(F16)
    return q, k, v, mask


@pytest.mark.parametrize("masked", [False, True])
def test_half_attention_is_the_definition_in_half_arrays(masked):
    q, k, v, mask = _head(np.random.default_rng(3))
    m = mask if masked else None
    got = attention(q, k, v, 0.2, m, group=16)
    assert got.dtype == F16 and got.tobytes() == _by_halves(q, k, v, 0.2, m, 16).tobytes()
    assert (got != attention(q, k, v, 0.2, m)).any()  # float partials round once: some element differs


def test_float_partials_are_the_float32_attention():
    q, k, v, mask = _head(np.random.default_rng(4))
    s = q.astype(F32) @ k.astype(F32).T * F32(0.2) + mask.astype(F32)
    want = (_softmax(s, -1) @ v.astype(F32)).astype(F16)
    assert attention(q, k, v, 0.2, mask).tobytes() == want.tobytes()


def test_a_row_with_every_key_disallowed_gives_zeros_on_both_paths():
    q, k, v, _ = _head(np.random.default_rng(5), sq=4, sk=6)
    allowed = causal_allowed(4, 6)
    allowed[2] = False
    for group in (0, 16):
        out = attention(q, k, v, 0.5, None, allowed, group)
        assert np.isfinite(out).all() and not out[2].any()


def test_the_codelet_on_a_stack_is_the_rule_per_vertex():
    rng = np.random.default_rng(6)
    heads = [_head(rng) for _ in range(3)]
    q, k, v, mask = (np.stack(x) for x in zip(*heads))
    for group in (0, 16):
        out = np.zeros((3, 13, 20), F16)
        held = np.zeros((3, 13, 40), scores_dtype(group))
        params = np.array([[1, 0, 0, 13, 40, f2i(0.2), group]] * 3)
        codelet("attention").run([q, k, v, mask, held, out], params)
        for i, (qi, ki, vi, mi) in enumerate(heads):
            assert out[i].tobytes() == attention(qi, ki, vi, 0.2, mi, group=group).tobytes(), (group, i)
            # the scores operand is left holding p, in the dtype the tile holds the scores in
            s = scores(qi, ki, 0.2, mi, group=group)
            assert held[i].tobytes() == probabilities(s, bool(group)).astype(held.dtype).tobytes(), (group, i)


def test_half_partials_price_attention_lower_on_the_c600():
    from tremula.target.chip import load_chip

    c600, cl = load_chip("c600"), codelet("attention")
    shapes = [(14, 64), (197, 64), (197, 64), (14, 64)]
    dtypes = ["float16"] * 4
    half = cl.cycles(c600, (0, 0, 0, 14, 197, 0, 16), shapes, dtypes)
    full = cl.cycles(c600, (0, 0, 0, 14, 197, 0, 0), shapes, dtypes)
    assert half < 0.6 * full  # both products at twice the MACs, the softmax's passes on half vectors


@pytest.mark.parametrize("group,vec", [(16, "float16"), (0, "float32")])
def test_a_key_block_is_priced_without_the_softmax_normalisation(group, vec):
    """attention_partial leaves p unnormalised (the combine divides by the total sum): its price is the whole
    attention's on the same shapes less the per-row reciprocal and the multiply over the scores."""
    from tremula.target import cost_terms
    from tremula.target.chip import load_chip

    c600 = load_chip("c600")
    shapes, dtypes = [(40, 64), (66, 64), (66, 64), (40, 66), (40, 64)], ["float16"] * 5
    whole = codelet("attention").cycles(c600, (0, 0, 0, 197, 197, 0, group), shapes, dtypes)
    block = codelet("attention_partial").cycles(c600, (0, 0, 0, 197, 197, 0, 0, group), shapes + [(40, 2)],
                                                dtypes + ["float32"])
    normalise = cost_terms.vector_cycles(c600, "divide", 40, "float32") + cost_terms.vector_cycles(c600, "mul",
                                                                                                   40 * 66, vec)
    assert normalise > 0 and block == whole - normalise


def test_softmax_in_blocks_of_rows_is_the_whole_array_formula():
    """A big softmax over the last axis runs on blocks of whole rows (numerics/attention.CHUNK): each row alone either
    way, so the bits of the formula on the whole array, masked rows (all -inf: zeros) and half input included."""
    from tremula.numerics import attention as att

    rng = np.random.default_rng(5)
    for dt in (np.float16, np.float32, np.float64):
        x = (rng.standard_normal((3, 301, 517)) * 6).astype(dt)
        x[1, 7] = -np.inf
        acc = x.astype(np.float32) if dt == np.float16 else x
        top = np.max(acc, axis=-1, keepdims=True)
        e = np.exp(acc - np.where(np.isfinite(top), top, 0))
        total = np.sum(e, axis=-1, keepdims=True)
        whole = e / np.where(total == 0, 1, total)
        assert x.size > att.CHUNK
        got = att.softmax(x)
        assert got.dtype == whole.dtype and np.array_equal(got.view(np.uint8), whole.view(np.uint8))
        assert not got[1, 7].any()


@pytest.mark.parametrize("dtype,group,masked", [(F32, 0, "mask"), (F16, 16, "mask"), (F32, 0, "causal"),
                                                (F16, 16, None)])
def test_a_big_stack_in_chunks_of_matrices_is_the_whole_stack(monkeypatch, dtype, group, masked):
    """Above SCORES_CHUNK attention runs a few whole matrices at a time (down to one, through a 4-D stack's first
    two axes): the same bits as the whole stack at once, mask broadcast per chunk."""
    import tremula.numerics.attention as na

    rng = np.random.default_rng(3)
    for batch in (3, 1):  # (batch 1: the heads of its one entry are chunked)
        shape = (batch, 5, 17, 8)
        q, k, v = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
        mask = (3 * rng.standard_normal((batch, 1, 1, 17))).astype(dtype) if masked == "mask" else None
        allowed = causal_allowed(17, 17) if masked == "causal" else None
        monkeypatch.setattr(na, "SCORES_CHUNK", 1 << 20)
        whole = attention(q, k, v, 0.3, mask, allowed, group)
        for chunk in (17 * 17 * 5 * 2, 17 * 17 * 2, 1):  # two entries of the first axis; two matrices; one matrix
            monkeypatch.setattr(na, "SCORES_CHUNK", chunk)
            part = attention(q, k, v, 0.3, mask, allowed, group)
            assert part.dtype == whole.dtype and part.shape == whole.shape
            assert np.array_equal(part.view(np.uint8), whole.view(np.uint8))


def _blocks(rng, nb=5, r=7, dv=12):
    """Key blocks' partials as attention_partial leaves them: p @ v in half, row max and row sum in float32."""
    pvs = [rng.standard_normal((r, dv)).astype(F16).astype(F32) * F32(4) for _ in range(nb)]
    tops = [rng.standard_normal((r, 1)).astype(F32) * F32(3) for _ in range(nb)]
    sums = [rng.uniform(1, 30, (r, 1)).astype(F32) for _ in range(nb)]
    return pvs, tops, sums


def test_half_combine_is_the_definition_in_half_arrays():
    """With half partials the blocks' values combine in half (every product and running sum an astype to float16),
    the weights and row sums in float32; the float path is the float32 formula."""
    from tremula.numerics.attention import combine_blocks

    rng = np.random.default_rng(3)
    pvs, tops, sums = _blocks(rng)
    top = np.max(tops, axis=0)
    w = [np.exp(t - top).astype(F32) for t in tops]
    den = w[0] * sums[0]
    for b in range(1, len(w)):
        den = den + w[b] * sums[b]
    num = w[0].astype(F16) * pvs[0].astype(F16)
    for b in range(1, len(w)):
        num = num + w[b].astype(F16) * pvs[b].astype(F16)
    want = (num.astype(F32) * (F32(1) / den)).astype(F16)
    got = combine_blocks(pvs, tops, sums, half=True).astype(F16)
    np.testing.assert_array_equal(got, want)
    f = sum(wb * p for wb, p in zip(w, pvs)) / den
    np.testing.assert_allclose(combine_blocks(pvs, tops, sums, half=False), f, rtol=1e-6)
    assert not np.array_equal(got, f.astype(F16))  # the half path rounds where the float one does not


def test_the_half_combine_is_priced_below_the_float_one():
    c = codelet("attention_combine")
    from tremula.target.chip import load_chip

    chip = load_chip("c600")
    shapes = [(37, 72)] * 5 + [(37, 2)] * 5 + [(37, 72)]
    dts = ("float16",) * 5 + ("float32",) * 5 + ("float16",)
    half, flt = c.cycles(chip, np.array([5, 16]), shapes, dts), c.cycles(chip, np.array([5, 0]), shapes, dts)
    assert half < 0.7 * flt

"""Half partials (numerics/amp.py): the running sum rounded to half after every group of K, in the reference and the
codelets alike, and a split-K sum in half in part order."""

import numpy as np
import pytest

from tremula.codelets import codelet
from tremula.numerics.amp import half_partials_matmul


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


def test_one_group_is_one_rounding_and_overflow_saturates():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((5, 16)).astype(np.float16), rng.standard_normal((16, 3)).astype(np.float16)
    assert np.array_equal(half_partials_matmul(x, w, 16), (x.astype(np.float32) @ w.astype(np.float32)).astype(np.float16))
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

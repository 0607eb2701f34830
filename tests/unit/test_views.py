"""passes/views.py: a View carried through random chains of moves maps every element where NumPy's ops put it, and
two Views are `same` exactly when their index arrays are equal."""

from __future__ import annotations

import numpy as np
import pytest

from tremula.passes.views import View, coalesce


def materialise(v: View) -> np.ndarray:
    """The flat source index of every element of the View (an index array, for the comparison only)."""
    out = np.full(v.shape, v.offset, np.int64)
    for axis, modes in enumerate(v.dims):
        idx = np.zeros(v.shape[axis], np.int64)
        rest = np.arange(v.shape[axis])
        for size, stride in reversed(modes):
            idx += (rest % size) * stride
            rest //= size
        shape = [1] * len(v.shape)
        shape[axis] = v.shape[axis]
        out += idx.reshape(shape)
    return out


def _factor_shape(rng, n: int) -> tuple[int, ...]:
    """A random shape of n elements (its dims products of n's prime factors, in random groups)."""
    primes, m, p = [], n, 2
    while m > 1:
        while m % p == 0:
            primes.append(p)
            m //= p
        p += 1
    rng.shuffle(primes)
    dims, k = [], 0
    while k < len(primes):
        take = int(rng.integers(1, 3))
        dims.append(int(np.prod(primes[k:k + take])))
        k += take
    if rng.random() < 0.3:
        dims.insert(int(rng.integers(0, len(dims) + 1)), 1)
    return tuple(dims) or (1,)


def _step(rng, v: View, a: np.ndarray):
    """One random move on both: (View or None, the array)."""
    kind = rng.choice(["reshape", "transpose", "take", "slice"])
    if kind == "reshape":
        shape = _factor_shape(rng, a.size)
        return v.reshape(shape), a.reshape(shape)
    if kind == "transpose":
        perm = tuple(int(p) for p in rng.permutation(a.ndim))
        return v.transpose(perm), np.transpose(a, perm)
    axis = int(rng.integers(0, a.ndim))
    n = a.shape[axis]
    if kind == "take" and a.ndim > 1:
        i = int(rng.integers(0, n))
        return v.take(axis, i), np.take(a, i, axis=axis)
    start = int(rng.integers(0, n))
    length = int(rng.integers(1, n - start + 1))
    step = 1 if length * 2 > n - start else int(rng.integers(1, 3))
    length = len(range(start, min(n, start + length * step), step))
    sl = [slice(None)] * a.ndim
    sl[axis] = slice(start, start + length * step, step) if step > 1 else slice(start, start + length)
    return v.slice(axis, start, length, step), a[tuple(sl)]


@pytest.mark.parametrize("seed", range(60))
def test_random_chains_map_like_numpy(seed):
    rng = np.random.default_rng(seed)
    shape = _factor_shape(rng, int(rng.choice([24, 36, 48, 60, 64, 72, 96, 120])))
    a = np.arange(int(np.prod(shape))).reshape(shape)
    v: View | None = View.of(shape)
    for _ in range(6):
        v, a = _step(rng, v, a)
        if v is None:  # a move the View cannot express: the caller leaves such chains alone
            return
        assert v.shape == a.shape
        np.testing.assert_array_equal(materialise(v), a)


@pytest.mark.parametrize("seed", range(20))
def test_same_is_equality_of_the_maps(seed):
    rng = np.random.default_rng(seed)
    views = []
    for _ in range(30):
        shape = (2, 3, 4)
        v: View | None = View.of((4, 6)).reshape((2, 2, 6))
        v = v.transpose(tuple(int(p) for p in rng.permutation(3)))
        v = v.reshape(_factor_shape(rng, 24)) if rng.random() < 0.5 else v
        if v is not None:
            v = v.reshape(shape)
        if v is not None:
            views.append(v)
    for x in views:
        for y in views:
            assert x.same(y) == np.array_equal(materialise(x), materialise(y))


def test_coalesce_merges_what_steps_as_one_and_drops_ones():
    assert coalesce([(2, 12), (1, 5), (3, 4), (4, 1)]) == ((24, 1),)
    assert coalesce([(2, 4), (3, 1)]) == ((2, 4), (3, 1))  # a gap: two modes
    assert View.of((2, 3)).transpose((1, 0)).flat() == (0, ((3, 1), (2, 3)))


def test_a_mode_split_by_a_size_that_does_not_divide_it_is_refused():
    v = View.of((6, 4)).transpose((1, 0))  # [4, 6], strides 1 and 4
    assert v.reshape((3, 8)) is None  # 8 = 6 x 4/3: not a whole part of one mode
    assert v.reshape((2, 12)) is not None


@pytest.mark.parametrize("seed", range(20))
def test_the_slice_index_map_is_the_reference_on_the_input_map(seed):
    """ir/ops.slice_index_map, which the planner's Slice reads (a map of the output's size), equals Slice's reference
    applied to np.arange(size).reshape(shape), for random shapes, axes, negative and clamped bounds and steps."""
    from tremula.ir.ops import rule, slice_index_map

    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in rng.integers(1, 6, rng.integers(1, 5)))
    axes = [int(a) for a in rng.permutation(len(shape))[: rng.integers(1, len(shape) + 1)]]
    attrs = {"starts": [], "ends": [], "axes": [a - len(shape) if rng.random() < 0.3 else a for a in axes],
             "steps": []}
    for a in axes:
        d, step = shape[a], int(rng.choice([1, 1, 2, -1, -2]))
        attrs["starts"].append(int(rng.integers(-d - 2, d + 2)))
        attrs["ends"].append(int(rng.choice([rng.integers(-d - 2, d + 2), 2**62, -2**62])))
        attrs["steps"].append(step)
    ref = rule("Slice").ref([np.arange(int(np.prod(shape))).reshape(shape)], attrs)[0]
    got = slice_index_map(shape, attrs)
    assert got.shape == ref.shape
    np.testing.assert_array_equal(got, ref)

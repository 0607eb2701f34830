"""The simulator's compiled byte moves (sim/moves.py) against plain slicing: rows at every alignment and length,
gathered, scattered, marked and checked in the written map, and an exchange's rows copied to each destination."""

from __future__ import annotations

import numpy as np
import pytest

from tremula.numerics import jit
from tremula.sim import moves

pytestmark = pytest.mark.skipif(jit.numba is None, reason="numba is not installed (pip install tremula[fast]): the "
                                "compiled moves are not there to test")

SIZE = 4096


def _disjoint_rows(rng, n: int, length: int, size: int = SIZE) -> np.ndarray:
    """n starts of non-overlapping rows of `length` bytes at random alignments in [0, size)."""
    slots = rng.choice(size // (length + 8), n, replace=False)
    return np.sort(slots * (length + 8) + rng.integers(0, 8, n)).astype(np.int64)


@pytest.mark.parametrize("length", [1, 2, 3, 4, 6, 8, 12, 16, 17, 40, 64])
def test_gather_and_scatter_are_slices_at_every_alignment(length):
    rng = np.random.default_rng(length)
    mem = rng.integers(0, 256, SIZE, dtype=np.uint8)
    starts = _disjoint_rows(rng, 20, length)
    got = moves.gather(mem, starts, length)
    assert np.array_equal(got, np.stack([mem[s: s + length] for s in starts]))
    data = rng.integers(0, 256, (len(starts), length), dtype=np.uint8)
    want = mem.copy()
    for s, row in zip(starts, data):
        want[s: s + length] = row
    wmap = np.zeros(SIZE // 8, np.uint8)
    moves.scatter(mem, wmap, starts, data)
    assert np.array_equal(mem, want)
    bits = np.unpackbits(wmap, bitorder="little").astype(bool)
    marked = np.zeros(SIZE, bool)
    for s in starts:
        marked[s: s + length] = True
    assert np.array_equal(bits, marked)


def test_unwritten_names_the_first_clear_byte_of_the_first_failing_row():
    rng = np.random.default_rng(3)
    wmap = np.zeros(SIZE // 8, np.uint8)
    ref = np.zeros(SIZE, bool)
    for _ in range(200):
        length = int(rng.integers(1, 50))
        starts = rng.integers(0, SIZE - length, 3)
        moves.mark(wmap, starts, length)
        for s in starts:
            ref[s: s + length] = True
        q = rng.integers(0, SIZE - length, 4)
        bad = [(i, int(np.argmin(ref[s: s + length]))) for i, s in enumerate(q) if not ref[s: s + length].all()]
        assert moves.unwritten(wmap, q, length) == (bad[0] if bad else None)


def test_unwritten_and_mark_take_a_length_per_row():
    rng = np.random.default_rng(4)
    wmap = np.zeros(SIZE // 8, np.uint8)
    ref = np.zeros(SIZE, bool)
    for _ in range(100):
        starts = rng.integers(0, SIZE - 60, 3)
        lens = rng.integers(0, 60, 3)
        moves.mark(wmap, starts, lens)
        for s, n in zip(starts, lens):
            ref[s: s + n] = True
        q, ql = rng.integers(0, SIZE - 60, 4), rng.integers(0, 60, 4)
        bad = [(i, int(np.argmin(ref[s: s + n]))) for i, (s, n) in enumerate(zip(q, ql)) if not ref[s: s + n].all()]
        assert moves.unwritten(wmap, q, ql) == (bad[0] if bad else None)
    assert np.array_equal(np.unpackbits(wmap, bitorder="little").astype(bool), ref)


def test_exchange_copies_every_row_to_each_destination():
    rng = np.random.default_rng(5)
    mem = rng.integers(0, 256, 2 * SIZE, dtype=np.uint8)
    # three transfers from the first half to the second: 1, 2 and 3 destinations, rows of odd lengths and strides
    rows, row_bytes, s_stride = np.array([3, 2, 4]), np.array([5, 16, 7]), np.array([9, 16, 11])
    s0 = np.array([1, 100, 203])
    dst_start = np.array([0, 1, 3, 6])
    d0 = SIZE + np.array([3, 500, 800, 1201, 1600, 2001])
    d_stride = np.array([6, 24, 16, 7, 9, 8])
    want = mem.copy()
    for t in range(3):
        for r in range(rows[t]):
            src = mem[s0[t] + r * s_stride[t]:][: row_bytes[t]]
            for k in range(dst_start[t], dst_start[t + 1]):
                want[d0[k] + r * d_stride[k]:][: row_bytes[t]] = src
    moves.exchange(mem, s0, s_stride, row_bytes, rows, dst_start, d0, d_stride)
    assert np.array_equal(mem, want)


@pytest.mark.parametrize("dtype,rows,cols",
                         [(np.uint8, 3, 5), (np.float16, 2, 7), (np.float32, 4, 3), (np.float32, 1, 1)])
def test_blocks_of_a_constant_are_its_slices_written_row_after_row(dtype, rows, cols):
    rng = np.random.default_rng(rows * 10 + cols)
    src = rng.integers(0, 100, (9, 11)).astype(dtype)
    n = 6
    r0, c0 = rng.integers(0, 9 - rows + 1, n), rng.integers(0, 11 - cols + 1, n)
    nbytes = rows * cols * src.itemsize
    starts = _disjoint_rows(rng, n, nbytes)
    mem = rng.integers(0, 256, SIZE, dtype=np.uint8)
    want = mem.copy()
    for s, r, c in zip(starts, r0, c0):
        want[s: s + nbytes] = np.ascontiguousarray(src[r: r + rows, c: c + cols]).reshape(-1).view(np.uint8)
    wmap = np.zeros(SIZE // 8, np.uint8)
    moves.blocks(mem, wmap, starts, src, r0, c0, rows, cols)
    assert np.array_equal(mem, want)
    marked = np.zeros(SIZE, bool)
    for s in starts:
        marked[s: s + nbytes] = True
    assert np.array_equal(np.unpackbits(wmap, bitorder="little").astype(bool), marked)

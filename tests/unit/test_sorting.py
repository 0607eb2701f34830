"""sorting.py: the packed lexicographic order is np.lexsort's, the distinct rows np.unique(axis=0)'s, on random integer
columns of every width (constant, negative, too wide to pack) and on empty ones."""

import numpy as np

from tremula.sorting import lex_order, positions_in_runs, stable_argsort, unique_rows


def test_lex_order_is_numpys_lexsort():
    rng = np.random.default_rng(1)
    for _ in range(300):
        n, m = int(rng.integers(0, 50)), int(rng.integers(1, 6))
        keys = [rng.integers(-(1 << int(rng.integers(0, 40))), 1 << int(rng.integers(0, 40)), n) for _ in range(m)]
        assert np.array_equal(lex_order(keys), np.lexsort(keys))
    wide = [np.array([3, 1 << 62, -(1 << 62), 0]), np.array([1, 0, 1, 0])]  # past 62 bits: np.lexsort itself
    assert np.array_equal(lex_order(wide), np.lexsort(wide))
    # keys that fill a word with no room for the index beside them: one word each, sorted in passes
    full = [rng.integers(0, 1 << 40, 3000), rng.integers(0, 4, 3000), rng.integers(0, 1 << 45, 3000)]
    assert np.array_equal(lex_order(full), np.lexsort(full))


def test_stable_argsort_is_numpys_stable_argsort():
    rng = np.random.default_rng(3)
    for _ in range(300):
        n, bits = int(rng.integers(0, 80)), int(rng.integers(0, 63))
        key = rng.integers(-(1 << bits), 1 << bits, n) if bits else np.zeros(n, np.int64)
        if n and rng.integers(0, 2):
            key = key[rng.integers(0, n, n)]  # many ties
        assert np.array_equal(stable_argsort(key), np.argsort(key, kind="stable"))
    assert np.array_equal(stable_argsort(np.array([5, 5, 5], np.int32)), [0, 1, 2])


def test_unique_rows_is_numpys_unique_over_rows():
    rng = np.random.default_rng(2)
    for _ in range(300):
        a = rng.integers(-3, int(rng.integers(1, 9)), (int(rng.integers(0, 60)), int(rng.integers(1, 7))))
        u1, i1 = np.unique(a, axis=0, return_inverse=True)
        u2, i2 = unique_rows(a)
        assert u1.shape == u2.shape and np.array_equal(u1, u2) and np.array_equal(i1.reshape(-1), i2)


def test_positions_in_runs():
    assert positions_in_runs([2, 0, 3, 1]).tolist() == [0, 1, 0, 1, 2, 0]
    assert positions_in_runs([]).tolist() == []

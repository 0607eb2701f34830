"""sorting.py: the packed lexicographic order is np.lexsort's, the distinct rows np.unique(axis=0)'s, on random integer
columns of every width (constant, negative, too wide to pack) and on empty ones."""

import numpy as np

from tremula.sorting import lex_order, positions_in_runs, unique_rows


def test_lex_order_is_numpys_lexsort():
    rng = np.random.default_rng(1)
    for _ in range(300):
        n, m = int(rng.integers(0, 50)), int(rng.integers(1, 6))
        keys = [rng.integers(-(1 << int(rng.integers(0, 40))), 1 << int(rng.integers(0, 40)), n) for _ in range(m)]
        assert np.array_equal(lex_order(keys), np.lexsort(keys))
    wide = [np.array([3, 1 << 62, -(1 << 62), 0]), np.array([1, 0, 1, 0])]  # past 62 bits: np.lexsort itself
    assert np.array_equal(lex_order(wide), np.lexsort(wide))


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

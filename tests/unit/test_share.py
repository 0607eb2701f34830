"""Pure pieces of layer code sharing: row-major rectangles, spread storage caps, folded first fit (layers:
test_find_layers.py)."""

import numpy as np

from tremula.plan.layers import _rects, spread_caps
from tremula.plan.memory import align, fold_fit


def test_rects_cover_a_row_major_range_exactly_once():
    rng = np.random.default_rng(0)
    for _ in range(300):
        cols = int(rng.integers(1, 9))
        n = cols * int(rng.integers(1, 9))
        a = int(rng.integers(0, n))
        b = int(rng.integers(a + 1, n + 1))
        hit = np.zeros(n, int)
        rects = _rects(a, b, cols)
        assert 1 <= len(rects) <= 3
        for r0, r1, c0, c1 in rects:
            assert r1 > r0 and c1 > c0
            idx = (np.arange(r0, r1)[:, None] * cols + np.arange(c0, c1)[None, :]).reshape(-1)
            hit[idx] += 1
            # each rectangle is one contiguous byte run of the row-major block (a single transfer)
            assert np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx)))
        assert (hit[a:b] == 1).all() and hit[:a].sum() == 0 and hit[b:].sum() == 0


def test_spread_caps_level_the_tiles_a_run_stores_on():
    """A run's per-layer storage caps: even shares (the layer's bytes over the tiles, aligned) unless levelled, and
    levelled over tiles that hold nothing yet too; over uneven tiles levelling water-fills, so that no tile ends above
    the level the run's bytes reach (but for alignment), tiles above it store nothing, and the caps hold the layer."""
    assert (spread_caps(np.zeros(10, np.int64), 1001, 12, level=True) == align(101)).all()
    assert (spread_caps(np.full(4, 640), 64, 3, level=True) == 16).all()
    rng = np.random.default_rng(2)
    for _ in range(300):
        t, layers = int(rng.integers(1, 40)), int(rng.integers(1, 30))
        before = rng.integers(0, 5000, t) * (rng.random(t) < 0.5)
        layer = int(rng.integers(1, 20000))
        caps = spread_caps(before, layer, layers, level=True)
        assert (spread_caps(before, layer, layers) == align(-(-layer // t))).all()  # unlevelled: even shares
        assert caps.sum() >= layer and (caps >= 0).all() and (caps % align(1) == 0).all()
        after = before + layers * caps
        level = after[caps > 0].min() if (caps > 0).any() else after.min()
        assert after[caps > 0].max() <= level + layers * 2 * align(1)  # the stored-on tiles end level ...
        assert (before[caps == 0] >= level - layers * align(1)).all()  # ... and the others were at it already
    # BERT-base's word-embedding table on 768 of 1,472 tiles: its tiles store less of each layer
    before = np.zeros(1472, np.int64)
    before[:768] = 61_044
    caps = spread_caps(before, 14_175_744, 12, level=True)
    assert caps[:768].max() < caps[768:].min() and (before + 12 * caps).max() - (before + 12 * caps).min() < 200


def test_fold_fit_separates_classes_live_at_the_same_folded_moment():
    rng = np.random.default_rng(1)
    for _ in range(50):
        n, period = int(rng.integers(2, 30)), int(rng.integers(2, 20))
        occ = rng.random((n, period)) < 0.25
        sizes = rng.integers(1, 100, n) * 8
        off = fold_fit(sizes, occ)
        for i in range(n):
            for j in range(i + 1, n):
                if (occ[i] & occ[j]).any():
                    assert off[i] + sizes[i] <= off[j] or off[j] + sizes[j] <= off[i]


def test_fold_fit_reuses_bytes_of_classes_never_live_together():
    occ = np.array([[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 1]], bool)
    off = fold_fit(np.array([64, 64, 8]), occ)
    assert off[0] == off[1] == 0  # live in different halves of every layer: one slot
    assert off[2] == 64

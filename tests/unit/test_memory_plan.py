"""Property tests of the memory planner: live buffers never share bytes on a tile, and everything stays in bounds."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tremula.plan.memory import ALIGN, first_fit, plan_memory

TILES = 4


@st.composite
def buffers(draw):
    n = draw(st.integers(1, 30))
    cats, tiles, sizes, first, last = [], [], [], [], []
    for _ in range(n):
        w = draw(st.booleans()) and draw(st.booleans())
        ts = sorted(draw(st.sets(st.integers(0, TILES - 1), min_size=1, max_size=TILES)))
        cats.append("weights" if w else draw(st.sampled_from(["activations", "buffers"])))
        tiles.append(np.array(ts, np.int64))
        sizes.append(np.array([draw(st.integers(1, 300)) for _ in ts], np.int64))
        f = draw(st.integers(-1, 20))
        first.append(-1 if w else f)
        last.append(99 if w else f + draw(st.integers(0, 10)))
    return cats, tiles, sizes, np.array(first), np.array(last)


@settings(max_examples=200, deadline=None)
@given(buffers())
def test_live_buffers_never_overlap(bufs):
    cats, tiles, sizes, first, last = bufs
    reserved = {"code": np.full(TILES, 64, np.int64)}
    mp = plan_memory(cats, tiles, sizes, first, last, TILES, reserved, sram=1 << 20)
    n = len(cats)
    spans = []  # (tile, start, end, first, last)
    for b in range(n):
        addr = mp.resolve(np.full(len(tiles[b]), b), tiles[b])
        assert (addr % ALIGN == 0).all()
        assert (addr >= 0).all()
        for t, a, s in zip(tiles[b], addr, sizes[b]):
            spans.append((int(t), int(a), int(a + s), int(first[b]), int(last[b])))
            assert a + s + 64 <= mp.tile_used[t]  # the usage figure covers the buffer and the reserved bytes
    for i in range(len(spans)):
        for j in range(i + 1, len(spans)):
            t1, a1, e1, f1, l1 = spans[i]
            t2, a2, e2, f2, l2 = spans[j]
            if t1 == t2 and f1 <= l2 and f2 <= l1:
                assert e1 <= a2 or e2 <= a1, (spans[i], spans[j])
    assert mp.fits == (mp.tile_used.max() <= 1 << 20)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 100), st.integers(0, 30), st.integers(0, 10)), min_size=1, max_size=40))
def test_first_fit_reuses_space(items):
    sizes = np.array([s for s, _, _ in items], np.int64)
    first = np.array([f for _, f, _ in items], np.int64)
    last = first + np.array([d for _, _, d in items], np.int64)
    off = first_fit(sizes, first, last)
    # Peak is no more than the sum of sizes, and at least the largest set of simultaneously live buffers.
    t_peak = max(sum(int(sizes[b]) for b in range(len(items)) if first[b] <= t <= last[b]) for t in range(41))
    assert int((off + sizes).max()) >= t_peak
    assert int((off + sizes).max()) <= int(sizes.sum())


def test_does_not_fit_is_reported():
    tiles = [np.array([0, 1])]
    mp = plan_memory(["weights"], tiles, [np.array([900, 100])], np.array([-1]), np.array([9]), 2,
                     {"code": np.zeros(2, np.int64)}, sram=512)
    assert not mp.fits and mp.fullest_tile == 0 and mp.by_category["weights"] == 900


def test_largest_first_packs_tighter_where_start_order_fragments_and_both_stay_valid():
    """A small long-lived buffer placed first by start order sits above a short one and pushes a later large one
    up (peak 6); largest first puts the large one low (peak 4). Either order keeps buffers that meet in time apart,
    on random buffers too (the largest-first order checks every placed buffer, not a list pruned in start order)."""
    sizes, first, last = np.array([1, 2, 3]), np.array([0, 0, 1]), np.array([10, 0, 5])
    assert int((first_fit(sizes, first, last) + sizes).max()) == 6
    assert int((first_fit(sizes, first, last, largest=True) + sizes).max()) == 4
    rng = np.random.default_rng(1)
    for _ in range(50):
        n = 40
        s = rng.integers(1, 50, n)
        f = rng.integers(0, 30, n)
        la = f + rng.integers(0, 10, n)
        for largest in (False, True):
            off = first_fit(s, f, la, largest=largest)
            for i in range(n):
                for j in range(i + 1, n):
                    if f[i] <= la[j] and f[j] <= la[i]:
                        assert off[i] + s[i] <= off[j] or off[j] + s[j] <= off[i]

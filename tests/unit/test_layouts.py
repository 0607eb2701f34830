"""Layouts and the exchange generators: every destination byte gets exactly the source element it asked for."""

import numpy as np
import pytest

from tremula.plan.exchange import gather_elems, gather_rects
from tremula.plan.layout import Layout, block_rel_offsets, blocks, even_cuts, reshape_free, view2d


def grid_layout(rows, cols, rcuts, ccuts, dtype="float32", buf=0):
    nr, nc = len(rcuts) - 1, len(ccuts) - 1
    tiles = np.arange(nr * nc).reshape(nr, nc)
    nbytes = np.outer(np.diff(rcuts), np.diff(ccuts)) * np.dtype(dtype).itemsize
    rel, _ = block_rel_offsets(tiles, nbytes)
    return Layout(rows, cols, dtype, np.array(rcuts), np.array(ccuts), tiles, rel, buf)


def materialise(lay: Layout, x: np.ndarray, size: int = 4096) -> np.ndarray:
    """Tile memory [tiles, size] holding matrix x in layout `lay`."""
    mem = np.zeros((lay.tiles.max() + 1, size), np.uint8)
    r, c = np.meshgrid(np.arange(lay.rows), np.arange(lay.cols), indexing="ij")
    t, a = lay.locate(r.reshape(-1), c.reshape(-1))
    xb = x.astype(lay.dtype).reshape(-1).view(np.uint8).reshape(-1, lay.itemsize)
    for k in range(lay.itemsize):
        mem[t, a + k] = xb[:, k]
    return mem


def apply(tr, mem_src: np.ndarray, mem_dst: np.ndarray) -> None:
    for i in range(len(tr)):
        for j in range(tr.dst_start[i], tr.dst_start[i + 1]):
            for r in range(tr.rows[i]):
                s = tr.src_rel[i] + r * tr.src_stride[i]
                d = tr.d_rel[j] + r * tr.d_stride[j]
                mem_dst[tr.d_tile[j], d: d + tr.row_bytes[i]] = mem_src[tr.src_tile[i], s: s + tr.row_bytes[i]]


def test_even_cuts_and_view2d():
    assert list(even_cuts(10, 3)) == [0, 4, 7, 10]
    assert list(even_cuts(2, 5)) == [0, 1, 2]
    assert view2d((2, 3, 4)) == (6, 4) and view2d(()) == (1, 1) and view2d((7,)) == (1, 7)


def test_locate_is_a_bijection():
    lay = grid_layout(7, 5, [0, 3, 7], [0, 2, 5])
    r, c = np.meshgrid(np.arange(7), np.arange(5), indexing="ij")
    t, a = lay.locate(r.reshape(-1), c.reshape(-1))
    assert len(set(zip(t.tolist(), a.tolist()))) == 35
    assert (a % 4 == 0).all()


def test_reshape_free_keeps_bytes():
    lay = grid_layout(6, 4, [0, 2, 6], [0, 4])
    new = reshape_free(lay, 3, 8)
    assert new is not None and list(new.row_cuts) == [0, 1, 3]
    assert reshape_free(lay, 2, 12) is None  # the block boundary at row 2 (element 8) is not a row of 12
    assert reshape_free(grid_layout(6, 4, [0, 6], [0, 2, 4]), 3, 8) is None  # split columns are not whole rows


@pytest.mark.parametrize("rc,cc", [([0, 3, 7], [0, 2, 5]), ([0, 7], [0, 5]), ([0, 1, 2, 7], [0, 5])])
def test_gather_rects_relayout(rc, cc):
    x = np.arange(35, dtype=np.float32).reshape(7, 5)
    src = grid_layout(7, 5, rc, cc)
    dst = grid_layout(7, 5, [0, 4, 7], [0, 5], buf=1)
    mem = materialise(src, x)
    out = np.zeros((dst.tiles.max() + 1, 4096), np.uint8)
    tl, rel, r0, r1, c0, c1 = blocks(dst)
    tr = gather_rects(src, r0, r1, c0, c1, tl, 1, rel, (c1 - c0) * 4)
    apply(tr, mem, out)
    got = np.array([[out[t, a: a + 4].view(np.float32)[0] for t, a in zip(*dst.locate(np.full(5, i), np.arange(5)))]
                    for i in range(7)])
    np.testing.assert_array_equal(got, x)


def test_gather_rects_multicast():
    src = grid_layout(4, 6, [0, 4], [0, 3, 6])
    # Two destination tiles want the same rows: each source piece is sent once, to two destinations.
    tr = gather_rects(src, [0, 0], [4, 4], 0, 6, [5, 6], 1, 0, 24)
    assert len(tr) == 2 and list(np.diff(tr.dst_start)) == [2, 2]


def test_gather_elems_transpose():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    src = grid_layout(3, 4, [0, 1, 3], [0, 4])
    mem = materialise(src, x)
    idx = np.arange(12).reshape(3, 4).T.reshape(-1)  # x.T flattened
    out = np.zeros((1, 4096), np.uint8)
    tr = gather_elems(src, idx, 0, 1, np.arange(12) * 4)
    apply(tr, mem, out)
    np.testing.assert_array_equal(out[0, :48].view(np.float32), x.T.reshape(-1))
    # Runs: contiguous source bytes to contiguous destination bytes merge, so fewer transfers than elements.
    tr2 = gather_elems(src, np.arange(12), 0, 1, np.arange(12) * 4)
    assert len(tr2) == 2


def test_a_relayout_moves_the_largest_runs_that_divide_every_cut():
    """_chunk tries every divisor of the gcd of the row length and the source's cuts, largest first: patches of 14
    pixels at even columns of a 24-wide image (gcd 12 with the 36-wide output rows) move 2 elements at a time. It
    went 12, 6, 3, then gave up at 1 (a divisor of each one tried, not of the gcd): SigLIP so400m's patch extraction,
    5.1 M elements at batch 12, was located element by element."""
    from tremula.plan.context import _chunk

    src = grid_layout(6, 24, [0, 3, 6], [0, 24])  # 6 image rows of 24 pixels on 2 tiles
    # output rows of 36: each takes 14-pixel runs from columns 0 and 10 of consecutive rows (runs start even)
    runs = [r * 24 + c0 + np.arange(14) for r in range(6) for c0 in (0, 10)]
    flat = np.concatenate(runs)[: 36 * 4]  # 4 output rows of 36 (whole runs of 2, not of 14)
    assert _chunk(flat, 36, [src]) == 2
    assert _chunk(flat + 1, 36, [src]) == 1  # odd starts: no run of 2 starts at a multiple of 2


@pytest.mark.parametrize("shape,out_shape", [((4, 6), (3, 4, 6)), ((1, 6), (3, 4, 6)), ((4, 1, 6), (4, 5, 6)),
                                             ((6,), (2, 3, 6)), ((2, 1, 4, 6), (2, 3, 4, 6))])
@pytest.mark.parametrize("offset", [0, 3])
def test_a_broadcast_along_leading_axes_is_chunked_from_its_rows(shape, out_shape, offset):
    """block_operands reads a broadcast whose last axis is the output's from the source row of each output row
    (_broadcast_rows), not from the whole index map (12.6 M entries for bert-base b128's position embeddings): the
    same elements and the same run length as the map gives."""
    from tremula.plan.context import _broadcast_chunk, _broadcast_rows

    size = int(np.prod(shape))
    rows, cols = int(np.prod(out_shape[:-1])), out_shape[-1]
    idx = np.broadcast_to(np.arange(size).reshape(shape), out_shape).reshape(rows, cols)
    row_of = _broadcast_rows(shape, out_shape)
    np.testing.assert_array_equal(row_of[:, None] * cols + np.arange(cols), idx)
    src = grid_layout(size // cols, cols, [0, size // cols], [0, cols])
    nc = np.array([cols // 2, cols - cols // 2]) if offset else np.array([cols])
    assert _broadcast_chunk(None, nc, src, row_of, cols) == _broadcast_chunk(idx, nc, src)
    assert _broadcast_rows((4, 1), (3, 4, 6)) is None  # a broadcast last axis: the whole map


def test_a_large_relayout_is_made_once_and_what_is_derived_from_it_once():
    """gather_rects keeps its latest large tables (MEMO_PIECES pieces or more) by the content of their arguments: the
    same arguments give the same table object (a batch search lowers each batch at several budgets, and its
    embeddings the same each time), other arguments another, and only MEMO_SIZE are kept. The exchange code the memory
    plan derives from a kept table is kept on it and equals the code of the same table made afresh."""
    from tremula.plan import exchange
    from tremula.target.chip import load_chip
    from tremula.target.overheads import _step_exchange_code

    src = grid_layout(8, 6, [0, 8], [0, 1, 2, 3, 4, 5, 6], dtype="float16")  # one column a block
    dst = grid_layout(8, 6, [0, 2, 4, 6, 8], [0, 6], dtype="float16", buf=1)  # rows a block
    tl, rel, r0, r1, c0, c1 = blocks(dst)
    args = (src, r0, r1, c0, c1, tl, 1, rel, (c1 - c0) * 2)
    small = gather_rects(*args)
    assert gather_rects(*args) is not small  # under MEMO_PIECES: made each time
    old = exchange.MEMO_PIECES
    try:
        exchange.MEMO_PIECES = 1
        exchange._made.clear()
        a = gather_rects(*args)
        assert gather_rects(*args) is a and len(a) == len(small) == 24
        for k in a.__dataclass_fields__:
            np.testing.assert_array_equal(getattr(a, k), getattr(small, k))
        other = gather_rects(src, r0, r1, c0, c1, tl, 2, rel, (c1 - c0) * 2)  # another destination buffer
        assert other is not a and list(other.d_buf) == [2] * len(other)
        gather_rects(src, r0[:2], r1[:2], c0[:2], c1[:2], tl[:2], 1, rel[:2], (c1 - c0)[:2] * 2)
        assert len(exchange._made) == exchange.MEMO_SIZE == 2 and gather_rects(*args) is not a  # (a was evicted)
        chip = load_chip("c600")
        b = gather_rects(*args)
        first = _step_exchange_code(0, [b.compact()], 64, chip, None, None)
        assert b.compact() is b.compact() and "_memo" in vars(b.compact())
        np.testing.assert_array_equal(_step_exchange_code(0, [b.compact()], 64, chip, None, None), first)
        np.testing.assert_array_equal(_step_exchange_code(0, [small.compact()], 64, chip, None, None), first)
        assert first.sum() > 0
    finally:
        exchange.MEMO_PIECES = old
        exchange._made.clear()

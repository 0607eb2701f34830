"""Linear strategy search: budgets, weight streaming and the fc1 -> fc2 pairing of cuts (pure functions)."""

import pytest

from tremula.plan.layout import even_cuts
from tremula.plan.strategies import (
    TEMP_FRACTION,
    WEIGHT_BLOCK_FRACTION,
    choose_linear,
    choose_linear_pair,
    weight_block_budget,
)
from tremula.target.chip import load_chip


@pytest.fixture(scope="module")
def c600():
    return load_chip("c600")


@pytest.mark.parametrize("m", [729, 2916])
def test_pair_cuts_match(c600, m):
    """The second matmul's K parts are the first's output-column blocks, so its gathers are whole source blocks."""
    first, second = choose_linear_pair(c600, m, 1152, 4304, 1152, "uint8", "uint8", 1)
    assert second.pk == first.pn
    assert list(even_cuts(4304, first.pn)) == list(even_cuts(4304, second.pk))
    assert first.pm * first.pn * first.pk <= c600.tiles and second.pm * second.pn * second.pk <= c600.tiles


def test_streaming_lifts_the_copy_cap(c600):
    """With room for one weight copy only, big row counts stream weights to more row groups than copies allow;
    with plenty of room (a small matmul) nothing is streamed."""
    big = choose_linear(c600, 5832, 1152, 1152, "uint8", 1)
    assert big.stream and big.pm > 1
    small = choose_linear(c600, 64, 64, 64, "float16", 1000)
    assert not small.stream


def test_weight_blocks_within_their_cap(c600):
    st = choose_linear(c600, 729, 4304, 1152, "uint8", 1)
    assert 4304 * 1152 // (st.pn * st.pk) <= WEIGHT_BLOCK_FRACTION * c600.sram_bytes_per_tile
    assert st.over == 0


def test_weight_block_budget_grows_with_the_operand_budget(c600):
    """The weight-block cap scales as the buffer budget does: WEIGHT_BLOCK_FRACTION of SRAM at the fixed operand
    budget, more in a plan whose operand budget comes from free bytes, and the search uses the bigger blocks then."""
    assert weight_block_budget(c600, TEMP_FRACTION) == WEIGHT_BLOCK_FRACTION * c600.sram_bytes_per_tile
    assert weight_block_budget(c600, 2 * TEMP_FRACTION) == 2 * weight_block_budget(c600, TEMP_FRACTION)
    tight = choose_linear(c600, 729, 4304, 1152, "uint8", 1)
    roomy = choose_linear(c600, 729, 4304, 1152, "uint8", 1, 2 * TEMP_FRACTION)
    block = 4304 * 1152
    assert block // (roomy.pn * roomy.pk) <= weight_block_budget(c600, 2 * TEMP_FRACTION) and roomy.over == 0
    assert roomy.cycles <= tight.cycles


def test_merge_runs_joins_only_back_to_back_blocks():
    import numpy as np

    from tremula.plan.lower_elementwise import _merge_runs

    tl = np.array([0, 0, 1, 0])
    rows, cols = np.array([2, 2, 2, 2]), np.array([4, 4, 4, 4])
    x = (7, np.array([0, 16, 0, 48]), rows, cols)  # float16: blocks of 16 bytes; the last one is not adjacent
    out = (9, np.array([0, 16, 0, 32]), rows, cols)
    t2, ops = _merge_runs(tl, [x, out], ("float16", "float16"))
    assert sorted(zip(t2.tolist(), ops[1][3].tolist())) == [(0, 8), (0, 16), (1, 8)]
    assert all((o[2] == 1).all() for o in ops)
    bias = (5, np.zeros(4, np.int64), np.ones(4, np.int64), cols)  # broadcast within a block: no merge
    t3, _ = _merge_runs(tl, [x, bias, out], ("float16", "float16", "float16"))
    assert len(t3) == 4


def test_key_split_attention_fills_the_rounds_its_query_blocks_take():
    """fill_rounds: SigLIP so400m fp8 b8's 128 heads x 5 key blocks in rounds of 1,470 units: 3 query blocks take 2
    rounds, and so do 4 (smaller blocks, the same rounds); at b10 (160 heads) a fourth block would take a third round.
    Never fewer blocks than the budget needs, nor more than rows."""
    from tremula.plan.lower_attention import fill_rounds

    assert fill_rounds(3, 729, 128 * 5, 1470) == 4
    assert fill_rounds(3, 729, 160 * 5, 1470) == 3
    assert fill_rounds(2, 50, 8 * 5, 1470) == 36 and fill_rounds(2, 20, 8 * 5, 1470) == 20  # one round; rows
    for nq, sq, u, p in [(1, 197, 12, 16), (5, 64, 3, 9), (7, 7, 40, 100), (2, 300, 24, 1464)]:
        n = fill_rounds(nq, sq, u, p)
        assert nq <= n <= sq and -(-u * n // p) == -(-u * nq // p)
        assert n == sq or -(-u * (n + 1) // p) > -(-u * nq // p)

"""The memory-element map and the rule that a matmul's left operand and output sit in different elements."""

import numpy as np
import pytest

from tremula.plan.elements import element_end, element_index, share_element
from tremula.plan.memory import plan_memory
from tremula.target.chip import load_chip

C600 = load_chip("c600")
KIB = 1024


def test_elements_are_16_kib_in_region_0_and_32_kib_above():
    r0 = C600.non_interleaved_bytes_per_tile
    assert r0 == 208 * KIB and C600.memory_element_bytes == 16 * KIB and C600.interleaved_element_bytes == 32 * KIB
    a = np.array([0, 16 * KIB - 1, 16 * KIB, r0 - 1, r0, r0 + 32 * KIB - 1, r0 + 32 * KIB])
    assert element_index(a, C600).tolist() == [0, 0, 1, 12, 13, 13, 14]
    assert element_end(a, C600).tolist() == [16 * KIB, 16 * KIB, 32 * KIB, r0, r0 + 32 * KIB, r0 + 32 * KIB,
                                             r0 + 64 * KIB]


def test_share_element_is_about_elements_not_bytes():
    e = 16 * KIB
    assert share_element(0, 100, 200, 300, C600)  # disjoint bytes, one element
    assert not share_element(0, e, e, 2 * e, C600)  # back to back across a boundary
    assert share_element(0, e + 1, 2 * e - 1, 2 * e, C600)


def _plan(apart, elements, sizes=(8 * KIB, 8 * KIB), weights=0):
    """Two activations live together on tiles 0 and 1, above `weights` bytes of weights on tile 1 only."""
    cats = ["weights", "activations", "activations"]
    tiles = [np.array([1]), np.array([0, 1]), np.array([0, 1])]
    sz = [np.array([max(weights, 8)]), np.full(2, sizes[0]), np.full(2, sizes[1])]
    first, last = np.array([-1, 0, 0]), np.array([9, 1, 1])
    return plan_memory(cats, tiles, sz, first, last, 2, {}, 624 * KIB, alignment=32, apart=apart,
                       elements=elements)


@pytest.mark.parametrize("weights", [8, 5 * KIB, 12 * KIB])
def test_first_fit_keeps_partners_in_different_elements_on_every_tile(weights):
    pair = [(1, 2, np.array([0, 1]))]
    packed = _plan(pair, None, weights=weights)
    kept = _plan(pair, C600, weights=weights)
    for mp in (packed, kept):
        lo = [mp.resolve(np.array([b, b]), np.array([0, 1])) for b in (1, 2)]
        clash = share_element(lo[0], lo[0] + 8 * KIB, lo[1], lo[1] + 8 * KIB, C600)
        assert clash.any() == (mp is packed)  # without the rule, 16 KiB of two 8 KiB buffers share an element
    assert kept.peak_bytes > packed.peak_bytes


def test_partner_classes_of_one_run_are_a_whole_element_apart():
    from tremula.plan.memory import fold_fit

    occ = np.ones((3, 4), bool)
    apart = np.zeros((3, 3), np.int64)
    apart[0, 2] = apart[2, 0] = 1
    off = fold_fit(np.array([100, 100, 100]), occ, apart, 32 * KIB)
    lo = dict(enumerate(off.tolist()))
    assert abs(lo[0] - lo[2]) >= 100 + 32 * KIB  # apart, whatever base the region gets on any tile
    assert abs(lo[0] - lo[1]) >= 100 and abs(lo[1] - lo[2]) >= 100

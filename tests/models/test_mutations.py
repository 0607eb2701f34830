"""Mutation tests: the simulator really executes the Program. Break one transfer, one address or one exchange and the
check must fail (poison check fires, or the outputs no longer match the reference)."""

import copy

import numpy as np
import pytest

from tremula.chip import load_chip
from tremula.compiler import canonical, compare, compile_model, make_feeds
from tremula.errors import TremulaError
from tremula.frontends import load_model
from tremula.ir import run
from tremula.sim.functional import SimCheckError, simulate


@pytest.fixture(scope="module")
def setup():
    chip = load_chip("mk2")
    res = compile_model("bert-tiny", chip, 2, "fp32")
    g = canonical(load_model("bert-tiny", 2))
    feeds = make_feeds(g, 1)
    return res.program, g, feeds, run(g, feeds)


def outcome(program, g, feeds, ref, check: bool) -> str:
    try:
        got = simulate(program, g, feeds, check=check)
    except SimCheckError:
        return "poison"
    except TremulaError:  # e.g. a corrupted token id makes the embedding lookup go out of range
        return "error"
    ok = all(compare(k, got[k], ref[k], "float32").passed for k in g.outputs)
    return "pass" if ok else "mismatch"


def first_exchange(program) -> int:
    """The first step with transfers: its destinations hold no stale copy of the same data from an earlier step
    (a reused buffer can hold identical bytes, which would hide a corrupted transfer)."""
    return next(k for k, s in enumerate(program.steps) if len(s.exchange))


def test_unmutated_passes(setup):
    assert outcome(*setup, check=True) == "pass"


@pytest.mark.parametrize("check", [True, False])
def test_corrupt_transfer_destination(setup, check):
    program, g, feeds, ref = setup
    p = copy.deepcopy(program)
    k = first_exchange(p)
    ex = p.steps[k].exchange
    j = int(np.argmax(ex.rows * ex.row_bytes))  # the biggest transfer lands 64 bytes off
    ex.d_addr[ex.dst_start[j]] += 64
    assert outcome(p, g, feeds, ref, check) != "pass"


@pytest.mark.parametrize("check", [True, False])
def test_corrupt_vertex_operand_address(setup, check):
    program, g, feeds, ref = setup
    p = copy.deepcopy(program)
    # The last LayerNorm writes last_hidden_state directly: its first vertex reads its rows 8 bytes off.
    k = max(i for i, s in enumerate(p.steps) if any(gr.codelet == "layernorm" for gr in s.compute))
    grp = next(gr for gr in p.steps[k].compute if gr.codelet == "layernorm")
    grp.addrs[0, 0] += 8
    assert outcome(p, g, feeds, ref, check) != "pass"


def test_dropped_exchange_fires_poison(setup):
    program, g, feeds, ref = setup
    p = copy.deepcopy(program)
    k = first_exchange(p)
    p.steps[k].exchange = type(p.steps[k].exchange).empty()
    assert outcome(p, g, feeds, ref, True) == "poison"
    assert outcome(p, g, feeds, ref, False) in ("mismatch", "error")


def test_overlapping_vertex_writes_fire(setup):
    program, g, feeds, _ = setup
    p = copy.deepcopy(program)
    k = next(i for i, s in enumerate(p.steps) if any(len(gr) > 1 and gr.tiles[0] == gr.tiles[-1] or len(gr) > 1
                                                      for gr in s.compute))
    grp = next(gr for gr in p.steps[k].compute if len(gr) > 1)
    # Vertex 1 moves to vertex 0's tile and writes over vertex 0's output.
    grp.tiles[1] = grp.tiles[0]
    grp.addrs[1, -1] = grp.addrs[0, -1]
    with pytest.raises(SimCheckError):
        simulate(p, g, feeds, check=True)


def test_out_of_bounds_address_fires(setup):
    program, g, feeds, _ = setup
    p = copy.deepcopy(program)
    grp = p.steps[1].compute[0] if p.steps[1].compute else p.steps[2].compute[0]
    grp.addrs[0, 0] = p.sram_bytes_per_tile - 4
    with pytest.raises(SimCheckError, match="out of bounds|beyond"):
        simulate(p, g, feeds, check=True)

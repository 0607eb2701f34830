"""Token ids cross the host link and the exchange as int32 (passes/int32.py), and the host refuses an id int32 cannot
hold instead of wrapping it."""

from __future__ import annotations

import numpy as np
import pytest

from tremula.compiler import compile_model
from tremula.errors import TremulaError
from tremula.feeds import make_feeds
from tremula.sim.functional import simulate


@pytest.fixture(scope="module")
def bert():
    return compile_model("bert-tiny", "c600", 2, "fp16")


def test_the_program_streams_ids_as_int32(bert):
    p = bert.program
    ids = [s for s in p.host_in if s.name in ("input_ids", "attention_mask", "token_type_ids")]
    assert ids and {s.dtype for s in ids} == {"int32"}
    assert sum(s.rows * s.cols * 4 for s in ids if s.name == "input_ids") >= 2 * 16


def test_int64_ids_run_and_out_of_range_ones_are_refused(bert):
    feeds = make_feeds(bert.source, 0)
    assert feeds["input_ids"].dtype == np.int64  # the user's int64, narrowed on the host
    got = simulate(bert.program, bert.graph, feeds)
    assert all(np.isfinite(v).all() for v in got.values())
    bad = dict(feeds, input_ids=feeds["input_ids"].copy())
    bad["input_ids"][0, 0] = 2**31
    with pytest.raises(TremulaError, match="outside the program's int32"):
        simulate(bert.program, bert.graph, bad)

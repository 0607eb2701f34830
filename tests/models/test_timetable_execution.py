"""The functional simulator can execute every exchange in its timetable's order, with the same results."""

import numpy as np

from tremula.compiler import compile_model
from tremula.feeds import make_feeds
from tremula.frontends.zoo import build_zoo
from tremula.ir import run
from tremula.pipeline import canonical, cast_graph
from tremula.sim.functional import simulate
from tremula.target.chip import load_chip


def test_timetable_order_gives_the_reference_outputs():
    chip = load_chip("mk2")
    res = compile_model("bert-tiny", chip, 2, "fp32")
    graph = canonical(build_zoo("bert-tiny", batch=2))
    feeds = make_feeds(graph, seed=3)
    ref = run(graph, feeds)
    plain = simulate(res.program, cast_graph(graph, res.dtype), feeds)
    timed = simulate(res.program, cast_graph(graph, res.dtype), feeds, timetable_chip=chip)
    for o in graph.outputs:
        np.testing.assert_array_equal(timed[o], plain[o])
        assert np.max(np.abs(timed[o] - ref[o])) <= 1e-4 * np.max(np.abs(ref[o]))


def test_a_timetable_that_loses_a_chunk_is_caught(monkeypatch):
    import dataclasses

    import tremula.timing as timing
    from tremula.errors import TremulaError

    real = timing.schedule_exchange

    def lossy(table, chip):
        tt = real(table, chip)
        keep = slice(0, max(len(tt.transfer) - 1, 0))  # drop the last chunk
        return dataclasses.replace(tt, transfer=tt.transfer[keep], offset=tt.offset[keep], nbytes=tt.nbytes[keep],
                                   start=tt.start[keep], end=tt.end[keep])

    monkeypatch.setattr(timing, "schedule_exchange", lossy)
    chip = load_chip("mk2")
    res = compile_model("bert-tiny", chip, 2, "fp32")
    graph = canonical(build_zoo("bert-tiny", batch=2))
    feeds = make_feeds(graph, seed=3)
    ref = run(graph, feeds)
    try:
        got = simulate(res.program, cast_graph(graph, res.dtype), feeds, timetable_chip=chip)
    except TremulaError:
        return  # the poison check saw a read of bytes the lossy exchange never delivered
    assert any(not np.allclose(got[o], ref[o], rtol=1e-4, atol=1e-5) for o in graph.outputs)

"""Pipeline stages (stages.py): where a graph may be cut, the stages' sub-graphs computing the whole graph, and the
balanced cuts being the best the cut points allow."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tremula.errors import TremulaError
from tremula.feeds import make_feeds
from tremula.frontends import load_model
from tremula.ir.interp import run
from tremula.pipeline import canonical
from tremula.stages import balanced_cuts, cut_points, node_loads, split


def _graph(name: str, batch: int = 2):
    return canonical(load_model(name, batch=batch))


@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny", "vit-tiny", "siglip-tiny"])
def test_stages_in_sequence_compute_the_whole_graph(name):
    """Each stage run on what the host and the stages before it give computes, stage by stage, exactly the whole
    graph's outputs; a stage reads nothing it is not given (the interpreter would fail on a missing value)."""
    g = _graph(name)
    feeds = make_feeds(g, 0)
    ref = run(g, feeds)
    for cuts in [[p] for p in cut_points(g)] + [cut_points(g)]:
        stages = split(g, cuts)
        values = dict(feeds)
        for k, st in enumerate(stages):
            assert all(values.get(v) is not None for v in st.graph.inputs)
            assert all((src == -1) == (v in g.inputs) and src < k for v, src in st.sources.items())
            values.update(run(st.graph, {v: values[v] for v in st.graph.inputs}))
        for o in g.outputs:
            assert np.array_equal(values[o], ref[o]), (name, cuts, o)
        assert sum(len(st.graph.nodes) for st in stages) == len(g.nodes)


def test_cut_points_are_the_boundaries_of_the_layers():
    """bert-tiny: embeddings, two layers, pooler. The cuts are before each layer and after the last; only the
    residual stream and the attention mask every layer reads cross them."""
    g = _graph("bert-tiny")
    points = cut_points(g)
    assert len(points) == 3
    for i, p in enumerate(points):
        _, stage1 = split(g, [p])
        crossing = sorted((g.types[v].shape for v in stage1.graph.inputs if v not in g.inputs), key=len)
        # the residual [B,S,D]; before a layer, the additive mask [B,1,1,S] too (the pooler after the last needs none)
        assert crossing == [(2, 16, 32), (2, 1, 1, 16)] if i < 2 else [(2, 16, 32)]


def test_balanced_cuts_are_the_best_of_every_choice_of_cut_points():
    """The dynamic programme's cuts give the least largest stage load that any choice of cut points gives."""
    g = _graph("siglip-so400m-patch14-384", 1)  # types only: its weights are never made
    f, w = node_loads(g, "float16")
    cf = np.concatenate([[0], np.cumsum(f)]) / f.sum()
    cw = np.concatenate([[0], np.cumsum(w)]) / w.sum()

    def worst(cuts):
        e = [0, *cuts, len(g.nodes)]
        return max(max(cf[b] - cf[a], cw[b] - cw[a]) for a, b in zip(e, e[1:]))

    points = cut_points(g)
    assert len(points) == 28  # before each of the 27 layers and after the last
    for k in (2, 3):
        best = min(worst(list(c)) for c in itertools.combinations(points, k - 1))
        assert worst(balanced_cuts(g, k, "float16")) == pytest.approx(best)
    # Two stages of 27 identical layers split them 14 / 13 (the embeddings and the head are small).
    (cut,) = balanced_cuts(g, 2, "float16")
    assert points.index(cut) in (13, 14)


def test_weights_count_in_the_stage_that_holds_them():
    g = _graph("gpt2-tiny")
    _, w = node_loads(g, "float32")
    assert w.sum() == sum(c.type.nbytes for c in g.constants.values())
    _, w16 = node_loads(g, "float16")
    assert w16.sum() < w.sum()


def test_bad_cuts_and_too_many_stages_are_refused():
    g = _graph("bert-tiny")
    with pytest.raises(TremulaError, match="increasing node positions"):
        split(g, [30, 10])
    with pytest.raises(TremulaError, match="increasing node positions"):
        split(g, [len(g.nodes)])
    with pytest.raises(TremulaError, match="cannot be cut into 5 stages"):
        balanced_cuts(g, 5, "float32")

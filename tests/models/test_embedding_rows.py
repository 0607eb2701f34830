"""An element-wise op with a broadcast operand runs on rows when keeping its input's column blocks would take more
transfer entries (plan/lower_elementwise.py): BERT's embedding sum after the word lookup, whose layout is the
table's columns over the tiles (one column a block), so the position embedding would arrive one element per row and
block."""

from tremula.check import check_model
from tremula.frontends import load_model
from tremula.pipeline import plan_graph
from tremula.plan.layout import view2d
from tremula.target.chip import load_chip

TINY16 = "examples/chips/tiny16.toml"


def test_embedding_sum_with_a_broadcast_runs_on_rows_and_checks():
    chip = load_chip(TINY16)
    plan = plan_graph(load_model("bert-tiny", 4), chip, "float16")
    g, state = plan.graph, plan.state
    add = next(n for n in g.nodes if n.op == "Add" and any(
        g.types[i].shape != g.types[n.outputs[0]].shape and view2d(g.types[i].shape)[0] > 1 for i in n.inputs))
    word = next(n for n in g.nodes if n.op == "Gather" and "word" in n.name)
    lookup = state.layouts[word.outputs[0]]
    assert not lookup.is_rows and len(lookup.col_cuts) - 1 == chip.tiles  # one table column block a tile
    assert state.layouts[add.outputs[0]].is_rows
    assert check_model("bert-tiny", chip, 4, "fp16").passed


def test_a_small_table_is_looked_up_on_rows_and_the_sum_stays_there():
    """BERT's token-type table (2 rows) is copied to the tiles of its output's rows, each picking its own tokens'
    rows, where the word table (the vocabulary) keeps one column block a tile; the Add of the two then runs on the
    rows (lower_elementwise._spread_first: the inputs' layout over the most tiles), and the position Add after it needs no
    move of its input."""
    chip = load_chip("c600")
    plan = plan_graph(load_model("bert-tiny", 4), chip, "float16")
    g, state = plan.graph, plan.state
    lookups = {n.name: n for n in g.nodes if n.op == "Gather"}
    word = next(n for k, n in lookups.items() if "word" in k)
    tt = next(n for k, n in lookups.items() if "token_type" in k)
    assert "table columns" in state.strategies[word.name]
    assert "the table on each of" in state.strategies[tt.name]
    assert state.layouts[tt.outputs[0]].is_rows
    emb_sum = next(n for n in g.nodes if n.op == "Add" and tt.outputs[0] in n.inputs)
    assert state.layouts[emb_sum.outputs[0]].is_rows
    assert check_model("bert-tiny", chip, 4, "fp16").passed


def test_an_elementwise_op_runs_on_the_inputs_layout_over_the_most_tiles():
    """ViT's residual Adds at a small batch: the residual stream's rows lie on a few tiles, the projection's output
    blocks on many; the Add runs on the latter (each input in blocks of its own, so one moves either way)."""
    import numpy as np

    plan = plan_graph(load_model("vit-tiny", 2), load_chip("c600"), "float16")
    g, state = plan.graph, plan.state
    adds = [n for n in g.nodes if n.op == "Add" and all(
        i not in g.constants and g.types[i].shape == g.types[n.outputs[0]].shape for i in n.inputs)]
    uneven = 0
    for n in adds:
        spread = [np.unique(state.layouts[i].tiles).size for i in n.inputs]
        if spread[0] != spread[1]:
            uneven += 1
            assert np.unique(state.layouts[n.outputs[0]].tiles).size == max(spread), n.name
    assert uneven

"""Constant folding, the local simplifications and dead-code elimination keep results and never touch lazy weights."""

import numpy as np
import pytest

from tremula.ir import GraphBuilder, infer_types, run
from tremula.passes import canonicalize, eliminate_dead_code, fold_constants

RNG = np.random.default_rng(0)


def _ops(g):
    return [n.op for n in g.nodes]


def _same(before, after, feeds, rtol=1e-6):
    infer_types(after)  # still well typed
    want, got = run(before, feeds), run(after, feeds)
    assert set(want) == set(got)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=1e-6)


def test_folds_shape_arithmetic_to_a_constant():
    b = GraphBuilder("shapes")
    x = b.input("x", (2, 3, 4))
    shp = b.op("Shape", [x])  # Shape of an activation: known because shapes are static
    two = b.op("Gather", [shp, b.const("i", np.array(2, np.int64))])
    r = b.op("Range", [b.const("s", np.array(0, np.int64)), two, b.const("d", np.array(1, np.int64))], length=4)
    cat = b.op("Concat", [shp, r], axis=0)
    b.output(b.op("Cast", [cat], to="float32"), "shape_f")
    b.output(b.op("Add", [x, b.const("one", np.float32(1))]), "y")
    g = b.build()
    f = eliminate_dead_code(fold_constants(g))
    assert _ops(f) == ["Add"]
    assert "shape_f" in f.constants
    np.testing.assert_array_equal(f.constants["shape_f"].value(), [2, 3, 4, 0, 1, 2, 3])
    _same(g, f, {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32)})


def test_fold_does_not_mutate_its_input():
    b = GraphBuilder("m")
    c = b.op("Mul", [b.const("a", np.float32([1, 2])), b.const("b", np.float32([3, 4]))])
    x = b.input("x", (2,))
    b.output(b.op("Add", [x, c]), "y")
    g = b.build()
    before = [(n.op, list(n.inputs), list(n.outputs)) for n in g.nodes]
    f = fold_constants(g)
    assert [(n.op, list(n.inputs), list(n.outputs)) for n in g.nodes] == before
    assert _ops(f) == ["Add"] and len(g.constants) == 2


def test_lazy_weights_fold_lazily():
    """A node on lazy weights folds to a lazy constant (as it would fold with concrete weights), made only when its
    values are asked for, and equal to the node's result."""
    b = GraphBuilder("lazy", seed=1)
    x = b.input("x", (3, 8))
    w = b.param("w", (16, 8))
    wt = b.op("Transpose", [w], perm=(1, 0))  # folds to a lazy constant
    alias = b.op("Identity", [b.param("bias", (16,))])  # needs no values: becomes the lazy constant itself
    n = b.op("Shape", [w])  # needs only the type
    y = b.op("Add", [b.op("MatMul", [x, wt]), alias])
    b.output(y, "y")
    b.output(b.op("Cast", [n], to="float32"), "n")
    g = b.build()
    f = eliminate_dead_code(fold_constants(g))
    assert _ops(f) == ["MatMul", "Add"]
    assert f.constants[wt].is_lazy and f.constants["bias"].is_lazy and "w" not in f.constants
    assert f.types[wt].shape == (8, 16)
    np.testing.assert_array_equal(f.constants["n"].value(), [16.0, 8.0])
    feeds = {"x": RNG.standard_normal((3, 8)).astype(np.float32)}
    assert g.constants["w"].is_lazy  # folding made no values
    np.testing.assert_array_equal(f.constants[wt].value(), g.constants["w"].value().T)
    _same(g, f, feeds)


@pytest.mark.parametrize("case", ["identity", "reshape2", "cast_same", "transpose_pair", "expand_same", "concat1",
                                  "transpose_compose", "reshape_same"])
def test_simplifications(case):
    b = GraphBuilder(case)
    x = b.input("x", (2, 3, 4))
    h = b.op("Relu", [x])
    if case == "identity":
        h, keep = b.op("Identity", [h]), 0
    elif case == "reshape2":
        h, keep = b.op("Reshape", [b.op("Reshape", [h], shape=(6, 4))], shape=(4, 6)), 1
    elif case == "cast_same":
        h, keep = b.op("Cast", [h], to="float32"), 0
    elif case == "transpose_pair":
        h, keep = b.op("Transpose", [b.op("Transpose", [h], perm=(0, 2, 1))], perm=(0, 2, 1)), 0
    elif case == "transpose_compose":
        h, keep = b.op("Transpose", [b.op("Transpose", [h], perm=(1, 2, 0))], perm=(1, 2, 0)), 1
    elif case == "expand_same":
        h, keep = b.op("Expand", [h], shape=(1, 3, 1)), 0
    elif case == "concat1":
        h, keep = b.op("Concat", [h], axis=1), 0
    else:
        h, keep = b.op("Reshape", [h], shape=(2, 3, 4)), 0
    b.output(b.op("Neg", [h]), "y")
    g = b.build()
    f = eliminate_dead_code(fold_constants(g))
    assert len(f.nodes) == 2 + keep, _ops(f)
    if case == "transpose_compose":
        assert f.nodes[1].attrs["perm"] == (2, 0, 1)
    _same(g, f, {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32)})


def test_near_miss_simplifications_are_kept():
    b = GraphBuilder("keep")
    x = b.input("x", (2, 3, 4))
    c = b.op("Cast", [x], to="float16")  # a real cast
    t = b.op("Transpose", [b.op("Transpose", [x], perm=(0, 2, 1))], perm=(1, 0, 2))  # does not cancel
    e = b.op("Expand", [x], shape=(2, 2, 3, 4))  # really broadcasts
    b.output(c, "c")
    b.output(t, "t")
    b.output(e, "e")
    g = b.build()
    f = eliminate_dead_code(fold_constants(g))
    assert sorted(_ops(f)) == ["Cast", "Expand", "Transpose"]
    _same(g, f, {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32)})


def test_identity_at_a_graph_output_renames_the_producer():
    b = GraphBuilder("out")
    x = b.input("x", (4,))
    b.output(b.op("Exp", [x]), "y")  # the builder writes an Identity to name the output
    b.output(x, "x_again")  # an input passed straight through must keep its Identity
    g = b.build()
    f = eliminate_dead_code(fold_constants(g))
    assert _ops(f) == ["Exp", "Identity"]
    assert f.nodes[0].outputs == ["y"] and f.outputs == ["y", "x_again"]
    _same(g, f, {"x": np.arange(4, dtype=np.float32)})


def test_dead_code_elimination_drops_unused_nodes_and_constants():
    b = GraphBuilder("dead")
    x = b.input("x", (4,))
    unused_in = b.input("unused", (4,))
    b.op("Exp", [b.op("Mul", [x, b.const("k", np.float32(2))])])  # nobody reads this
    b.op("Neg", [unused_in])
    y = b.op("Add", [x, b.const("one", np.float32(1))])
    b.output(y, "y")
    g = b.build()
    d = eliminate_dead_code(g)
    assert _ops(d) == ["Add", "Identity"] and set(d.constants) == {"one"}
    assert d.inputs == ["x", "unused"]  # the interface stays
    assert len(g.nodes) == 5  # input untouched
    _same(g, d, {"x": np.arange(4, dtype=np.float32), "unused": np.zeros(4, np.float32)})


def test_canonicalize_is_deterministic_and_idempotent():
    b = GraphBuilder("mlp", seed=2)
    x = b.input("x", (2, 5, 8))
    h = b.op("Add", [b.op("MatMul", [x, b.const("w", RNG.standard_normal((8, 16)).astype(np.float32))]),
                     b.const("b", RNG.standard_normal(16).astype(np.float32))])
    b.output(b.op("Identity", [h]), "y")
    g = b.build()
    c1, c2 = canonicalize(g), canonicalize(g)
    assert _ops(c1) == ["Linear"] == _ops(c2)
    assert _ops(canonicalize(c1)) == ["Linear"]
    _same(g, c1, {"x": RNG.standard_normal((2, 5, 8)).astype(np.float32)}, rtol=1e-5)


@pytest.mark.parametrize("name", ["vit-tiny", "gpt2-tiny"])
def test_canonicalize_keeps_zoo_models_lazy_and_equal(name):
    zoo = pytest.importorskip("tremula.frontends.zoo", reason="the model zoo is not available")
    g = zoo.build_zoo(name)
    lazy = {k for k, c in g.constants.items() if c.is_lazy}
    c = canonicalize(g)
    assert lazy and all(c.constants[k].is_lazy for k in lazy if k in c.constants)
    assert all(g.constants[k].is_lazy for k in lazy)  # the input graph was not materialised either
    for op in ("Attention", "LayerNorm", "Gelu"):
        assert sum(n.op == op for n in c.nodes) == sum(n.op == op for n in g.nodes)
    # Linears: each of the model's, or a part of a fused projection's Split (passes/fuse_qkv.py)
    made = {n.outputs[0] for n in c.nodes if n.op == "Linear" and n.name.endswith(".fused")}
    parts = sum(len(n.outputs) - 1 for n in c.nodes if n.op == "Split" and n.inputs[0] in made)
    assert sum(n.op == "Linear" for n in c.nodes) + parts == sum(n.op in ("Linear", "MatMul") and
                                                               n.inputs[1] in g.constants for n in g.nodes)
    feeds = {}
    for i in g.inputs:
        t = g.types[i]
        feeds[i] = np.zeros(t.shape, t.dtype) if "int" in t.dtype else RNG.standard_normal(t.shape).astype(t.dtype)
    _same(g, c, feeds, rtol=1e-5)


def test_shape_arithmetic_on_run_time_values_is_a_clear_error():
    from tremula.errors import TremulaError

    b = GraphBuilder("dyn")
    n = b.input("n", (), "int64")  # a size given at run time
    r = b.op("Range", [b.const("s", np.array(0, np.int64)), n, b.const("d", np.array(1, np.int64))], length=4)
    b.output(r, "y")
    with pytest.raises(TremulaError, match="run-time"):
        canonicalize(b.build())


def test_a_gather_of_every_element_in_order_is_a_reshape():
    """transformers' BERT mask builder flattens the [B, S] mask and gathers it back as [B, 1, 1, S]."""
    for in_order in (True, False):
        b = GraphBuilder("gather")
        m = b.input("m", (2, 7))
        flat = b.op("Reshape", [m], shape=(14, 1))
        idx = np.arange(14).reshape(2, 1, 1, 7)
        if not in_order:
            idx = idx[::-1].copy()
        g4 = b.op("Gather", [flat, b.const("idx", idx.astype(np.int64))], axis=0)
        b.output(b.op("Reshape", [g4], shape=(2, 1, 1, 7)), "y")
        g = b.build()
        f = eliminate_dead_code(fold_constants(g))
        assert _ops(f) == (["Reshape"] if in_order else ["Reshape", "Gather", "Reshape"])
        _same(g, f, {"m": RNG.standard_normal((2, 7)).astype(np.float32)})


def test_a_mask_expanded_by_an_all_true_pattern_reaches_attention_unexpanded():
    """And(all-true [1, 1, Sq, 1], padding [B, 1, 1, Sk]) -> Where(.., 0, -big) is the padding mask broadcast over the
    query rows: the Where runs on [B, 1, 1, Sk] and attention reads that (it broadcasts masks itself); a causal
    pattern (not all true) keeps its And."""
    for causal in (False, True):
        b = GraphBuilder("mask")
        q, k, v = (b.input(n, (2, 2, 5, 4)) for n in "qkv")
        pad = b.op("Cast", [b.input("pad", (2, 1, 1, 5))], to="bool")
        pattern = np.tril(np.ones((5, 5), bool))[None, None] if causal else np.ones((1, 1, 5, 1), bool)
        allowed = b.op("And", [b.const("pattern", pattern), pad])
        mask = b.op("Where", [allowed, b.const("zero", np.float32(0)), b.const("neg", np.float32(-1e9))])
        b.output(b.op("Attention", [q, k, v, mask], scale=0.5, causal=0), "y")
        g = b.build()
        f = eliminate_dead_code(fold_constants(g))
        attn = f.nodes[-1]
        assert f.types[attn.inputs[3]].shape == ((2, 1, 5, 5) if causal else (2, 1, 1, 5))
        assert ("And" in _ops(f)) == causal
        pad_v = np.ones((2, 1, 1, 5), np.float32)
        pad_v[1, ..., 3:] = 0
        feeds = {n: RNG.standard_normal((2, 2, 5, 4)).astype(np.float32) for n in "qkv"} | {"pad": pad_v}
        _same(g, f, feeds)


def test_a_constant_repeated_along_leading_axes_shrinks_to_one_row():
    """An exporter's token-type embedding of all-zero type ids, folded to [B, S, D]: one row, broadcast. The last
    axis is never cut (a LayerNorm's all-ones scale stays the vector the fusion looks for)."""
    b = GraphBuilder("rows")
    x = b.input("x", (2, 7, 4))
    row = RNG.standard_normal(4).astype(np.float32)
    per_pos = RNG.standard_normal((7, 4)).astype(np.float32)
    y = b.op("Add", [x, b.const("types", np.broadcast_to(row, (2, 7, 4)).copy())])
    y = b.op("Add", [y, b.const("pos", np.broadcast_to(per_pos, (2, 7, 4)).copy())])
    b.output(b.op("Mul", [y, b.const("ones", np.ones(4, np.float32))]), "y")
    g = b.build()
    f = fold_constants(g)
    shapes = [f.types[n.inputs[1]].shape for n in f.nodes]
    assert shapes == [(1, 1, 4), (1, 7, 4), (4,)]
    _same(g, f, {"x": RNG.standard_normal((2, 7, 4)).astype(np.float32)})


def test_an_out_of_range_gather_is_not_made_a_reshape():
    b = GraphBuilder("oob")
    x = b.input("x", (2, 1, 3))
    b.output(b.op("Gather", [x, b.const("i", np.array(3, np.int64))], axis=1), "y")
    f = fold_constants(b.build())
    assert _ops(f) == ["Gather"]  # left for the Gather to refuse when it runs

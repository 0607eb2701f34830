"""passes/int32.narrow_int64: the chip holds no 64-bit integers, so int64 inputs, constants and Cast targets become
int32, unless an int64 constant does not fit (then nothing changes)."""

from __future__ import annotations

import numpy as np

from tremula.frontends import load_model
from tremula.ir.graph import Constant, Node
from tremula.ir.interp import infer_types, run
from tremula.passes.int32 import fits_int32, narrow_int64
from tremula.pipeline import canonical


def _bert():
    return canonical(load_model("bert-tiny", batch=2))


def test_ids_and_masks_become_int32_and_compute_the_same():
    g = _bert()
    n = narrow_int64(g)
    assert [g.types[i].dtype for i in g.inputs] == ["int64"] * 3
    assert [n.types[i].dtype for i in n.inputs] == ["int32"] * 3
    assert not [v for v, t in n.types.items() if t.dtype == "int64"]
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 100, (2, 16)), "attention_mask": np.ones((2, 16), np.int64),
             "token_type_ids": rng.integers(0, 2, (2, 16))}
    a, b = run(g, feeds), run(n, {k: v.astype(np.int32) for k, v in feeds.items()})
    for o in g.outputs:
        np.testing.assert_array_equal(a[o], b[o])


def test_int64_constants_and_casts_narrowed():
    g = _bert()
    g.constants["ids_offset"] = Constant.of("ids_offset", np.array([1], np.int64))
    g.types["ids_offset"] = g.constants["ids_offset"].type
    g.nodes.insert(0, Node("Cast", ["token_type_ids"], ["tt64"], {"to": "int64"}, "tt64"))
    g.nodes.insert(1, Node("Add", ["tt64", "ids_offset"], ["tt1"], {}, "tt1"))
    g = infer_types(g)
    n = narrow_int64(g)
    assert n.constants["ids_offset"].value().dtype == np.int32
    assert n.types["tt64"].dtype == n.types["tt1"].dtype == "int32"
    assert next(x for x in n.nodes if x.name == "tt64").attrs["to"] == "int32"


def test_a_constant_out_of_int32_keeps_the_graph_as_it_is():
    g = _bert()
    g.constants["big"] = Constant.of("big", np.array([2**40], np.int64))
    g.types["big"] = g.constants["big"].type
    assert narrow_int64(g) is g
    assert not fits_int32(np.array([-(2**31) - 1])) and fits_int32(np.array([-(2**31), 2**31 - 1]))
    assert fits_int32(np.zeros(0, np.int64))


def test_a_graph_without_int64_is_returned_unchanged():
    g = canonical(load_model("vit-tiny", batch=1))
    assert narrow_int64(g) is g

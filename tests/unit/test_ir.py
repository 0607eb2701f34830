"""The IR's own rules: types, lazy constants, the builder and the reference interpreter."""

import numpy as np
import pytest

from tremula.errors import TremulaError
from tremula.ir import Constant, GraphBuilder, LazyInit, TensorType, infer_types, run
from tremula.ir.graph import name_seed
from tremula.ir.ops import OPS, flops


def test_tensor_type_rejects_dynamic_and_unknown():
    with pytest.raises(TremulaError):
        TensorType((-1, 3), "float32")
    with pytest.raises(TremulaError):
        TensorType((2,), "complex64")
    t = TensorType((2, 3), "float16")
    assert (t.size, t.nbytes, str(t)) == (6, 12, "float16[2,3]")


def test_lazy_constant_is_seeded_and_deferred():
    t = TensorType((64, 32), "float32")
    c1 = Constant("w", t, init=LazyInit("normal", seed=name_seed(0, "w"), std=0.02))
    c2 = Constant("w", t, init=LazyInit("normal", seed=name_seed(0, "w"), std=0.02))
    assert c1.is_lazy and c1.data is None
    a = c1.value()
    assert not c1.is_lazy and a.shape == (64, 32) and a.dtype == np.float32
    np.testing.assert_array_equal(a, c2.value())
    assert 0.015 < float(a.std()) < 0.025
    other = Constant("w", t, init=LazyInit("normal", seed=name_seed(1, "w"), std=0.02)).value()
    assert not np.array_equal(a, other)


def test_name_seed_is_stable():
    # crc32-based, so the same across processes and Python versions (hash() would not be).
    assert name_seed(0, "encoder.layer.0.weight") == name_seed(0, "encoder.layer.0.weight")
    assert name_seed(0, "a") != name_seed(0, "b")


def test_constant_data_must_match_type():
    with pytest.raises(TremulaError):
        Constant("c", TensorType((2,), "float32"), data=np.zeros(3, np.float32))
    with pytest.raises(TremulaError):
        Constant("c", TensorType((2,), "float32"))


def _mlp():
    b = GraphBuilder("mlp", seed=3)
    x = b.input("x", (2, 5, 8))
    h = b.op("Linear", [x, b.param("w1", (8, 16)), b.param("b1", (16,))])
    h = b.op("Gelu", [h], approximate="none")
    h = b.op("LayerNorm", [h, b.param("g", (16,), kind="ones"), b.param("be", (16,), kind="zeros")], epsilon=1e-5)
    b.output(h, "y")
    return b.build()


def test_builder_and_interpreter_agree_with_numpy():
    g = _mlp()
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    y = run(g, {"x": x})["y"]
    h = x @ g.constants["w1"].value() + g.constants["b1"].value()
    from math import erf

    h = 0.5 * h * (1 + np.vectorize(erf)(h / np.sqrt(2)))
    h = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, h, rtol=1e-5, atol=1e-5)


def test_infer_types_detects_order_and_missing_outputs():
    g = _mlp()
    infer_types(g)
    assert g.types["y"] == TensorType((2, 5, 16), "float32")
    g.nodes.reverse()
    with pytest.raises(TremulaError, match="before it is defined"):
        infer_types(g)


def test_interpreter_checks_feeds():
    g = _mlp()
    with pytest.raises(TremulaError, match="missing input"):
        run(g, {})
    with pytest.raises(TremulaError, match="shape"):
        run(g, {"x": np.zeros((2, 5, 9), np.float32)})


def test_every_op_has_a_complete_row():
    for name, r in OPS.items():
        assert r.name == name
        assert callable(r.infer) and callable(r.ref) and callable(r.flops)
        assert r.n_inputs[0] <= r.n_inputs[1]


def test_matmul_flops_and_shapes():
    a, w = TensorType((3, 4, 5), "float32"), TensorType((5, 7), "float32")
    (o,) = OPS["MatMul"].infer([a, w], {})
    assert o.shape == (3, 4, 7)
    assert flops("MatMul", [a, w], [o], {}) == 2 * 3 * 4 * 7 * 5
    with pytest.raises(TremulaError):
        OPS["MatMul"].infer([a, TensorType((6, 7), "float32")], {})


def test_attention_causal_masks_future_keys():
    b = GraphBuilder("att")
    q = b.input("q", (1, 1, 3, 4))
    k = b.input("k", (1, 1, 3, 4))
    v = b.input("v", (1, 1, 3, 4))
    b.output(b.op("Attention", [q, k, v], scale=0.5, causal=1), "o")
    g = b.build()
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal((1, 1, 3, 4)).astype(np.float32) for n in "qkv"}
    o = run(g, feeds)["o"]
    # The first query sees only the first key, so its output is exactly the first value row.
    np.testing.assert_allclose(o[0, 0, 0], feeds["v"][0, 0, 0], rtol=1e-6)
    feeds2 = dict(feeds, v=feeds["v"].copy())
    feeds2["v"][0, 0, 2] += 10.0  # the last key is in the future of queries 0 and 1
    o2 = run(g, feeds2)["o"]
    np.testing.assert_allclose(o2[0, 0, :2], o[0, 0, :2], rtol=1e-6)
    assert not np.allclose(o2[0, 0, 2], o[0, 0, 2])


def test_patchify_matches_conv_with_stride_equal_kernel():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 8, 12)).astype(np.float32)
    w = rng.standard_normal((5, 3, 4, 4)).astype(np.float32)
    (conv,) = OPS["Conv"].ref([x, w], {"strides": (4, 4)})
    (p,) = OPS["Patchify"].ref([x], {"patch": (4, 4)})
    lin = p @ w.reshape(5, -1).T  # [B, N, O]
    np.testing.assert_allclose(lin, conv.reshape(2, 5, -1).transpose(0, 2, 1), rtol=1e-5, atol=1e-5)


def test_moves_of_a_scalar_stay_scalars():
    """Transpose and Expand of a 0-d tensor give a 0-d result, as onnxruntime does (np.ascontiguousarray, which they
    used, turns a 0-d array into shape (1,): the fuzz test found it)."""
    x = np.array(-4, np.int64)
    for op, attrs in (("Transpose", {}), ("Expand", {"shape": ()})):
        (y,) = OPS[op].ref([x], attrs)
        assert y.shape == () and y == -4, op
        assert OPS[op].infer([TensorType((), "int64")], attrs)[0].shape == ()


def test_seeded_weights_are_made_once_and_shared_read_only():
    import gc

    from tremula.frontends.zoo import build_zoo
    from tremula.ir.graph import sharing_weights

    def weight(g):
        return max(g.constants.values(), key=lambda c: c.type.size).value()

    with sharing_weights():
        first = weight(build_zoo("bert-tiny", 1))
        ident, copy = id(first), first.copy()
        del first
        gc.collect()  # the graph that made it is gone; the block keeps its values
        again = weight(build_zoo("bert-tiny", 2))  # another batch, the same seeded weights
        assert id(again) == ident and np.array_equal(again, copy)
        assert not again.flags.writeable
        with pytest.raises(ValueError):
            again[0] = 0  # (a change would reach every graph sharing them)
    g = build_zoo("bert-tiny", 1)
    w = weight(g)
    assert weight(build_zoo("bert-tiny", 1)) is w  # shared while a graph holds them, block or not
    other = build_zoo("bert-tiny", 1, seed=1)
    assert not np.array_equal(weight(other), w)  # another seed is another init

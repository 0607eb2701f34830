"""matmul+bias and patch-embedding Conv fusions, and the near misses that must stay unfused."""

import numpy as np
import pytest

from tremula.ir import GraphBuilder, infer_types, run
from tremula.passes import canonicalize, fuse_linear, fuse_patchify

RNG = np.random.default_rng(4)


def _randn(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _same(g, f, rtol=1e-5):
    infer_types(f)
    feeds = {n: _randn(*g.types[n].shape) for n in g.inputs}
    want, got = run(g, feeds), run(f, feeds)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("bias_first", [False, True])
@pytest.mark.parametrize("bias_shape", [(16,), (1, 1, 16)])
def test_matmul_add_becomes_linear(bias_first, bias_shape):
    b = GraphBuilder("lin")
    x = b.input("x", (2, 5, 8))
    y = b.op("MatMul", [x, b.const("w", _randn(8, 16))])
    bias = b.const("b", _randn(*bias_shape))
    b.output(b.op("Add", [bias, y] if bias_first else [y, bias]), "y")
    g = b.build()
    f = fuse_linear(g)
    lin = [n for n in f.nodes if n.op == "Linear"]
    assert len(lin) == 1 and len(lin[0].inputs) == 3 and "MatMul" not in [n.op for n in f.nodes]
    assert f.types[lin[0].inputs[2]].shape == (16,)
    _same(g, f)


def test_lone_matmul_with_lazy_weight_becomes_linear_and_stays_lazy():
    b = GraphBuilder("lin", seed=5)
    x = b.input("x", (3, 8))
    b.output(b.op("MatMul", [x, b.param("w", (8, 4))]), "y")
    g = b.build()
    f = fuse_linear(g)
    assert [n.op for n in f.nodes][0] == "Linear" and len(f.nodes[0].inputs) == 2
    assert f.constants["w"].is_lazy
    _same(g, f)


@pytest.mark.parametrize("miss", ["activation_weight", "weight_3d", "bias_matrix", "bias_activation", "leak"])
def test_linear_near_misses(miss):
    b = GraphBuilder("lin")
    x = b.input("x", (2, 5, 8))
    if miss == "activation_weight":
        w = b.input("w", (8, 16))
    elif miss == "weight_3d":
        w = b.const("w", _randn(2, 8, 16))
    else:
        w = b.const("w", _randn(8, 16))
    y = b.op("MatMul", [x, w])
    if miss == "bias_matrix":
        bias = b.const("b", _randn(5, 16))
    elif miss == "bias_activation":
        bias = b.input("bias", (16,))
    else:
        bias = b.const("b", _randn(16))
    b.output(b.op("Add", [y, bias]), "y")
    if miss == "leak":
        b.output(b.op("Neg", [y]), "pre_bias")
    g = b.build()
    f = fuse_linear(g)
    ops = [n.op for n in f.nodes]
    if miss in ("activation_weight", "weight_3d"):
        assert "Linear" not in ops
    else:  # the MatMul still becomes a Linear, but the Add stays separate
        assert "Linear" in ops and "Add" in ops and all(len(n.inputs) == 2 for n in f.nodes if n.op == "Linear")
    _same(g, f)


@pytest.mark.parametrize("back", [(2, 5, 16), (5, 2, 16)])
def test_reshape_sandwich_around_linear_goes(back):
    b = GraphBuilder("gemm")
    x = b.op("Relu", [b.input("x", (2, 5, 8))])
    flat = b.op("Reshape", [x], shape=(10, 8))
    y = b.op("Add", [b.op("MatMul", [flat, b.const("w", _randn(8, 16))]), b.const("b", _randn(16))])
    b.output(b.op("Reshape", [y], shape=back), "y")
    g = b.build()
    f = canonicalize(g)
    ops = [n.op for n in f.nodes]
    if back == (2, 5, 16):  # Linear reads [2, 5, 8] and writes [2, 5, 16]: no reshapes left
        assert ops == ["Relu", "Linear"] and f.types[f.nodes[1].inputs[0]].shape == (2, 5, 8)
    else:  # reshaped back to other leading dims: Linear on x would give the wrong shape, so nothing changes
        assert ops == ["Relu", "Reshape", "Linear", "Reshape"]
    _same(g, f)


def _conv(tail="vit", stride=4, pads=(0, 0, 0, 0), group=1, bias=True, lazy=False, image=(10, 12)):
    b = GraphBuilder("patch", seed=7)
    x = b.input("pixels", (2, 4, *image))
    w = b.param("w", (6, 4 // group, 4, 4)) if lazy else b.const("w", _randn(6, 4 // group, 4, 4))
    ins = [x, w] + ([b.const("b", _randn(6))] if bias else [])
    y = b.op("Conv", ins, strides=(stride, stride), pads=pads, dilations=(1, 1), group=group)
    n = b.type(y).shape
    if tail == "vit":  # flatten(2).transpose(1, 2)
        y = b.op("Transpose", [b.op("Reshape", [y], shape=(n[0], n[1], n[2] * n[3]))], perm=(0, 2, 1))
    else:  # something reads NCHW
        y = b.op("Relu", [y])
    b.output(y, "y")
    return b.build()


@pytest.mark.parametrize("bias", [True, False])
def test_patch_conv_with_flatten_transpose_collapses(bias):
    g = _conv(bias=bias)
    f = fuse_patchify(g)
    assert [n.op for n in f.nodes if n.op != "Identity"] == ["Patchify", "Linear"]
    assert f.nodes[0].attrs["patch"] == (4, 4) and len(f.nodes[1].inputs) == 2 + bias
    assert f.types["y"].shape == (2, 2 * 3, 6)  # 10x12 image, 4x4 patches (remainder pixels dropped as Conv does)
    _same(g, f)


def test_patch_conv_read_as_nchw_gets_layout_back():
    g = _conv(tail="nchw")
    f = fuse_patchify(g)
    assert [n.op for n in f.nodes if n.op != "Identity"] == ["Patchify", "Linear", "Transpose", "Reshape", "Relu"]
    _same(g, f)


def test_lazy_patch_weight_stays_lazy():
    g = _conv(lazy=True)
    f = canonicalize(g)
    assert [n.op for n in f.nodes] == ["Patchify", "Linear"]
    assert f.constants[f.nodes[1].inputs[1]].is_lazy and g.constants["w"].is_lazy  # planning made no values
    _same(g, f)


@pytest.mark.parametrize("kw", [dict(stride=2), dict(pads=(1, 1, 1, 1)), dict(group=2)])
def test_conv_near_misses_do_not_fuse(kw):
    g = _conv(**kw)
    f = fuse_patchify(g)
    assert "Patchify" not in [n.op for n in f.nodes]
    _same(g, f)

"""Attention fusion: scale placements, additive / Where / causal masks, k-transpose peeling, and near misses."""

import numpy as np
import pytest

from tremula.ir import GraphBuilder, infer_types, run
from tremula.passes import canonicalize, fuse_attention

RNG = np.random.default_rng(3)
B, S, H, D = 2, 5, 2, 4
NEG = np.finfo(np.float32).min


def _c(b, name, v):
    return b.const(name, np.asarray(v, np.float32))


def _attn(*, scale="mul", mask=None, kt="perm0231", axis=-1, leak=False, scale_value=D**-0.5, guard=None):
    """q/k/v from [B, S, H, D] inputs the way HF models reshape them; the options pick the exporter's form."""
    b = GraphBuilder("attn")
    q0, k0, v0 = (b.input(n, (B, S, H, D)) for n in "qkv")
    q = b.op("Transpose", [q0], perm=(0, 2, 1, 3))
    v = b.op("Transpose", [v0], perm=(0, 2, 1, 3))
    if kt == "perm0231":  # ViT legacy export: one transpose straight to kᵀ
        k_t = b.op("Transpose", [k0], perm=(0, 2, 3, 1))
    elif kt == "two_transposes":  # GPT-2: k to [B,H,S,D], then swap the last two
        k_t = b.op("Transpose", [b.op("Transpose", [k0], perm=(0, 2, 1, 3))], perm=(0, 1, 3, 2))
    elif kt == "sdpa_chain":  # dynamo's SDPA decomposition: [B·H, S, D] -> swap -> [B, H, D, S]
        k = b.op("Reshape", [b.op("Transpose", [k0], perm=(0, 2, 1, 3))], shape=(B * H, S, D))
        k_t = b.op("Reshape", [b.op("Transpose", [k], perm=(0, 2, 1))], shape=(B, H, D, S))
    elif kt == "not_a_swap":  # the same chain with the wrong final reshape: not kᵀ
        k = b.op("Reshape", [b.op("Transpose", [k0], perm=(0, 2, 1, 3))], shape=(B * H, S, D))
        k_t = b.op("Reshape", [k], shape=(B, H, D, S))
    else:  # kᵀ arrives as it is (a graph input), so the fusion must add the transpose back
        k_t = b.input("kt", (B, H, D, S))
    if scale == "sdpa":  # torch's SDPA decomposition: √scale on q and on kᵀ
        r = float(np.sqrt(scale_value))
        q = b.op("Mul", [q, _c(b, "sq", r)])
        k_t = b.op("Mul", [k_t, _c(b, "sk", r)])
    s = b.op("MatMul", [q, k_t])
    if scale == "mul":
        s = b.op("Mul", [s, _c(b, "scale", scale_value)])
    elif scale == "div":
        s = b.op("Div", [s, _c(b, "scale", 1 / scale_value)])
    elif scale == "vector":
        s = b.op("Mul", [s, _c(b, "scale", np.full(S, scale_value))])
    tri = np.tril(np.ones((S, S), bool))
    if mask == "input":  # BERT: [B, 1, 1, S] additive mask computed from input_ids
        s = b.op("Add", [s, b.input("mask", (B, 1, 1, S))])
    elif mask == "causal_add":  # GPT-2 / HF masking utils: 0 / finfo.min triangle
        s = b.op("Add", [_c(b, "m", np.where(tri, 0, NEG)[None, None]), s])
    elif mask == "causal_where":
        s = b.op("Where", [b.const("tri", tri[None, None]), s, _c(b, "neg", -np.inf)])
    elif mask == "causal_where_inverted":
        s = b.op("Where", [b.const("triu", ~tri), _c(b, "neg", NEG), s])
    elif mask == "padding_where":
        keep = np.ones((1, 1, S, S), bool)
        keep[..., -1] = False
        s = b.op("Where", [b.const("keep", keep), s, _c(b, "neg", NEG)])
    elif mask == "soft_causal":  # -10000 is not -inf: stays an additive mask
        s = b.op("Add", [s, _c(b, "m", np.where(tri, 0, -10000.0)[None, None])])
    elif mask == "shifted_causal":  # a triangle one off the diagonal is not the causal triangle
        s = b.op("Add", [s, _c(b, "m", np.where(np.tril(np.ones((S, S), bool), 1), 0, NEG)[None, None])])
    elif mask == "zeros":  # SDPA without a mask adds a zero constant
        s = b.op("Add", [s, _c(b, "m", np.zeros((1, 1, S, S)))])
    p = b.op("Softmax", [s], axis=axis)
    if guard:  # SDPA's guard for all-masked rows: Where(IsNaN(p), 0, p); the ONNX importer writes Not(Equal(p, p))
        nan = b.op("IsNaN", [p]) if guard == "isnan" else b.op("Not", [b.op("Equal", [p, p])])
        p = b.op("Where", [nan, _c(b, "zero", 0.0), p])
    o = b.op("MatMul", [p, v])
    b.output(b.op("Reshape", [b.op("Transpose", [o], perm=(0, 2, 1, 3))], shape=(B, S, H * D)), "y")
    if leak:
        b.output(p, "probs")  # attention weights returned too: the softmax must stay
    return b.build()


def _feeds(g):
    f = {n: RNG.standard_normal(g.types[n].shape).astype(np.float32) for n in g.inputs}
    if "mask" in f:
        f["mask"] = np.where(RNG.random((B, 1, 1, S)) < 0.3, -1e4, 0).astype(np.float32)
    return f


def _check(g, fused=True, causal=0, n_inputs=3):
    snapshot = [(n.op, list(n.inputs), list(n.outputs), dict(n.attrs)) for n in g.nodes]
    f = fuse_attention(g)
    assert [(n.op, list(n.inputs), list(n.outputs), dict(n.attrs)) for n in g.nodes] == snapshot  # input kept
    infer_types(f)
    att = [n for n in f.nodes if n.op == "Attention"]
    if not fused:
        assert not att
    else:
        assert len(att) == 1 and not {"Softmax", "MatMul"} & {n.op for n in f.nodes}
        assert att[0].attrs["causal"] == causal and len(att[0].inputs) == n_inputs
        assert att[0].attrs["scale"] == pytest.approx(D**-0.5, rel=1e-6)
    feeds = _feeds(g)
    want, got = run(g, feeds), run(f, feeds)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    return f


@pytest.mark.parametrize("scale", ["mul", "div", "sdpa"])
@pytest.mark.parametrize("kt", ["perm0231", "two_transposes", "given", "sdpa_chain"])
def test_attention_scale_and_k_forms_fuse(scale, kt):
    f = _check(_attn(scale=scale, kt=kt))
    att = next(n for n in f.nodes if n.op == "Attention")
    assert f.types[att.inputs[1]].shape == (B, H, S, D)


def test_peeled_k_transpose_merges_with_the_one_before_it():
    f = canonicalize(_attn(kt="perm0231"))
    ops = [n.op for n in f.nodes]
    assert ops.count("Transpose") == 4  # q, k, v in and the output; no transpose pairs left
    assert ops.count("Attention") == 1


@pytest.mark.parametrize("mask,causal,n_inputs", [
    ("input", 0, 4),
    ("causal_add", 1, 3),
    ("causal_where", 1, 3),
    ("causal_where_inverted", 1, 3),
    ("padding_where", 0, 4),
    ("soft_causal", 0, 4),
    ("shifted_causal", 0, 4),
    ("zeros", 0, 3),
])
def test_attention_masks(mask, causal, n_inputs):
    _check(_attn(mask=mask), causal=causal, n_inputs=n_inputs)


@pytest.mark.parametrize("kw", [dict(axis=2), dict(leak=True), dict(scale="vector")])
def test_attention_near_misses_do_not_fuse(kw):
    _check(_attn(**kw), fused=False)


def test_scores_read_twice_do_not_fuse():
    g = _attn()
    b_nodes = g.nodes
    mm = next(n for n in b_nodes if n.op == "MatMul")
    g.outputs.append(mm.outputs[0])  # the raw scores are also an output
    _check(g, fused=False)


def test_sdpa_decomposition_fuses_whole():
    g = _attn(scale="sdpa", kt="sdpa_chain", mask="zeros", guard="not_equal")
    f = _check(g)
    assert [n.op for n in f.nodes].count("Reshape") == 1  # only the output's; the kᵀ chain is gone


def test_reshape_chain_that_is_not_a_swap_keeps_its_meaning():
    g = _attn(kt="not_a_swap")
    f = _check(g)  # still fuses, reading the chain's output through an added transpose
    att = next(n for n in f.nodes if n.op == "Attention")
    assert f.types[att.inputs[1]].shape == (B, H, S, D)

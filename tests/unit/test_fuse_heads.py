"""passes/fuse_heads.py: torch's MultiheadAttention as exporters write it (sequence-first, one projection for k and v
split by Gathers, a 3-D attention over batch x heads, a constant query) becomes the zoo's head views; chains that
only look alike are left alone; every rewrite computes what the graph computed."""

from __future__ import annotations

import numpy as np
import pytest

from tremula.ir import GraphBuilder, infer_types, run
from tremula.passes import canonicalize
from tremula.passes.fuse_heads import HEAD_PERM

B, S, E, H = 2, 5, 12, 3
D = E // H
RNG = np.random.default_rng(3)


def _w(*shape):
    return (RNG.standard_normal(shape) * 0.3).astype(np.float32)


def _mha(interleaved: bool = False, kv_also_out: bool = False, seq_first: bool = True):
    """The pooling head's attention as torch.onnx writes it; `interleaved` makes head h own columns h, h+H, ..
    (not a head view), `kv_also_out` makes the k/v projection a graph output too (so it cannot move)."""
    b = GraphBuilder("mha", seed=1)
    x = b.input("x", (B, S, E))
    xt = b.op("Transpose", [x], perm=(1, 0, 2)) if seq_first else x  # [S, B, E]
    rows = (S, B) if seq_first else (B, S)
    kv = b.op("Add", [b.op("MatMul", [xt, b.const("w_kv", _w(E, 2 * E))]), b.const("b_kv", _w(2 * E))])
    if kv_also_out:
        b.output(kv, "kv")
    u = b.op("Reshape", [kv], shape=(1, *rows, 2, E))  # unflatten(-1, (2, E)).unsqueeze(0)
    u = b.op("Transpose", [u], perm=(3, 1, 2, 0, 4))  # .transpose(0, -2)
    u = b.op("Reshape", [u], shape=(2, *rows, E))  # .squeeze(-2)
    k, v = (b.op("Gather", [u, b.const(f"i{i}", np.array(i, np.int64))], axis=0) for i in (0, 1))

    def heads(t, last):  # [S, B, E] or [B, S, E] -> [B*H, S, D]
        if interleaved:  # head h owns columns h, h+H, ..
            t = b.op("Reshape", [t], shape=(*rows, D, H))
            t = b.op("Transpose", [t], perm=(1, 3, 0, 2) if seq_first else (0, 3, 1, 2))
            t = b.op("Reshape", [t], shape=(B * H, S, D))
        elif seq_first:  # torch's MultiheadAttention
            t = b.op("Transpose", [b.op("Reshape", [t], shape=(S, B * H, D))], perm=(1, 0, 2))
        else:
            t = b.op("Transpose", [b.op("Reshape", [t], shape=(B, S, H, D))], perm=(0, 2, 1, 3))
            t = b.op("Reshape", [t], shape=(B * H, S, D))
        return b.op("Transpose", [t], perm=(0, 2, 1)) if last else t

    q = b.const("q", _w(B * H, 1, D))  # the probe's projection, folded at export
    s = b.op("MatMul", [q, heads(k, True)])
    o = b.op("MatMul", [b.op("Softmax", [s], axis=-1), heads(v, False)])  # [B*H, 1, D]
    o = b.op("Reshape", [b.op("Transpose", [o], perm=(1, 0, 2))], shape=(B, E))  # [1, B*H, D] -> [L*B, E]
    o = b.op("Add", [b.op("MatMul", [o, b.const("w_o", _w(E, E))]), b.const("b_o", _w(E))])
    o = b.op("Transpose", [b.op("Reshape", [o], shape=(1, B, E))], perm=(1, 0, 2))  # [B, 1, E]
    b.output(b.op("Relu", [o]), "y")
    return b.build()


def _feeds():
    return {"x": RNG.standard_normal((B, S, E)).astype(np.float32)}


def _same(before, after):
    infer_types(after)
    feeds = _feeds()
    want, got = run(before, feeds), run(after, feeds)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_torch_mha_becomes_head_views_of_one_projection():
    g = _mha()
    f = canonicalize(g)
    _same(g, f)
    prod = f.producers()
    attn = next(n for n in f.nodes if n.op == "Attention")
    assert attn.inputs[0] in f.constants and f.types[attn.inputs[0]].shape == (B, H, 1, D)
    assert attn.attrs["scale"] == 1.0
    split = set()
    for x in attn.inputs[1:3]:
        tr = prod[x]
        rs = prod[tr.inputs[0]]
        assert (tr.op, tuple(tr.attrs["perm"]), rs.op, tuple(rs.attrs["shape"])) == \
            ("Transpose", HEAD_PERM, "Reshape", (B, S, H, D))
        split.add(prod[rs.inputs[0]].name)
        assert prod[rs.inputs[0]].op == "Split"
    assert len(split) == 1  # one Split of the one projection, as fuse_qkv makes for the zoo
    sp = next(n for n in f.nodes if n.op == "Split")
    assert prod[sp.inputs[0]].op == "Linear" and prod[sp.inputs[0]].inputs[0] == "x"  # batch-first: x itself
    # the output: Transpose + Reshape to [B, 1, E], read by the out-projection, whose output is the Relu's input
    users = f.consumers()
    tr = users[attn.outputs[0]][0]
    rs = users[tr.outputs[0]][0]
    out = users[rs.outputs[0]][0]
    assert (tr.op, tuple(tr.attrs["perm"]), rs.op, f.types[rs.outputs[0]].shape, out.op) == \
        ("Transpose", HEAD_PERM, "Reshape", (B, 1, E), "Linear")
    assert users[out.outputs[0]][0].op == "Relu"
    assert not any(n.op in ("Gather", "MatMul") for n in f.nodes)


def test_batch_first_heads_are_recognised_too():
    g = _mha(seq_first=False)
    f = canonicalize(g)
    _same(g, f)
    attn = next(n for n in f.nodes if n.op == "Attention")
    assert f.types[attn.outputs[0]].shape == (B, H, 1, D)
    assert sum(n.op == "Transpose" for n in f.nodes) == 3  # k's and v's head views and the merge


def test_interleaved_heads_are_not_a_head_view():
    g = _mha(interleaved=True)
    f = canonicalize(g)
    _same(g, f)
    attn = next(n for n in f.nodes if n.op == "Attention")
    assert f.types[attn.outputs[0]].shape == (1, B * H, 1, D)  # left as one sample of B*H heads
    assert any(n.op == "Gather" for n in f.nodes)


def test_a_projection_read_elsewhere_is_not_moved():
    g = _mha(kv_also_out=True)
    f = canonicalize(g)
    _same(g, f)
    assert sum(n.op == "Linear" for n in f.nodes) == 2  # the k/v projection once (not again on x), the out-projection
    attn = next(n for n in f.nodes if n.op == "Attention")
    assert f.types[attn.outputs[0]].shape == (1, B * H, 1, D)


@pytest.mark.parametrize("model", ["bert-tiny", "vit-tiny", "gpt2-tiny", "siglip-tiny"])
def test_zoo_attention_is_left_as_built(model):
    """The zoo's attention is already in the form: the pass leaves its nodes as they are (names included)."""
    from tremula.frontends import load_model
    from tremula.passes import FUSIONS, eliminate_dead_code, fold_constants
    from tremula.passes.fuse_heads import fuse_heads

    g = eliminate_dead_code(fold_constants(load_model(model, batch=2)))
    for fuse in FUSIONS[:-1]:
        g = fuse(g)
    g = fold_constants(g)
    f = fuse_heads(g)
    keep = [(n.op, n.name, tuple(n.inputs), tuple(n.outputs)) for n in g.nodes if n.op != "Attention"]
    assert [(n.op, n.name, tuple(n.inputs), tuple(n.outputs)) for n in f.nodes if n.op != "Attention"
            and not n.name.endswith(".q_scaled")] == keep

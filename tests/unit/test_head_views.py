"""Head views: attention reads q, k, v from the projections' [B*S, H*d] layouts and writes [B*S, H*dv] directly."""

import pytest

from tremula.compiler import compile_model
from tremula.frontends import load_model
from tremula.pipeline import lower_precision
from tremula.plan.head_views import head_views


@pytest.mark.parametrize("model", ["vit-tiny", "bert-tiny", "siglip-tiny", "gpt2-tiny"])
def test_head_views_replace_the_split_and_merge(model):
    g = lower_precision(load_model(model, batch=2), "float16")
    ins, outs, skip = head_views(g)
    attn = [n for n in g.nodes if n.op == "Attention"]
    assert attn and len(outs) == len(attn)
    for n in attn:
        for x in n.inputs[:3]:
            if x in g.constants:  # SigLIP's probe query: its projection folds to a constant, as with real weights
                assert model == "siglip-tiny" and x == n.inputs[0] and x not in ins
                continue
            hv = ins[x]
            b, h, s, d = g.types[x].shape
            assert (hv.heads, hv.seq, hv.dim) == (h, s, d)
            assert x in skip and hv.value not in skip  # the [B, H, S, d] value is never made; its source is
    producers = g.producers()
    assert all(producers[v].op in ("Reshape", "Transpose") for v in skip)


def test_no_head_split_steps_are_planned():
    res = compile_model("vit-tiny", "c600", 2, "fp16")
    g = res.graph
    _, _, skip = head_views(g)
    planned = set(res.strategies)
    # the nodes whose outputs are skipped get no strategy (no step); attention and the projections do
    assert not any(s in planned for s in {n.name for n in g.nodes if n.outputs[0] in skip} - {
        n.name for n in g.nodes if n.outputs[0] not in skip})
    assert any("attention, " in s for s in res.strategies.values())

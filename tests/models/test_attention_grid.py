"""An attention's query x key grid is chosen by its modelled cycles (plan/lower_attention.py `_key_blocks`), priced
without lowering it (`_grid_cycles`): on a ViT-B/16 layer at batch 8 in fp16 the keys split in blocks although a
head's K and V would fit whole, and the compiled Program is faster than with the keys whole."""

import dataclasses

import pytest

from tremula.compiler import compile_model
from tremula.frontends.zoo import ZOO
from tremula.models.build import build_from_config
from tremula.models.weights import LazyWeights
from tremula.plan import lower_attention
from tremula.target.chip import load_chip

@pytest.fixture(scope="module")
def one_layer_vit_b8():
    cfg = dataclasses.replace(ZOO["vit-base-patch16-224"].config, layers=1)
    return build_from_config("vit", cfg, LazyWeights(), batch=8, name="vit-base-1")


def _compiled(graph, monkeypatch, key_blocks=None):
    """The compile, and each encoder attention's (chosen key blocks, {key blocks: priced cycles}) when planned."""
    seen = []
    choose = lower_attention._key_blocks

    def spy(cx, node):
        nk = choose(cx, node) if key_blocks is None else key_blocks
        if "encoder" in node.name:
            _, _, _, _, _, _, (_, _, sk, _), _, bh = lower_attention._attention_operands(cx, node)
            seen.append((nk, {n: lower_attention._grid_cycles(cx, node, n) for n in range(1, min(sk, cx.T // bh) + 1)}))
        return nk

    monkeypatch.setattr(lower_attention, "_key_blocks", spy)
    res = compile_model(graph, load_chip("c600"), 8, "fp16")
    monkeypatch.setattr(lower_attention, "_key_blocks", choose)
    return res, seen


def test_the_grid_priced_cheapest_is_chosen_and_compiles_faster_than_whole_keys(one_layer_vit_b8, monkeypatch):
    chosen, seen = _compiled(one_layer_vit_b8, monkeypatch)
    assert seen
    for nk, priced in seen:
        # K and V of a head (197 x 128 halves) are within the memory rule, so 1 is a candidate; the cheapest is taken
        assert 1 in priced and priced[nk] == min(priced.values()) and nk > 1
    codelets = {g.codelet for s in chosen.program.steps for g in s.compute}
    assert {"attention_partial", "attention_combine"} <= codelets
    whole, _ = _compiled(one_layer_vit_b8, monkeypatch, key_blocks=1)
    assert "attention_partial" not in {g.codelet for s in whole.program.steps for g in s.compute}
    assert chosen.fits and whole.fits and chosen.cycles < whole.cycles


def test_the_memory_rule_still_bounds_the_grid(one_layer_vit_b8, monkeypatch):
    """With K and V of a head past the budget, the fewest key blocks the memory allows is the smallest candidate."""
    monkeypatch.setattr(lower_attention, "ATTENTION_KV_FRACTION", 0.01)  # 6.2 KiB: 197 keys x 128 halves in 8 blocks
    choose = lower_attention._key_blocks
    picked = []

    def spy(cx, node):
        nk = choose(cx, node)
        picked.append(nk)
        return nk

    monkeypatch.setattr(lower_attention, "_key_blocks", spy)
    compile_model(one_layer_vit_b8, load_chip("c600"), 8, "fp16", require_fit=False)
    assert picked and min(picked) >= 8

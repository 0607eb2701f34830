"""A matmul after a LayerNorm kept in place may cut K at the LayerNorm's column blocks or anywhere else: the planner
prices both and keeps the cheaper (plan/lower_linear.py lower_linear), and either way the Program computes the model."""

from dataclasses import replace

import pytest

from tremula.check import check_model
from tremula.compiler import compile_model
from tremula.target.chip import load_chip


@pytest.mark.parametrize("dtype", ["fp16", "fp8"])
def test_a_free_k_cut_after_a_layernorm_still_answers(monkeypatch, dtype):
    """Every K cut fixed at the operand's column blocks priced out of reach: the matmuls that read a LayerNorm's
    blocks take a free cut (whole source blocks no longer), and the check still passes."""
    import tremula.plan.lower_linear as lower_linear

    real = lower_linear.choose_linear
    fixed_seen = []

    def fixed_is_dear(chip, m, k, n, *args, pk_fix=0, **kwargs):
        st = real(chip, m, k, n, *args, pk_fix=pk_fix, **kwargs)
        if pk_fix:
            fixed_seen.append(pk_fix)
            return replace(st, cycles=10**9)
        return st

    plain = compile_model("bert-tiny", "c600", 2, dtype)
    monkeypatch.setattr(lower_linear, "choose_linear", fixed_is_dear)
    res = check_model("bert-tiny", "c600", 2, dtype)
    assert fixed_seen  # bert-tiny has such matmuls (the fused QKV, the out-projection's heads)
    assert res.passed, (res.outputs, res.matched)
    changed = [k for k, v in res.compile.strategies.items() if v.startswith("linear") and plain.strategies.get(k) != v]
    assert changed, "no Linear planned differently with its fixed cut priced out"


def test_bert_base_fused_qkv_made_whole_on_a_free_k_cut():
    """BERT-base fp16 batch 16 on a C600: each layer's LayerNorm keeps 12 column blocks. Cut at those, the fused QKV
    cost more whole than as three projections apart (~107 K against ~93 K cycles estimated), and it ran apart in
    layers 1-11; with a free K cut it is cheapest whole (~84 K), and every layer runs it so."""
    res = compile_model("bert-base-uncased", load_chip("c600"), 16, "fp16")
    qkv = {k: v for k, v in res.strategies.items() if k.endswith("attention.self.query.fused")}
    assert len(qkv) == 12
    assert all(v.startswith("linear") and " pk=12 " not in v for v in qkv.values()), qkv

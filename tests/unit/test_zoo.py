"""The zoo and the model builders: shapes, names, laziness, HF-style init, tiny configs mirroring big ones, errors."""

from __future__ import annotations

import numpy as np
import pytest

from tremula.errors import TremulaError
from tremula.frontends import load_model
from tremula.frontends.zoo import ZOO, build_zoo, zoo_rows
from tremula.ir.builder import GraphBuilder
from tremula.ir.interp import infer_types, run
from tremula.ir.ops import rule
from tremula.models.bert import extended_mask
from tremula.models.blocks import activation, patch_embed
from tremula.models.configs import BertConfig, VisionConfig
from tremula.models.weights import CheckpointWeights

SIBLING = {
    "vit-tiny": "vit-base-patch16-224",
    "siglip-tiny": "siglip-so400m-patch14-384",
    "clip-tiny": "clip-vit-base-patch32",
    "bert-tiny": "bert-base-uncased",
    "minilm-tiny": "all-minilm-l6-v2",
    "gpt2-tiny": "gpt2",
}


@pytest.mark.parametrize("name", list(ZOO))
def test_every_zoo_model_builds_with_consistent_types(name):
    g = build_zoo(name, batch=2)
    before = dict(g.types)
    infer_types(g)  # re-derives every type from the op rules and checks topological order
    assert g.types == before
    assert all(c.is_lazy for c in g.constants.values() if c.type.shape)
    out = g.types["last_hidden_state"]
    e = ZOO[name]
    if e.family in ("vit", "siglip", "clip"):
        assert out.shape == (2, e.config.tokens, e.config.hidden)
        assert g.types["pooler_output"].shape == (2, e.config.hidden)
    else:
        assert out.shape == (2, e.config.seq, e.config.hidden)
    assert ("pooler_output" in g.outputs) == (e.family != "gpt2")


def test_tiny_configs_exercise_the_same_code_paths():
    for tiny, big in SIBLING.items():
        assert ZOO[tiny].tiny and not ZOO[big].tiny and ZOO[tiny].family == ZOO[big].family
        gt, gb = build_zoo(tiny), build_zoo(big)
        assert gt.inputs == gb.inputs and gt.outputs == gb.outputs
        sig = lambda g: {(n.op, tuple(sorted((k, v) for k, v in n.attrs.items() if k in ("approximate", "causal"))))
                         for n in g.nodes}
        assert sig(gt) == sig(gb), tiny
        for attr in ("act", "eps", "family", "head", "pooler"):
            assert getattr(ZOO[tiny].config, attr, None) == getattr(ZOO[big].config, attr, None), (tiny, attr)


def test_constant_names_are_hf_names():
    g = build_zoo("bert-base-uncased")
    assert g.types["encoder.layer.11.attention.self.query.weight"].shape == (768, 768)  # [in, out]
    assert g.types["encoder.layer.0.intermediate.dense.weight"].shape == (768, 3072)
    assert "embeddings.word_embeddings.weight" in g.constants and "pooler.dense.bias" in g.constants
    s = build_zoo("siglip-so400m-patch14-384")
    assert s.types["head.probe"].shape == (1, 1, 1152)
    assert s.types["encoder.layers.26.mlp.fc1.weight"].shape == (1152, 4304)
    assert s.types["embeddings.patch_embedding.weight"].shape == (3 * 14 * 14, 1152)
    assert "h.11.attn.c_attn.weight" in build_zoo("gpt2").constants


def test_hf_style_init_and_determinism():
    g1, g2, g3 = build_zoo("bert-tiny"), build_zoo("bert-tiny"), build_zoo("bert-tiny", seed=1)
    for k, c in g1.constants.items():
        np.testing.assert_array_equal(c.value(), g2.constants[k].value())
    w = g1.constants["encoder.layer.0.intermediate.dense.weight"].value()
    assert abs(w.std() - 0.02) < 0.003 and abs(w.mean()) < 0.003
    assert not np.array_equal(w, g3.constants["encoder.layer.0.intermediate.dense.weight"].value())
    assert not np.array_equal(w, g1.constants["encoder.layer.1.intermediate.dense.weight"].value())
    np.testing.assert_array_equal(g1.constants["embeddings.LayerNorm.weight"].value(), 1)
    np.testing.assert_array_equal(g1.constants["encoder.layer.0.output.dense.bias"].value(), 0)


def test_seq_len_and_batch():
    g = build_zoo("bert-base-uncased", batch=3, seq_len=384)
    assert g.types["input_ids"].shape == (3, 384) and g.types["last_hidden_state"].shape == (3, 384, 768)
    assert build_zoo("vit-tiny", seq_len=5).types["pixel_values"].shape == (1, 3, 32, 32)  # ignored by vision
    with pytest.raises(TremulaError, match="sequence length 1025"):
        build_zoo("gpt2", seq_len=1025)
    with pytest.raises(TremulaError, match="batch"):
        build_zoo("gpt2-tiny", batch=0)


def test_load_model_dispatches_zoo_names():
    assert load_model("siglip-tiny", batch=2).types["pixel_values"].shape == (2, 3, 32, 32)
    with pytest.raises(TremulaError, match="unknown zoo model 'vit-huge'.*vit-tiny"):
        build_zoo("vit-huge")


def test_zoo_rows():
    rows = {r["name"]: r for r in zoo_rows()}
    assert set(rows) == set(ZOO)
    assert all(list(r) == ["name", "family", "params", "inputs"] for r in rows.values())
    assert rows["gpt2"]["params"] == 124_439_808  # GPT2Model's well-known parameter count
    assert rows["bert-base-uncased"]["params"] == build_zoo("bert-base-uncased").param_count()
    assert rows["siglip-so400m-patch14-384"]["inputs"] == "pixel_values float32[1,3,384,384]"
    assert "attention_mask int64[1,128]" in rows["all-minilm-l6-v2"]["inputs"]


def test_tiny_models_run_and_padding_is_masked():
    g = build_zoo("bert-tiny", batch=2)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, (2, 16))
    ids[1, :8] = ids[0, :8]
    mask = np.ones((2, 16), np.int64)
    mask[1, 8:] = 0
    types = np.zeros((2, 16), np.int64)
    out = run(g, {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})["last_hidden_state"]
    # Row 1 only sees its first 8 tokens, so those outputs equal a run on the 8-token prefix alone.
    g8 = build_zoo("bert-tiny", batch=1, seq_len=8)
    ref = run(g8, {"input_ids": ids[:1, :8], "attention_mask": mask[:1, :8], "token_type_ids": types[:1, :8]})
    np.testing.assert_allclose(out[1, :8], ref["last_hidden_state"][0], rtol=1e-5, atol=1e-6)


def test_gpt2_is_causal():
    g = build_zoo("gpt2-tiny")
    ids = np.random.default_rng(1).integers(0, 100, (1, 16))
    a = run(g, {"input_ids": ids})["last_hidden_state"]
    ids2 = ids.copy()
    ids2[0, 10:] = (ids2[0, 10:] + 1) % 100
    b = run(g, {"input_ids": ids2})["last_hidden_state"]
    np.testing.assert_array_equal(a[0, :10], b[0, :10])
    assert not np.allclose(a[0, 10:], b[0, 10:])


def test_quick_gelu_and_extended_mask():
    b = GraphBuilder("t")
    x = b.input("x", (5,))
    b.output(activation(b, x, "quick_gelu", "act"), "y")
    m = b.input("m", (1, 3), "int64")
    b.output(extended_mask(b, m), "mask")
    xs = np.linspace(-4, 4, 5, dtype=np.float32)
    out = run(b.build(), {"x": xs, "m": np.array([[1, 0, 1]])})
    np.testing.assert_allclose(out["y"], xs / (1 + np.exp(-1.702 * xs)), rtol=1e-6)
    assert out["mask"].shape == (1, 1, 1, 3)
    np.testing.assert_array_equal(out["mask"].ravel(), [0, np.finfo(np.float32).min, 0])


def test_patch_embedding_equals_conv():
    rng = np.random.default_rng(2)
    conv_w = rng.standard_normal((6, 3, 4, 4)).astype(np.float32)
    conv_b = rng.standard_normal(6).astype(np.float32)
    ckpt = {"pe.weight": conv_w, "pe.bias": conv_b}
    b = GraphBuilder("pe")
    x = b.input("x", (2, 3, 9, 8))  # 9 is not a multiple of 4: the last row of pixels is dropped, as Conv does
    b.output(patch_embed(b, CheckpointWeights(ckpt.get, "mem"), x, "pe", 3, 4, 6), "y")
    img = rng.standard_normal((2, 3, 9, 8)).astype(np.float32)
    y = run(b.build(), {"x": img})["y"]
    (ref,) = rule("Conv").ref([img, conv_w, conv_b], {"strides": (4, 4)})
    np.testing.assert_allclose(y, ref.reshape(2, 6, -1).transpose(0, 2, 1), rtol=1e-5, atol=1e-5)


def test_checkpoint_weight_errors():
    ckpt = {"a.weight": np.zeros((4, 3), np.float32)}
    w = CheckpointWeights(ckpt.get, "/ckpt")
    with pytest.raises(TremulaError, match="'b.weight' is missing from the checkpoint in /ckpt"):
        w.get(GraphBuilder("x"), "b.weight", (3, 4))
    with pytest.raises(TremulaError, match=r"has shape \[4, 3\], config.json implies \[5, 3\]"):
        w.get(GraphBuilder("x"), "a.weight", (3, 5), hf_shape=(5, 3))


def test_config_errors():
    with pytest.raises(TremulaError, match="not divisible"):
        BertConfig(100, 30, 1, 4, 64, 64, 16)
    with pytest.raises(TremulaError, match="unknown vision family"):
        VisionConfig("dino", 32, 1, 2, 64, 32, 8, 1e-6, "gelu")

"""HF checkpoint folders (random tiny transformers models as safetensors) → load_hf_folder → interpreter == torch."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: it reads this once
torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e .[torch])")
T = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[torch])")

from safetensors.numpy import load_file, save_file  # noqa: E402

from tremula.errors import TremulaError  # noqa: E402
from tremula.frontends import load_model  # noqa: E402
from tremula.frontends.hf import SUPPORTED, load_hf_folder  # noqa: E402
from tremula.frontends.zoo import ZOO, build_zoo  # noqa: E402
from tremula.ir.interp import run  # noqa: E402

_HF_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "quick_gelu": "quick_gelu"}


def hf_model_for(name: str, device: str = "cpu"):
    """The transformers model with the same architecture as zoo entry `name` (written out from its config here)."""
    e = ZOO[name]
    c = e.config
    with torch.device(device):
        if e.family in ("vit", "siglip", "clip"):
            kw = dict(hidden_size=c.hidden, num_hidden_layers=c.layers, num_attention_heads=c.heads,
                      intermediate_size=c.mlp, image_size=c.image, patch_size=c.patch, layer_norm_eps=c.eps,
                      hidden_act=_HF_ACT[c.act], num_channels=c.channels)
            if e.family == "vit":
                return T.ViTModel(T.ViTConfig(**kw, qkv_bias=c.qkv_bias), add_pooling_layer=c.head)
            if e.family == "siglip":
                return T.SiglipVisionModel(T.SiglipVisionConfig(**kw, vision_use_head=c.head))
            return T.CLIPVisionModel(T.CLIPVisionConfig(**kw))
        if e.family == "bert":
            cfg = T.BertConfig(vocab_size=c.vocab, hidden_size=c.hidden, num_hidden_layers=c.layers,
                               num_attention_heads=c.heads, intermediate_size=c.mlp,
                               max_position_embeddings=c.max_positions, type_vocab_size=c.type_vocab,
                               layer_norm_eps=c.eps, hidden_act=_HF_ACT[c.act])
            return T.BertModel(cfg, add_pooling_layer=c.pooler)
        cfg = T.GPT2Config(vocab_size=c.vocab, n_positions=c.max_positions, n_embd=c.hidden, n_layer=c.layers,
                           n_head=c.heads, n_inner=c.mlp, activation_function="gelu_new", layer_norm_epsilon=c.eps,
                           bos_token_id=0, eos_token_id=0)
        return T.GPT2Model(cfg)


def randomise(model, seed: int = 0) -> None:
    """Perturb every parameter (HF init leaves biases at 0 and LayerNorms at 1, which would hide layout bugs)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def feeds_for(name: str, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    e = ZOO[name]
    c = e.config
    if e.family in ("vit", "siglip", "clip"):
        return {"pixel_values": rng.standard_normal((batch, c.channels, c.image, c.image)).astype(np.float32)}
    ids = rng.integers(0, c.vocab, (batch, c.seq)).astype(np.int64)
    if e.family == "gpt2":
        return {"input_ids": ids}
    mask = np.ones((batch, c.seq), np.int64)
    mask[-1, c.seq // 2:] = 0  # padding in the last row exercises the additive mask
    types = np.zeros((batch, c.seq), np.int64)
    types[:, c.seq // 3:] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def torch_outputs(model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    res = {"last_hidden_state": out.last_hidden_state.numpy()}
    if getattr(out, "pooler_output", None) is not None:
        res["pooler_output"] = out.pooler_output.numpy()
    return res


def max_rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-30))


TINY = [n for n, e in ZOO.items() if e.tiny]


@pytest.mark.parametrize("name", TINY)
def test_checkpoint_matches_torch(name, tmp_path):
    model = hf_model_for(name)
    randomise(model)
    model.save_pretrained(tmp_path, safe_serialization=True)
    extra = {"add_pooling_layer": ZOO[name].config.pooler} if ZOO[name].family == "bert" else {}
    model = type(model).from_pretrained(tmp_path, attn_implementation="eager", **extra).eval()
    feeds = feeds_for(name, 2, np.random.default_rng(1))
    ref = torch_outputs(model, feeds)
    seq = getattr(ZOO[name].config, "seq", None)
    g = load_hf_folder(tmp_path, batch=2, seq_len=seq)
    assert all(not c.is_lazy for c in g.constants.values())
    out = run(g, feeds)
    assert set(ref) == set(g.outputs)
    for k in ref:
        assert out[k].shape == ref[k].shape
        assert max_rel_err(out[k], ref[k]) <= 1e-4, k


@pytest.mark.parametrize("name", TINY)
def test_checkpoint_plans_as_the_zoo_model(name, tmp_path):
    """Issue #14 item 7: a checkpoint folder plans exactly as the zoo model of its architecture does. The folder's
    weights are values and fold (a position table sliced to the sequence, a CLS token expanded over the batch, SigLIP's
    probe projected); the zoo's are lazy and used to stay nodes there, one step more. They now fold lazily
    (ir/graph.FoldInit), and the two compile to the same steps, cycles and memory."""
    from tremula.compiler import compile_model

    model = hf_model_for(name)
    randomise(model)
    model.save_pretrained(tmp_path, safe_serialization=True)
    seq = getattr(ZOO[name].config, "seq", None)
    zoo = compile_model(name, "c600", 2, "fp16")
    got = compile_model(lambda b: load_hf_folder(tmp_path, batch=b, seq_len=seq), "c600", 2, "fp16")

    def plan(r):
        return (r.steps, r.cycles, r.compute_cycles, r.exchange_cycles, r.sync_cycles, r.peak_tile_bytes,
                r.memory_by_category, r.shared_layers)

    assert plan(got) == plan(zoo)


def test_constant_names_are_checkpoint_names(tmp_path):
    model = hf_model_for("bert-tiny")
    model.save_pretrained(tmp_path)
    g = load_hf_folder(tmp_path)
    assert set(load_file(str(tmp_path / "model.safetensors"))) <= set(g.constants)
    w = g.constants["encoder.layer.0.attention.self.query.weight"]
    # nn.Linear [out, in] became [in, out] once, at load.
    ref = model.encoder.layer[0].attention.self.query.weight.detach().numpy()
    np.testing.assert_array_equal(w.value(), ref.T)
    # load_model dispatches a folder to the same frontend.
    g2 = load_model(str(tmp_path), batch=2, seq_len=8)
    assert g2.types["input_ids"].shape == (2, 8) and set(g2.constants) == set(g.constants)


@pytest.mark.parametrize("dual", ["siglip", "clip"])
def test_dual_encoder_checkpoint_uses_vision_tower(dual, tmp_path):
    """SiglipModel / CLIPModel checkpoints prefix the vision tower with `vision_model.` and carry a text tower."""
    if dual == "siglip":
        vis = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48, image_size=32,
                   patch_size=8)
        cfg = T.SiglipConfig(text_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                              intermediate_size=48, vocab_size=50), vision_config=vis)
        model = T.SiglipModel(cfg)
    else:
        vis = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
                   patch_size=8)
        cfg = T.CLIPConfig(text_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=64, vocab_size=50), vision_config=vis)
        model = T.CLIPModel(cfg)
    randomise(model, seed=3)
    model.save_pretrained(tmp_path)
    keys = load_file(str(tmp_path / "model.safetensors"))
    assert any(k.startswith("vision_model.") for k in keys) and any(k.startswith("text_model.") for k in keys)
    model = type(model).from_pretrained(tmp_path, attn_implementation="eager").eval()
    x = np.random.default_rng(2).standard_normal((1, 3, 32, 32)).astype(np.float32)
    ref = torch_outputs(model.vision_model, {"pixel_values": x})
    out = run(load_hf_folder(tmp_path), {"pixel_values": x})
    for k in ("last_hidden_state", "pooler_output"):
        assert max_rel_err(out[k], ref[k]) <= 1e-4, k


def test_sharded_and_prefixed_gpt2(tmp_path):
    """GPT2LMHeadModel keys carry `transformer.`; a small max_shard_size forces an index + several shards."""
    base = hf_model_for("gpt2-tiny")
    lm = T.GPT2LMHeadModel(base.config)
    randomise(lm, seed=4)
    lm.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    lm = T.GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    feeds = feeds_for("gpt2-tiny", 1, np.random.default_rng(5))
    ref = torch_outputs(lm.transformer, feeds)
    out = run(load_hf_folder(tmp_path, seq_len=16), feeds)
    assert max_rel_err(out["last_hidden_state"], ref["last_hidden_state"]) <= 1e-4


def test_bert_without_pooler(tmp_path):
    model = T.BertModel(hf_model_for("bert-tiny").config, add_pooling_layer=False)
    randomise(model, seed=6)
    model.save_pretrained(tmp_path)
    g = load_hf_folder(tmp_path, batch=2, seq_len=16)
    assert g.outputs == ["last_hidden_state"]
    feeds = feeds_for("bert-tiny", 2, np.random.default_rng(8))
    model = T.BertModel.from_pretrained(tmp_path, attn_implementation="eager", add_pooling_layer=False).eval()
    ref = torch_outputs(model, feeds)
    assert max_rel_err(run(g, feeds)["last_hidden_state"], ref["last_hidden_state"]) <= 1e-4


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_checkpoint_loads_as_float32(dtype, tmp_path):
    model = hf_model_for("gpt2-tiny")
    randomise(model, seed=9)
    model.to(getattr(torch, dtype)).save_pretrained(tmp_path)
    g = load_hf_folder(tmp_path)
    w = g.constants["h.1.mlp.c_fc.weight"].value()
    assert w.dtype == np.float32
    np.testing.assert_array_equal(w, model.h[1].mlp.c_fc.weight.detach().float().numpy())


def test_tf_style_layernorm_names_and_bert_prefix(tmp_path):
    """bert-base-uncased's own file keeps TensorFlow's LayerNorm.gamma/beta names under a `bert.` prefix."""
    model = hf_model_for("bert-tiny")
    randomise(model, seed=10)
    tensors = {}
    for k, v in model.state_dict().items():
        k = k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        tensors["bert." + k] = v.detach().numpy().copy()
    tensors["cls.predictions.bias"] = np.zeros(100, np.float32)  # an MLM head the loader must ignore
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model.config.to_json_file(str(tmp_path / "config.json"))
    model.config._attn_implementation = "eager"
    feeds = feeds_for("bert-tiny", 2, np.random.default_rng(12))
    ref = torch_outputs(model.eval(), feeds)
    out = run(load_hf_folder(tmp_path, batch=2, seq_len=16), feeds)
    for k in ("last_hidden_state", "pooler_output"):
        assert max_rel_err(out[k], ref[k]) <= 1e-4, k


def test_seq_len_override(tmp_path):
    hf_model_for("bert-tiny").save_pretrained(tmp_path)
    g = load_hf_folder(tmp_path, batch=3, seq_len=7)
    assert g.types["input_ids"].shape == (3, 7)
    assert g.types["last_hidden_state"].shape == (3, 7, 32)
    with pytest.raises(TremulaError, match="sequence length 65"):
        load_hf_folder(tmp_path, seq_len=65)


# ---------------------------------------------------------------------------------------------------- bad inputs


def test_missing_tensor_is_named(tmp_path):
    hf_model_for("vit-tiny").save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["encoder.layer.1.intermediate.dense.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(TremulaError) as e:
        load_hf_folder(tmp_path)
    msg = str(e.value)
    assert "encoder.layer.1.intermediate.dense.weight" in msg and str(tmp_path) in msg and "\n" not in msg


def test_unknown_model_type(tmp_path):
    hf_model_for("bert-tiny").save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TremulaError) as e:
        load_hf_folder(tmp_path)
    assert "'mamba'" in str(e.value) and all(s in str(e.value) for s in SUPPORTED)


def test_broken_config_json(tmp_path):
    hf_model_for("bert-tiny").save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "bert", ')
    with pytest.raises(TremulaError, match="not valid JSON"):
        load_hf_folder(tmp_path)


def test_truncated_safetensors(tmp_path):
    hf_model_for("bert-tiny").save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(TremulaError, match="cannot read"):
        load_hf_folder(tmp_path)


def test_index_shard_outside_folder(tmp_path):
    hf_model_for("gpt2-tiny").save_pretrained(tmp_path)
    index = {"weight_map": {"wte.weight": "../x.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(TremulaError, match="not a file there"):
        load_hf_folder(tmp_path)


def test_unknown_zoo_name():
    with pytest.raises(TremulaError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")
    with pytest.raises(TremulaError, match="unknown zoo model"):
        build_zoo("no-such-model")


# ---------------------------------------------------------------------------------------------------- big configs


@pytest.mark.parametrize("name", [n for n, e in ZOO.items() if not e.tiny])
def test_zoo_param_count_equals_transformers(name):
    """The zoo's full-size configs have exactly HF's parameter count (HF model built on the meta device: no memory)."""
    hf = hf_model_for(name, device="meta")
    assert build_zoo(name).param_count() == sum(p.numel() for p in hf.parameters())

"""Task-head checkpoints (GPT-2 LM, BERT sequence / token classification and masked LM, ViT / SigLIP / CLIP image
classification, CLIP's projection) load with their head and match transformers' forward pass; BERT without
token_type_ids matches transformers without it; DeiT and ELECTRA are refused with an ONNX route that works."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: it reads this once
torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e .[torch])")
T = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[torch])")

from safetensors.numpy import load_file  # noqa: E402

from tremula.errors import TremulaError, TremulaNotice  # noqa: E402
from tremula.frontends import load_model  # noqa: E402
from tremula.frontends.hf import load_hf_folder  # noqa: E402
from tremula.ir.interp import run  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::tremula.errors.TremulaNotice")

_TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
_VISION = dict(_TEXT, image_size=32, patch_size=8)
B, S = 2, 16


def _bert(cls, **kw):
    return cls(T.BertConfig(vocab_size=100, max_position_embeddings=64, **_TEXT, **kw))


def _gpt2(**kw):
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                          bos_token_id=0, eos_token_id=0, **kw))


def _dual(cls, **kw):
    return cls(cls.config_class(text_config=dict(_TEXT, vocab_size=50), vision_config=_VISION, **kw))


MODELS = {
    "gpt2-lm-tied": lambda: _gpt2(),
    "gpt2-lm-untied": lambda: _gpt2(tie_word_embeddings=False),
    "bert-seq-cls": lambda: _bert(T.BertForSequenceClassification, num_labels=3),
    "bert-token-cls": lambda: _bert(T.BertForTokenClassification, num_labels=5),
    "bert-mlm": lambda: _bert(T.BertForMaskedLM),
    "vit-image-cls": lambda: T.ViTForImageClassification(T.ViTConfig(num_labels=4, **_VISION)),
    "siglip-image-cls": lambda: _dual(T.SiglipForImageClassification, num_labels=3),
    "clip-image-cls": lambda: _dual(T.CLIPForImageClassification, num_labels=3),
    "clip-vision-projection": lambda: T.CLIPVisionModelWithProjection(T.CLIPVisionConfig(projection_dim=16,
                                                                                           **_VISION)),
    "clip-full": lambda: _dual(T.CLIPModel, projection_dim=16),
}


def _saved(name: str, tmp_path):
    """The model with every parameter perturbed (HF init hides layout bugs), saved and reloaded as eager."""
    torch.manual_seed(0)
    model = MODELS[name]()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return type(model).from_pretrained(tmp_path, attn_implementation="eager").eval()


def _feeds(name: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    if name.startswith(("vit", "siglip", "clip")):
        return {"pixel_values": rng.standard_normal((B, 3, 32, 32)).astype(np.float32)}
    ids = rng.integers(0, 100, (B, S)).astype(np.int64)
    if name.startswith("gpt2"):
        return {"input_ids": ids}
    mask = np.ones((B, S), np.int64)
    mask[-1, S // 2:] = 0  # padding in the last row
    return {"input_ids": ids, "attention_mask": mask}


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", list(MODELS))
def test_task_head_matches_transformers(name, tmp_path):
    model = _saved(name, tmp_path)
    feeds = _feeds(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = load_model(str(tmp_path), batch=B, seq_len=S)  # the CLI's route
    notes = [str(w.message) for w in caught if issubclass(w.category, TremulaNotice)]
    with torch.no_grad():
        tf = {k: torch.from_numpy(v) for k, v in feeds.items()}
        if name == "clip-full":  # CLIPModel.forward needs text; image_embeds before normalisation, as
            ref = model.visual_projection(model.vision_model(**tf).pooler_output)  # get_image_features computes
        else:
            out = model(**tf)
            ref = out.image_embeds if name == "clip-vision-projection" else out.logits
    key = "image_embeds" if name.startswith("clip-") and "cls" not in name else "logits"
    assert g.outputs[-1] == key  # the head adds its output after the base model's
    got = run(g, feeds)[key]
    assert got.shape == tuple(ref.shape)
    assert _rel(got, ref.numpy()) <= 1e-4
    if name == "clip-full":
        assert any("CLIPModel checkpoint: its text tower" in n and "not compiled" in n for n in notes), notes
    if name == "gpt2-lm-untied":  # the stored head really differs from wte, so the tie fallback was not taken
        t = load_file(str(tmp_path / "model.safetensors"))
        assert not np.array_equal(t["lm_head.weight"], t["transformer.wte.weight"])


def test_bert_token_types_optional_or_given(tmp_path):
    """Without token_type_ids (load_model) = transformers called without them; given (load_hf_folder's default
    keeps the input) = transformers called with them."""
    model = _saved("bert-seq-cls", tmp_path)
    feeds = _feeds("bert-seq-cls")
    types = np.zeros((B, S), np.int64)
    types[:, S // 3:] = 1
    with torch.no_grad():
        without = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()
        with_types = model(**{k: torch.from_numpy(v) for k, v in feeds.items()},
                           token_type_ids=torch.from_numpy(types)).logits.numpy()
    g = load_model(str(tmp_path), batch=B, seq_len=S)
    assert "token_type_ids" not in g.inputs
    assert _rel(run(g, feeds)["logits"], without) <= 1e-4
    full = load_hf_folder(tmp_path, batch=B, seq_len=S)
    assert _rel(run(full, {**feeds, "token_type_ids": types})["logits"], with_types) <= 1e-4
    assert _rel(with_types, without) > 1e-3  # the two really differ, so each comparison means something


@pytest.mark.parametrize("name", ["siglip-image-cls", "gpt2-lm-tied"])
def test_new_heads_compile_and_simulate(name, tmp_path):
    """The heads' ops (mean over tokens as Transpose + ReduceMean, the LM head) plan, lower and simulate."""
    from tremula.check import check_model

    _saved(name, tmp_path)
    res = check_model(str(tmp_path), "c600", 2, "fp32", seq_len=8)
    for o in res.outputs:
        assert o.passed, o


@pytest.mark.slow  # two dynamo exports, about 10 s each
@pytest.mark.parametrize("kind", ["deit", "electra"])
def test_unsupported_types_name_an_onnx_route_that_works(kind, tmp_path, monkeypatch):
    """The refusal's export line, run as written, gives an ONNX file tremula imports and that matches torch."""
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    from tremula.frontends.onnx_import import import_onnx

    torch.manual_seed(0)
    if kind == "deit":
        model = T.DeiTModel(T.DeiTConfig(**_VISION))
        feeds = {"pixel_values": torch.randn(B, 3, 32, 32)}
    else:
        model = T.ElectraModel(T.ElectraConfig(vocab_size=100, embedding_size=32, max_position_embeddings=64, **_TEXT))
        feeds = {"input_ids": torch.randint(0, 100, (B, 12)), "attention_mask": torch.ones(B, 12, dtype=torch.long)}
    folder = tmp_path / kind
    model.save_pretrained(folder, safe_serialization=True)
    with pytest.raises(TremulaError) as e:
        load_model(str(folder))
    msg = str(e.value)
    assert f"model_type '{kind}'" in msg and "\n" not in msg
    code = msg[msg.index("instead: ") + len("instead: "): msg.index("; then `tremula compile")]
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(code, {"torch": torch, "transformers": T})  # noqa: S102 - the message's own advice, run as written
    g = import_onnx(tmp_path / f"{kind}.onnx", batch=B, seq_len=12)
    with torch.no_grad():
        ref = model.eval()(**feeds).last_hidden_state.numpy()
    got = run(g, {k: v.numpy() for k, v in feeds.items()})[g.outputs[0]]
    assert got.shape == ref.shape and _rel(got, ref) <= 1e-4

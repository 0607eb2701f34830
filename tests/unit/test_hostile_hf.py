"""Hostile Hugging Face folders and weights (issue #11): every config field validated, deep JSON, NaN/Inf weights in
folders and ONNX initializers, task heads built or refused, token_type_ids optional, zoo names shadowed by paths.
Folders are written by hand (config.json + safetensors): no torch."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import load_file, save_file

from tremula.errors import TremulaError, TremulaNotice
from tremula.frontends import load_model
from tremula.frontends.hf import load_hf_folder
from tremula.ir.builder import GraphBuilder
from tremula.ir.interp import run
from tremula.models.build import build_from_config
from tremula.models.configs import BertConfig, GPT2Config, TaskHead, VisionConfig

# Notices are asserted where they matter (pytest.warns / quiet_load record them regardless of this filter).
pytestmark = pytest.mark.filterwarnings("ignore::tremula.errors.TremulaNotice")

# ------------------------------------------------------------------------------------------- folders written by hand

HF_CONFIG: dict[str, dict[str, Any]] = {
    "bert": dict(model_type="bert", vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=64, type_vocab_size=2),
    "gpt2": dict(model_type="gpt2", vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64),
    "vit": dict(model_type="vit", hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                image_size=32, patch_size=8),
    "siglip": dict(model_type="siglip_vision_model", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=64, image_size=32, patch_size=8),
}


def ir_config(family: str, task: TaskHead | None = None, pooler: bool = True) -> Any:
    """The tremula config that HF_CONFIG[family] describes (used only to list the checkpoint's tensors)."""
    if family == "bert":
        return BertConfig(100, 32, 2, 2, 64, 64, 16, pooler=pooler, task=task)
    if family == "gpt2":
        return GPT2Config(100, 32, 2, 2, 128, 64, 16, task=task)
    act = "gelu" if family == "vit" else "gelu_tanh"
    return VisionConfig(family, 32, 2, 2, 64, 32, 8, 1e-6, act, head=pooler, task=task)


class _Shapes:
    """A weight source noting which checkpoint tensor (name, shape) each weight is read from."""

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}

    def get(self, b: GraphBuilder, name: str, shape: tuple[int, ...], *, init: str = "normal",
            hf_name: str | None = None, hf_shape: tuple[int, ...] | None = None, to_ir: Any = None) -> str:
        self.shapes[hf_name or name] = tuple(hf_shape or shape)
        return b.param(name, tuple(shape), kind=init)


def write_folder(path: Path, family: str, *, task: TaskHead | None = None, pooler: bool = True,
                 config: dict[str, Any] | None = None, drop: tuple[str, ...] = (),
                 extra: dict[str, np.ndarray] | None = None, seed: int = 0) -> Path:
    """A checkpoint folder for HF_CONFIG[family] (updated with `config`) with seeded random weights."""
    rec = _Shapes()
    build_from_config(family, ir_config(family, task, pooler), rec)
    rng = np.random.default_rng(seed)
    tensors = {k: (rng.standard_normal(s) * 0.2).astype(np.float32) for k, s in rec.shapes.items() if k not in drop}
    tensors.update(extra or {})
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**HF_CONFIG[family], **(config or {})}))
    return path


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg == msg.strip(), msg
    return msg


def quiet_load(spec: str, **kw: Any) -> tuple[Any, list[str]]:
    """load_model, returning the graph and the notices it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = load_model(spec, **kw)
    return g, [str(w.message) for w in caught if issubclass(w.category, TremulaNotice)]


# --------------------------------------------------------------------------------------- case 4: every config field

BAD_FIELDS = [
    # (family, field, value, what the message says it must be)
    ("bert", "num_hidden_layers", -1, "positive integer"),
    ("bert", "num_hidden_layers", 0, "positive integer"),
    ("bert", "num_hidden_layers", 1.7, "positive integer"),
    ("bert", "num_hidden_layers", 2.0, "positive integer"),  # JSON integers only, as transformers needs
    ("bert", "num_hidden_layers", "2", "positive integer"),
    ("bert", "num_hidden_layers", True, "positive integer"),
    ("bert", "num_hidden_layers", None, "positive integer"),
    ("bert", "hidden_size", 32.0, "positive integer"),
    ("bert", "num_attention_heads", 0, "positive integer"),
    ("bert", "intermediate_size", -64, "positive integer"),
    ("bert", "vocab_size", 0, "positive integer"),
    ("bert", "max_position_embeddings", 1e400, "positive integer"),  # JSON's 1e400 is float inf
    ("bert", "type_vocab_size", [2], "positive integer"),
    ("bert", "layer_norm_eps", -1, "positive finite number"),
    ("bert", "layer_norm_eps", 0, "positive finite number"),
    ("bert", "layer_norm_eps", float("nan"), "positive finite number"),
    ("bert", "layer_norm_eps", float("inf"), "positive finite number"),
    ("bert", "layer_norm_eps", "1e-12", "positive finite number"),
    ("bert", "hidden_act", "swish", "one of"),
    ("bert", "hidden_act", {"name": "gelu"}, "one of"),
    ("bert", "is_decoder", "no", "true or false"),
    ("gpt2", "n_layer", -1, "positive integer"),
    ("gpt2", "n_positions", -5, "positive integer"),
    ("gpt2", "n_inner", 0, "positive integer"),
    ("gpt2", "layer_norm_epsilon", None, "positive finite number"),
    ("gpt2", "scale_attn_weights", 1, "true or false"),
    ("gpt2", "activation_function", "mish", "one of"),
    ("gpt2", "tie_word_embeddings", "yes", "true or false"),
    ("vit", "image_size", 0, "positive integer"),
    ("vit", "image_size", [32, 16], "square"),
    ("vit", "patch_size", 8.0, "positive integer"),
    ("vit", "num_channels", 0, "positive integer"),
    ("vit", "qkv_bias", "no", "true or false"),
    ("siglip", "num_hidden_layers", 0, "positive integer"),
    ("siglip", "vision_use_head", None, "true or false"),
    ("bert", "architectures", "BertModel", "list of class names"),
]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("good")
    return {f: write_folder(base / f, f) for f in HF_CONFIG}


def _variant(good: dict[str, Path], tmp_path: Path, family: str, **fields: Any) -> Path:
    d = tmp_path / f"{family}_variant"
    shutil.copytree(good[family], d)
    cfg = {**json.loads((d / "config.json").read_text()), **fields}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("family,field,value,must", BAD_FIELDS)
def test_every_config_field_is_validated(good, tmp_path, family, field, value, must):
    d = _variant(good, tmp_path, family, **{field: value})
    with pytest.raises(TremulaError) as e:
        load_hf_folder(d)
    msg = one_line(e)
    assert f"{field} must be" in msg and must in msg and str(d / "config.json") in msg, msg


def test_nested_vision_config_fields_are_named_with_their_scope(good, tmp_path):
    """A SiglipModel-style config keeps the tower's fields under vision_config: the message says so."""
    d = tmp_path / "dual"
    d.mkdir()
    tensors = {f"vision_model.{k}": v for k, v in load_file(str(good["siglip"] / "model.safetensors")).items()}
    save_file(tensors, str(d / "model.safetensors"))
    vis = {k: v for k, v in HF_CONFIG["siglip"].items() if k != "model_type"}
    (d / "config.json").write_text(json.dumps({"model_type": "siglip", "vision_config": {**vis, "hidden_size": -3}}))
    with pytest.raises(TremulaError, match=r"vision_config\.hidden_size must be a positive integer, got -3"):
        load_hf_folder(d)


@pytest.mark.parametrize("family,fields,match", [
    ("bert", dict(num_attention_heads=3), "hidden_size 32 is not divisible by num_attention_heads 3"),
    ("gpt2", dict(n_head=5), "n_embd 32 is not divisible by n_head 5"),
    ("vit", dict(patch_size=64), "patch_size 64 is larger than image_size 32"),
])
def test_size_relations_are_checked_with_the_file(good, tmp_path, family, fields, match):
    d = _variant(good, tmp_path, family, **fields)
    with pytest.raises(TremulaError, match=match) as e:
        load_hf_folder(d)
    assert str(d / "config.json") in one_line(e)


def test_valid_fields_still_load(good, tmp_path):
    """Square pairs, integer eps and n_inner null are what transformers writes; they load."""
    d = _variant(good, tmp_path, "vit", image_size=[32, 32], patch_size=[8, 8], layer_norm_eps=1)
    assert load_hf_folder(d).types["pixel_values"].shape == (1, 3, 32, 32)
    d = _variant(good, tmp_path, "gpt2", n_inner=None, layer_norm_epsilon=1)
    with pytest.raises(TremulaError, match="shape"):  # null is 4 * n_embd = 128: the checkpoint's fc is 128 wide
        load_hf_folder(_variant(good, tmp_path / "x", "gpt2", n_inner=64))
    assert load_hf_folder(d).types["h.0.mlp.c_fc.weight"].shape == (32, 128)


# ---------------------------------------------------------------------------------------------- case 5: deep JSON


@pytest.mark.parametrize("text", [
    "[" * 200_000 + "]" * 200_000,
    '{"a":' * 200_000 + "1" + "}" * 200_000,
    '{"model_type": "bert", "hidden_size": ' + "9" * 10_000 + "}",  # longer than Python's int-parsing limit
    '{"model_type": "bert", ',
])
def test_hostile_config_json_is_one_line(good, tmp_path, text):
    d = _variant(good, tmp_path, "bert")
    (d / "config.json").write_text(text)
    with pytest.raises(TremulaError, match="config.json") as e:
        load_model(str(d))
    one_line(e)


def test_config_json_not_utf8_and_deep_index(good, tmp_path):
    d = _variant(good, tmp_path, "bert")
    (d / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')
    with pytest.raises(TremulaError, match="not valid JSON") as e:
        load_model(str(d))
    one_line(e)
    d = _variant(good, tmp_path / "idx", "bert")
    (d / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TremulaError, match="nested too deeply") as e:
        load_model(str(d))
    one_line(e)


# ------------------------------------------------------------------------------------- case 3: unsupported types


@pytest.mark.parametrize("config,cls,example", [
    (dict(model_type="deit", architectures=["DeiTForImageClassificationWithTeacher"], image_size=224, patch_size=16,
          num_channels=3), "transformers.DeiTForImageClassificationWithTeacher", "torch.randn(1, 3, 224, 224)"),
    (dict(model_type="electra", architectures=["ElectraModel"], max_position_embeddings=512),
     "transformers.ElectraModel", "'input_ids': torch.ones(1, 128, dtype=torch.long)"),
    (dict(model_type="mamba"), "transformers.AutoModel", "'input_ids'"),
    (dict(model_type=["bert"]), "transformers.AutoModel", "'input_ids'"),
])
def test_unsupported_model_type_points_to_the_onnx_route(tmp_path, config, cls, example):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TremulaError) as e:
        load_model(str(tmp_path))
    msg = one_line(e)
    assert "is not built by the Hugging Face frontend" in msg
    assert f"{cls}.from_pretrained({str(tmp_path)!r})" in msg and example in msg, msg
    assert "torch.onnx.export(model, (), " in msg and "dynamic_axes=" in msg and "tremula compile " in msg
    assert f"{tmp_path.name}.onnx" in msg


@pytest.mark.parametrize("family,arch", [
    ("bert", "BertForQuestionAnswering"),
    ("bert", "BertForPreTraining"),
    ("gpt2", "GPT2ForSequenceClassification"),
    ("gpt2", "GPT2DoubleHeadsModel"),
    ("vit", "ViTForMaskedImageModeling"),
])
def test_heads_it_cannot_build_are_refused_by_name(good, tmp_path, family, arch):
    d = _variant(good, tmp_path, family, architectures=[arch])
    with pytest.raises(TremulaError) as e:
        load_model(str(d))
    msg = one_line(e)
    assert f"architecture {arch!r}" in msg and f"transformers.{arch}.from_pretrained" in msg
    assert "torch.onnx.export" in msg


# -------------------------------------------------------------------------------------------- case 1: task heads


def test_lm_head_is_tied_to_wte_unless_stored(tmp_path):
    lm = TaskHead("lm", 100)
    tied = write_folder(tmp_path / "tied", "gpt2", task=lm, drop=("lm_head.weight",),
                        config=dict(architectures=["GPT2LMHeadModel"]))
    g = load_hf_folder(tied, seq_len=8)
    assert g.outputs == ["last_hidden_state", "logits"] and g.types["logits"].shape == (1, 8, 100)
    ids = np.arange(8, dtype=np.int64)[None] * 7
    out = run(g, {"input_ids": ids})
    wte = load_file(str(tied / "model.safetensors"))["wte.weight"]
    np.testing.assert_allclose(out["logits"], out["last_hidden_state"] @ wte.T, rtol=1e-5, atol=1e-5)

    untied = write_folder(tmp_path / "untied", "gpt2", task=lm, config=dict(tie_word_embeddings=False,
                                                                              architectures=["GPT2LMHeadModel"]))
    head = load_file(str(untied / "model.safetensors"))["lm_head.weight"]
    out = run(load_hf_folder(untied, seq_len=8), {"input_ids": ids})
    np.testing.assert_allclose(out["logits"], out["last_hidden_state"] @ head.T, rtol=1e-5, atol=1e-5)
    # Untied and missing: nothing to fall back on, and the message names the tensor.
    gone = write_folder(tmp_path / "gone", "gpt2", task=lm, drop=("lm_head.weight",),
                        config=dict(tie_word_embeddings=False, architectures=["GPT2LMHeadModel"]))
    with pytest.raises(TremulaError, match="'lm_head.weight' is missing"):
        load_hf_folder(gone)


def test_heads_without_architectures_come_from_the_tensors(tmp_path):
    """No `architectures`: classifier + pooler is sequence classification, classifier alone token classification
    (transformers' token classifier has no pooler), a stored lm_head an LM head; a tied one is invisible."""
    seq = write_folder(tmp_path / "seq", "bert", task=TaskHead("seq_cls", 3),
                       config=dict(id2label={"0": "a", "1": "b", "2": "c"}))
    assert load_hf_folder(seq, seq_len=8).types["logits"].shape == (1, 3)
    tok = write_folder(tmp_path / "tok", "bert", pooler=False, task=TaskHead("token_cls", 5),
                       config=dict(id2label={str(i): str(i) for i in range(5)}))
    assert load_hf_folder(tok, seq_len=8).types["logits"].shape == (1, 8, 5)
    mlm = write_folder(tmp_path / "mlm", "bert", pooler=False, task=TaskHead("mlm", 100),
                       drop=("cls.predictions.decoder.weight",))
    assert load_hf_folder(mlm, seq_len=8).types["logits"].shape == (1, 8, 100)
    base = write_folder(tmp_path / "base", "gpt2")
    assert load_hf_folder(base).outputs == ["last_hidden_state"]
    vit = write_folder(tmp_path / "vit", "vit", pooler=False, task=TaskHead("image_cls", 2))
    assert load_hf_folder(vit).types["logits"].shape == (1, 2)
    sig = write_folder(tmp_path / "sig", "siglip", task=TaskHead("image_cls_mean", 4), config=dict(num_labels=4))
    assert load_hf_folder(sig).outputs == ["last_hidden_state", "pooler_output", "logits"]


def test_unused_tensors_are_never_silent(good, tmp_path):
    """architectures says BertModel but a classifier is stored: the base model, and a notice naming what is left."""
    d = write_folder(tmp_path / "b", "bert", extra={"classifier.weight": np.zeros((2, 32), np.float32),
                                                    "embeddings.position_ids": np.arange(64)[None]},
                     config=dict(architectures=["BertModel"]))
    with pytest.warns(TremulaNotice, match=r"1 tensor\(s\) .* not used .*architectures is BertModel.*: "
                                           r"classifier.weight$"):
        g = load_hf_folder(d)
    assert "logits" not in g.outputs
    with warnings.catch_warnings(record=True) as caught:  # a clean folder: no notice at all
        warnings.simplefilter("always")
        load_hf_folder(good["vit"])
    assert not caught


# ------------------------------------------------------------------------------------- case 2: token_type_ids


def test_token_type_ids_is_optional_for_hf_folders(good):
    g, notes = quiet_load(str(good["bert"]), batch=2, seq_len=8)
    assert g.inputs == ["input_ids", "attention_mask"]
    assert any("token_type_ids is not an input" in n for n in notes)
    full = load_hf_folder(good["bert"], batch=2, seq_len=8, token_type_ids=True)
    assert full.inputs == ["input_ids", "attention_mask", "token_type_ids"]
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 100, (2, 8)), "attention_mask": np.ones((2, 8), np.int64)}
    feeds["attention_mask"][1, 5:] = 0
    ours = run(g, feeds)
    ref = run(full, {**feeds, "token_type_ids": np.zeros((2, 8), np.int64)})  # type 0 everywhere
    for k in ref:
        np.testing.assert_allclose(ours[k], ref[k], rtol=1e-6, atol=1e-6)
    # The zoo's BERT does not change.
    zoo, notes = quiet_load("bert-tiny")
    assert zoo.inputs == ["input_ids", "attention_mask", "token_type_ids"] and not notes


# ------------------------------------------------------------------------------------------- case 6: NaN / Inf


@pytest.mark.parametrize("name,value,what", [
    ("encoder.layer.0.attention.self.query.weight", np.nan, "NaN"),
    ("encoder.layer.1.output.dense.bias", np.inf, "infinite"),
    ("embeddings.LayerNorm.weight", -np.inf, "infinite"),
    ("embeddings.word_embeddings.weight", np.nan, "NaN"),
    ("embeddings.word_embeddings.weight", -np.inf, "infinite"),  # a Gather table is a parameter too
])
def test_nonfinite_checkpoint_weights_are_refused_by_name(good, tmp_path, name, value, what):
    d = _variant(good, tmp_path, "bert")
    tensors = load_file(str(d / "model.safetensors"))
    tensors[name].reshape(-1)[3] = value
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(TremulaError) as e:
        load_model(str(d))
    msg = one_line(e)
    assert f"weight {name!r}" in msg and f"1 {what} value" in msg and str(d) in msg, msg


def _onnx(tmp_path: Path, w: np.ndarray, bias: np.ndarray, mask: np.ndarray, fill: float) -> str:
    """y = Where(mask_bool, x @ w + bias + mask, fill): a weight, a bias, an additive mask and a Where fill."""
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "bias"),
             numpy_helper.from_array(mask, "mask"), numpy_helper.from_array(np.array(fill, np.float32), "fill"),
             numpy_helper.from_array(np.tril(np.ones((4, 4), bool)), "keep")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "bias"], ["h"]),
             helper.make_node("Add", ["h", "mask"], ["m"]), helper.make_node("Where", ["keep", "m", "fill"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    return str(path)


def test_onnx_initializers_nan_inf_but_masks_allowed(tmp_path):
    w, b = np.eye(4, dtype=np.float32), np.zeros(4, np.float32)
    causal = np.triu(np.full((4, 4), -np.inf, np.float32), 1)  # what exporters put in a causal mask
    g = load_model(_onnx(tmp_path, w, b, causal, float(np.finfo(np.float32).min)))
    out = run(g, {"x": np.ones((1, 4, 4), np.float32)})["y"]
    assert np.isfinite(out).all()
    assert load_model(_onnx(tmp_path, w, b, causal, -np.inf)).outputs  # -inf as a Where fill is a mask too
    bad_w = w.copy()
    bad_w[1, 2] = np.inf
    with pytest.raises(TremulaError, match=r"weight 'w' of .* has 1 infinite value"):
        load_model(_onnx(tmp_path, bad_w, b, causal, 0.0))
    bad_b = b.copy()
    bad_b[0] = -np.inf
    with pytest.raises(TremulaError, match=r"weight 'bias' of .* has 1 infinite value"):
        load_model(_onnx(tmp_path, w, bad_b, causal, 0.0))
    nan_mask = causal.copy()
    nan_mask[0, 0] = np.nan
    with pytest.raises(TremulaError, match=r"weight 'mask' of .* has 1 NaN value"):  # NaN is refused anywhere
        load_model(_onnx(tmp_path, w, b, nan_mask, 0.0))


def test_zoo_weights_stay_lazy_through_the_check():
    g = load_model("bert-base-uncased")
    assert all(c.is_lazy for c in g.constants.values() if c.type.shape)


# ---------------------------------------------------------------------------------------- case 7: zoo shadowing


def test_zoo_name_shadowed_by_a_path(tmp_path, monkeypatch):
    """A bare zoo name is the zoo model unless a checkpoint folder of that name is here (what save_pretrained("gpt2")
    makes): then the folder. Either way a notice says which was used; zoo:NAME and ./NAME choose explicitly."""
    monkeypatch.chdir(tmp_path)
    write_folder(tmp_path / "gpt2-tiny", "gpt2")  # 64 positions: its default sequence is 64, the zoo's 16
    g, notes = quiet_load("gpt2-tiny")
    assert g.types["input_ids"].shape == (1, 64) and not any(c.is_lazy for c in g.constants.values())
    assert len(notes) == 1 and "using the folder ./gpt2-tiny" in notes[0] and "zoo:gpt2-tiny" in notes[0]
    g, notes = quiet_load("zoo:gpt2-tiny")
    assert g.types["input_ids"].shape == (1, 16) and not notes
    assert all(c.is_lazy for c in g.constants.values() if c.type.shape)
    g, notes = quiet_load("./gpt2-tiny")
    assert g.types["input_ids"].shape == (1, 64) and not notes

    (tmp_path / "bert-tiny").mkdir()  # an unrelated folder (no config.json) does not hide the zoo model
    g, notes = quiet_load("bert-tiny")
    assert all(c.is_lazy for c in g.constants.values() if c.type.shape) and "using the zoo model" in notes[0]
    (tmp_path / "vit-tiny").write_text("not a model")
    g, notes = quiet_load("vit-tiny")
    assert g.inputs == ["pixel_values"] and "a file here; using the zoo model (write ./vit-tiny" in notes[0]
    with pytest.raises(TremulaError, match="unknown zoo model 'nope'"):
        load_model("zoo:nope")
    with pytest.raises(TremulaError, match="unknown model 'nope'"):
        load_model("nope")

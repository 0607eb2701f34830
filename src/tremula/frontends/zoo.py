"""The built-in model zoo: named architectures built offline with seeded, lazy random weights (HF-style init)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tremula.errors import TremulaError, notice
from tremula.ir.graph import Graph
from tremula.models.build import ModelConfig, build_from_config
from tremula.models.configs import BertConfig, GPT2Config, VisionConfig
from tremula.models.weights import LazyWeights


@dataclass(frozen=True)
class ZooEntry:
    name: str
    family: str  # vit | siglip | clip | bert | gpt2
    config: ModelConfig
    tiny: bool = False  # a small test config standing in for a big sibling


def _vision(family: str, hidden, layers, heads, mlp, image, patch, eps, act, head=True) -> VisionConfig:
    return VisionConfig(family, hidden, layers, heads, mlp, image, patch, eps, act, head=head)


_ENTRIES = [
    ZooEntry("siglip-so400m-patch14-384", "siglip", _vision("siglip", 1152, 27, 16, 4304, 384, 14, 1e-6, "gelu_tanh")),
    ZooEntry("siglip-base-patch16-224", "siglip", _vision("siglip", 768, 12, 12, 3072, 224, 16, 1e-6, "gelu_tanh")),
    ZooEntry("vit-base-patch16-224", "vit", _vision("vit", 768, 12, 12, 3072, 224, 16, 1e-12, "gelu")),
    ZooEntry("clip-vit-base-patch32", "clip", _vision("clip", 768, 12, 12, 3072, 224, 32, 1e-5, "quick_gelu")),
    ZooEntry("bert-base-uncased", "bert", BertConfig(30522, 768, 12, 12, 3072, 512, 128)),
    ZooEntry("all-minilm-l6-v2", "bert", BertConfig(30522, 384, 6, 12, 1536, 512, 128)),
    ZooEntry("gpt2", "gpt2", GPT2Config(50257, 768, 12, 12, 3072, 1024, 128)),
    # Bigger than one C600 in fp16 (issue #15): 774M and 632M parameters, 1.5 GB and 1.3 GB of fp16 weights.
    ZooEntry("gpt2-large", "gpt2", GPT2Config(50257, 1280, 36, 20, 5120, 1024, 128)),
    ZooEntry("vit-huge-patch14-224", "vit", _vision("vit", 1280, 32, 16, 5120, 224, 14, 1e-12, "gelu")),
    # Tiny siblings: same code paths (CLS/probe head, pooler, masks, causal), small enough to interpret in ms.
    ZooEntry("vit-tiny", "vit", _vision("vit", 32, 2, 2, 64, 32, 8, 1e-12, "gelu"), tiny=True),
    ZooEntry("siglip-tiny", "siglip", _vision("siglip", 32, 2, 4, 48, 32, 8, 1e-6, "gelu_tanh"), tiny=True),
    ZooEntry("clip-tiny", "clip", _vision("clip", 32, 2, 2, 64, 32, 8, 1e-5, "quick_gelu"), tiny=True),
    ZooEntry("bert-tiny", "bert", BertConfig(100, 32, 2, 2, 64, 64, 16), tiny=True),
    ZooEntry("minilm-tiny", "bert", BertConfig(100, 48, 2, 4, 96, 64, 16), tiny=True),
    ZooEntry("gpt2-tiny", "gpt2", GPT2Config(100, 32, 2, 2, 128, 64, 16), tiny=True),
]
ZOO: dict[str, ZooEntry] = {e.name: e for e in _ENTRIES}


def build_zoo(name: str, batch: int = 1, seq_len: int | None = None, seed: int = 0) -> Graph:
    """A zoo model with lazy seeded weights: std 0.02 normal matrices, LayerNorm ones/zeros, zero biases."""
    entry = ZOO.get(name)
    if entry is None:
        raise TremulaError(f"unknown zoo model {name!r}; known: {', '.join(ZOO)}")
    return build_from_config(entry.family, entry.config, LazyWeights(), batch=batch, seq_len=seq_len, name=name,
                             seed=seed)


ZOO_PREFIX = "zoo:"  # `zoo:gpt2` always means the zoo model, whatever is in the working directory


def zoo_choice(spec: str) -> str | None:
    """The zoo model `spec` means, or None when it means a path.

    A bare zoo name is the zoo model, unless a checkpoint folder of that name (one with config.json, what
    `save_pretrained("gpt2")` makes) is in the working directory: then the folder, which the user most likely just
    saved. Whenever a path and a zoo model share the name, a notice says which one was used and how to ask for the
    other (`zoo:NAME`, `./NAME`)."""
    if spec.startswith(ZOO_PREFIX):
        name = spec[len(ZOO_PREFIX):]
        if name not in ZOO:
            raise TremulaError(f"unknown zoo model {name!r}; known: {', '.join(ZOO)}")
        return name
    if spec not in ZOO:
        return None
    path = Path(spec)
    if not (path.exists() or path.is_symlink()):
        return spec
    if path.is_dir() and (path / "config.json").is_file():
        notice(f"{spec!r} is a zoo model and a checkpoint folder here; using the folder ./{spec} "
               f"(write {ZOO_PREFIX}{spec} for the zoo model)")
        return None
    what = "folder without config.json" if path.is_dir() else "file"
    notice(f"{spec!r} is a zoo model and a {what} here; using the zoo model (write ./{spec} for the {what})")
    return spec


def zoo_rows() -> list[dict[str, str | int]]:
    """One row per zoo model for `tremula zoo`: name, family, params, default input shapes (weights stay lazy)."""
    rows: list[dict[str, str | int]] = []
    for e in ZOO.values():
        g = build_zoo(e.name)
        ins = ", ".join(f"{i} {g.types[i]}" for i in g.inputs)
        rows.append({"name": e.name, "family": e.family, "params": g.param_count(), "inputs": ins})
    return rows

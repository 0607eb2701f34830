"""One entry point over the architecture builders: (family, config, weight source) → Graph."""

from __future__ import annotations

from typing import Callable

from tremula.errors import TremulaError
from tremula.ir.graph import Graph
from tremula.models.bert import build_bert
from tremula.models.clip import build_clip
from tremula.models.configs import BertConfig, GPT2Config, VisionConfig
from tremula.models.gpt2 import build_gpt2
from tremula.models.siglip import build_siglip
from tremula.models.vit import build_vit
from tremula.models.weights import WeightSource

ModelConfig = VisionConfig | BertConfig | GPT2Config
FAMILIES = ("vit", "siglip", "clip", "bert", "gpt2")


def build_from_config(family: str, cfg: ModelConfig, w: WeightSource, batch: int = 1, seq_len: int | None = None,
                      name: str = "model", seed: int = 0, token_type_ids: bool = True) -> Graph:
    """One architecture builder per family; `seq_len` only concerns text models (vision input sizes are fixed).
    `token_type_ids=False` builds BERT without that input (every token of type 0, as transformers does without it)."""
    if batch < 1:
        raise TremulaError(f"batch must be >= 1, got {batch}")
    builders: dict[str, Callable[..., Graph]] = {"vit": build_vit, "siglip": build_siglip, "clip": build_clip}
    if family in builders:
        return builders[family](cfg, w, batch=batch, name=name, seed=seed)
    if family == "bert":
        return build_bert(cfg, w, batch=batch, seq_len=seq_len, name=name, seed=seed,  # type: ignore[arg-type]
                          token_type_ids=token_type_ids)
    if family == "gpt2":
        return build_gpt2(cfg, w, batch=batch, seq_len=seq_len, name=name, seed=seed)  # type: ignore[arg-type]
    raise TremulaError(f"unknown model family {family!r}")

"""CLIP vision tower (CLIPVisionModel): CLS, pre_layrnorm before the encoder, quick_gelu, post-LN on the CLS only."""

from __future__ import annotations

from tremula.ir.builder import GraphBuilder
from tremula.ir.graph import Graph
from tremula.models.blocks import first_token, layer_norm, patch_embed, pre_ln_layer, prepend
from tremula.models.configs import VisionConfig
from tremula.models.heads import check_head, vision_head
from tremula.models.vision import CLIP_LAYER, pixel_input
from tremula.models.weights import WeightSource


def build_clip(cfg: VisionConfig, w: WeightSource, batch: int = 1, name: str = "clip", seed: int = 0) -> Graph:
    check_head("clip", cfg.task)
    b = GraphBuilder(name, seed)
    d = cfg.hidden
    x = patch_embed(b, w, pixel_input(b, cfg, batch), "embeddings.patch_embedding", cfg.channels, cfg.patch, d,
                    bias=False)
    cls = w.get(b, "embeddings.class_embedding", (1, 1, d), hf_shape=(d,), to_ir=lambda a: a.reshape(1, 1, d))
    x = prepend(b, cls, x, "embeddings.cls")
    pos = w.get(b, "embeddings.position_embedding.weight", (1, cfg.tokens, d), hf_shape=(cfg.tokens, d),
                to_ir=lambda a: a[None])
    x = b.op("Add", [x, pos], name="embeddings")
    x = layer_norm(b, w, x, "pre_layrnorm", d, cfg.eps)  # sic: HF's parameter name
    for i in range(cfg.layers):
        x = pre_ln_layer(b, w, x, f"encoder.layers.{i}", CLIP_LAYER, d, cfg.mlp, cfg.heads, cfg.eps, cfg.act)
    b.output(x, "last_hidden_state")
    p = layer_norm(b, w, first_token(b, x, "pooler"), "post_layernorm", d, cfg.eps)
    b.output(p, "pooler_output")
    if cfg.task is not None:
        vision_head(b, w, cfg.task, "clip", x, p, d)
    return b.build()

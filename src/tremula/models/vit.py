"""ViT (transformers' ViTModel): CLS token, learned positions, pre-LN layers, final LayerNorm, tanh pooler."""

from __future__ import annotations

from tremula.ir.builder import GraphBuilder
from tremula.ir.graph import Graph
from tremula.models.blocks import first_token, layer_norm, linear, patch_embed, pre_ln_layer, prepend
from tremula.models.configs import VisionConfig
from tremula.models.heads import check_head, vision_head
from tremula.models.vision import VIT_LAYER, pixel_input
from tremula.models.weights import WeightSource


def build_vit(cfg: VisionConfig, w: WeightSource, batch: int = 1, name: str = "vit", seed: int = 0) -> Graph:
    check_head("vit", cfg.task)
    b = GraphBuilder(name, seed)
    d = cfg.hidden
    x = patch_embed(b, w, pixel_input(b, cfg, batch), "embeddings.patch_embeddings.projection", cfg.channels,
                    cfg.patch, d)
    x = prepend(b, w.get(b, "embeddings.cls_token", (1, 1, d)), x, "embeddings.cls")
    x = b.op("Add", [x, w.get(b, "embeddings.position_embeddings", (1, cfg.tokens, d))], name="embeddings")
    for i in range(cfg.layers):
        x = pre_ln_layer(b, w, x, f"encoder.layer.{i}", VIT_LAYER, d, cfg.mlp, cfg.heads, cfg.eps, cfg.act,
                         cfg.qkv_bias)
    x = layer_norm(b, w, x, "layernorm", d, cfg.eps)
    b.output(x, "last_hidden_state")
    p = None
    if cfg.head:
        p = b.op("Tanh", [linear(b, w, first_token(b, x, "pooler"), "pooler.dense", d, d)], name="pooler")
        b.output(p, "pooler_output")
    if cfg.task is not None:
        vision_head(b, w, cfg.task, "vit", x, p, d)
    return b.build()

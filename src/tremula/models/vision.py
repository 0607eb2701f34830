"""Shared front of the ViT-style encoders: the pixel_values input and the checkpoint names of their layers."""

from __future__ import annotations

from tremula.ir.builder import GraphBuilder
from tremula.models.blocks import LayerNames
from tremula.models.configs import VisionConfig

VIT_LAYER = LayerNames(
    ln1="layernorm_before",
    q="attention.attention.query",
    k="attention.attention.key",
    v="attention.attention.value",
    out="attention.output.dense",
    ln2="layernorm_after",
    fc1="intermediate.dense",
    fc2="output.dense",
)

# SigLIP and CLIP share the same layer layout and names.
CLIP_LAYER = LayerNames(
    ln1="layer_norm1",
    q="self_attn.q_proj",
    k="self_attn.k_proj",
    v="self_attn.v_proj",
    out="self_attn.out_proj",
    ln2="layer_norm2",
    fc1="mlp.fc1",
    fc2="mlp.fc2",
)


def pixel_input(b: GraphBuilder, cfg: VisionConfig, batch: int) -> str:
    return b.input("pixel_values", (batch, cfg.channels, cfg.image, cfg.image), "float32")

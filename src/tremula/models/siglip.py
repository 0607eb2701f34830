"""SigLIP vision tower (SiglipVisionModel): no CLS, pre-LN layers, post-LN, attention-pooling head."""

from __future__ import annotations

from tremula.ir.builder import GraphBuilder
from tremula.ir.graph import Graph
from tremula.models.blocks import attention, first_token, layer_norm, linear, mlp, patch_embed, pre_ln_layer
from tremula.models.configs import VisionConfig
from tremula.models.heads import check_head, vision_head
from tremula.models.vision import CLIP_LAYER, pixel_input
from tremula.models.weights import WeightSource


def _in_proj(b: GraphBuilder, w: WeightSource, part: int, d: int) -> tuple[str, str]:
    """nn.MultiheadAttention packs q, k, v as rows of in_proj_weight [3d, d]; take one block, as [in, out]."""
    tag = "qkv"[part]
    rows = slice(part * d, (part + 1) * d)
    wt = w.get(b, f"head.attention.in_proj_weight.{tag}", (d, d), hf_name="head.attention.in_proj_weight",
               hf_shape=(3 * d, d), to_ir=lambda a: a[rows].T)
    bias = w.get(b, f"head.attention.in_proj_bias.{tag}", (d,), init="zeros", hf_name="head.attention.in_proj_bias",
                 hf_shape=(3 * d,), to_ir=lambda a: a[rows])
    return wt, bias


def pooling_head(b: GraphBuilder, w: WeightSource, x: str, cfg: VisionConfig) -> str:
    """SiglipMultiheadAttentionPoolingHead: a learned probe attends over all tokens, then LN + MLP with residual."""
    bsz = b.type(x).shape[0]
    d = cfg.hidden
    probe = w.get(b, "head.probe", (1, 1, d))
    (wq, bq), (wk, bk), (wv, bv) = (_in_proj(b, w, i, d) for i in range(3))
    # Project the probe once and broadcast over the batch (the same values torch gets from probe.repeat(B, 1, 1)).
    q = b.op("Linear", [probe, wq, bq], name="head.attention.q")
    if bsz != 1:
        q = b.op("Expand", [q], name="head.attention.q", shape=(bsz, 1, d))
    k = b.op("Linear", [x, wk, bk], name="head.attention.k")
    v = b.op("Linear", [x, wv, bv], name="head.attention.v")
    a = attention(b, q, k, v, cfg.heads, "head.attention")
    h = linear(b, w, a, "head.attention.out_proj", d, d)
    r = layer_norm(b, w, h, "head.layernorm", d, cfg.eps)
    h = b.op("Add", [h, mlp(b, w, r, "head.mlp.fc1", "head.mlp.fc2", d, cfg.mlp, cfg.act)], name="head.residual")
    return first_token(b, h, "head")


def build_siglip(cfg: VisionConfig, w: WeightSource, batch: int = 1, name: str = "siglip", seed: int = 0) -> Graph:
    check_head("siglip", cfg.task)
    b = GraphBuilder(name, seed)
    d = cfg.hidden
    x = patch_embed(b, w, pixel_input(b, cfg, batch), "embeddings.patch_embedding", cfg.channels, cfg.patch, d)
    pos = w.get(b, "embeddings.position_embedding.weight", (1, cfg.patches, d), hf_shape=(cfg.patches, d),
                to_ir=lambda a: a[None])
    x = b.op("Add", [x, pos], name="embeddings")
    for i in range(cfg.layers):
        x = pre_ln_layer(b, w, x, f"encoder.layers.{i}", CLIP_LAYER, d, cfg.mlp, cfg.heads, cfg.eps, cfg.act)
    x = layer_norm(b, w, x, "post_layernorm", d, cfg.eps)
    b.output(x, "last_hidden_state")
    if cfg.head:
        b.output(pooling_head(b, w, x, cfg), "pooler_output")
    if cfg.task is not None:
        vision_head(b, w, cfg.task, "siglip", x, None, d)
    return b.build()

"""GPT-2 (transformers' GPT2Model), prefill: learned positions, pre-LN causal layers, fused c_attn, final ln_f."""

from __future__ import annotations

from tremula.ir.builder import GraphBuilder
from tremula.ir.graph import Graph
from tremula.models.blocks import attention, layer_norm, linear, mlp
from tremula.models.configs import GPT2Config, check_seq
from tremula.models.heads import check_head, gpt2_head
from tremula.models.weights import WeightSource


def gpt2_layer(b: GraphBuilder, w: WeightSource, x: str, i: int, cfg: GPT2Config) -> str:
    p, d = f"h.{i}", cfg.hidden
    h = layer_norm(b, w, x, f"{p}.ln_1", d, cfg.eps)
    # Conv1D weights are already [in, out]; c_attn makes q, k, v side by side.
    qkv = linear(b, w, h, f"{p}.attn.c_attn", d, 3 * d, layout="in_out")
    q, k, v = b.op("Split", [qkv], name=f"{p}.attn.split", axis=-1, sizes=(d, d, d))
    scale = ((d // cfg.heads) ** -0.5 if cfg.scale_attn else 1.0) / (i + 1 if cfg.scale_by_inverse_layer else 1)
    a = attention(b, q, k, v, cfg.heads, f"{p}.attn", causal=True, scale=scale)
    a = linear(b, w, a, f"{p}.attn.c_proj", d, d, layout="in_out")
    x = b.op("Add", [x, a], name=f"{p}.residual1")
    h = layer_norm(b, w, x, f"{p}.ln_2", d, cfg.eps)
    h = mlp(b, w, h, f"{p}.mlp.c_fc", f"{p}.mlp.c_proj", d, cfg.mlp, cfg.act, layout="in_out")
    return b.op("Add", [x, h], name=f"{p}.residual2")


def build_gpt2(cfg: GPT2Config, w: WeightSource, batch: int = 1, seq_len: int | None = None, name: str = "gpt2",
               seed: int = 0) -> Graph:
    """Input input_ids int64 [B, S]; output last_hidden_state [B, S, D] and, with the LM head, logits [B, S, V]."""
    s = seq_len or cfg.seq
    check_seq(s, cfg.max_positions)
    check_head("gpt2", cfg.task)
    b = GraphBuilder(name, seed)
    ids = b.input("input_ids", (batch, s), "int64")
    x = b.op("Gather", [w.get(b, "wte.weight", (cfg.vocab, cfg.hidden)), ids], name="wte", axis=0)
    pos = b.op("Slice", [w.get(b, "wpe.weight", (cfg.max_positions, cfg.hidden))], name="wpe", starts=(0,),
               ends=(s,), axes=(0,))
    x = b.op("Add", [x, pos], name="embeddings")
    for i in range(cfg.layers):
        x = gpt2_layer(b, w, x, i, cfg)
    x = layer_norm(b, w, x, "ln_f", cfg.hidden, cfg.eps)
    b.output(x, "last_hidden_state")
    if cfg.task is not None:
        gpt2_head(b, w, cfg.task, x, cfg.hidden)
    return b.build()

"""BERT (transformers' BertModel): word + token-type + position embeddings, post-LN layers, padding mask, pooler."""

from __future__ import annotations

import numpy as np

from tremula.ir.builder import GraphBuilder
from tremula.ir.graph import Graph
from tremula.models.blocks import attention, first_token, layer_norm, linear, mlp, scalar
from tremula.models.configs import BertConfig, check_seq
from tremula.models.heads import bert_head, check_head
from tremula.models.weights import WeightSource


def extended_mask(b: GraphBuilder, mask: str) -> str:
    """attention_mask [B, S] of 1/0 → additive [B, 1, 1, S]: 0 where attended, float32 min where padded, as HF does."""
    bsz, s = b.type(mask).shape
    m = b.op("Cast", [mask], name="extended_mask", to="float32")
    m = b.op("Sub", [scalar(b, "extended_mask.one", 1.0), m], name="extended_mask")
    m = b.op("Mul", [m, scalar(b, "extended_mask.min", float(np.finfo(np.float32).min))], name="extended_mask")
    return b.op("Reshape", [m], name="extended_mask", shape=(bsz, 1, 1, s))


def embeddings(b: GraphBuilder, w: WeightSource, cfg: BertConfig, ids: str, types: str | None) -> str:
    d, s = cfg.hidden, b.type(ids).shape[1]
    x = b.op("Gather", [w.get(b, "embeddings.word_embeddings.weight", (cfg.vocab, d)), ids], name="embeddings.word",
             axis=0)
    tt_table = w.get(b, "embeddings.token_type_embeddings.weight", (cfg.type_vocab, d))
    if types is not None:
        tt = b.op("Gather", [tt_table, types], name="embeddings.token_type", axis=0)
    else:  # HF uses token type 0 everywhere when none are given
        tt = b.op("Slice", [tt_table], name="embeddings.token_type", starts=(0,), ends=(1,), axes=(0,))
    x = b.op("Add", [x, tt], name="embeddings")
    pos_table = w.get(b, "embeddings.position_embeddings.weight", (cfg.max_positions, d))
    pos = b.op("Slice", [pos_table], name="embeddings.position", starts=(0,), ends=(s,), axes=(0,))
    x = b.op("Add", [x, pos], name="embeddings")
    return layer_norm(b, w, x, "embeddings.LayerNorm", d, cfg.eps)


def bert_layer(b: GraphBuilder, w: WeightSource, x: str, i: int, cfg: BertConfig, mask: str) -> str:
    p, d = f"encoder.layer.{i}", cfg.hidden
    q, k, v = (linear(b, w, x, f"{p}.attention.self.{n}", d, d) for n in ("query", "key", "value"))
    a = attention(b, q, k, v, cfg.heads, f"{p}.attention", mask=mask)
    a = linear(b, w, a, f"{p}.attention.output.dense", d, d)
    x = layer_norm(b, w, b.op("Add", [a, x], name=f"{p}.attention.residual"), f"{p}.attention.output.LayerNorm", d,
                   cfg.eps)
    h = mlp(b, w, x, f"{p}.intermediate.dense", f"{p}.output.dense", d, cfg.mlp, cfg.act)
    return layer_norm(b, w, b.op("Add", [h, x], name=f"{p}.output.residual"), f"{p}.output.LayerNorm", d, cfg.eps)


def build_bert(cfg: BertConfig, w: WeightSource, batch: int = 1, seq_len: int | None = None, name: str = "bert",
               seed: int = 0, token_type_ids: bool = True) -> Graph:
    """Inputs input_ids, attention_mask (and token_type_ids unless disabled), all int64 [B, S]; outputs
    last_hidden_state, pooler_output (with a pooler) and `logits` (with a task head)."""
    s = seq_len or cfg.seq
    check_seq(s, cfg.max_positions)
    check_head("bert", cfg.task)
    b = GraphBuilder(name, seed)
    ids = b.input("input_ids", (batch, s), "int64")
    mask = extended_mask(b, b.input("attention_mask", (batch, s), "int64"))
    types = b.input("token_type_ids", (batch, s), "int64") if token_type_ids else None
    x = embeddings(b, w, cfg, ids, types)
    for i in range(cfg.layers):
        x = bert_layer(b, w, x, i, cfg, mask)
    b.output(x, "last_hidden_state")
    p = None
    if cfg.pooler:
        p = b.op("Tanh", [linear(b, w, first_token(b, x, "pooler"), "pooler.dense", cfg.hidden, cfg.hidden)],
                 name="pooler")
        b.output(p, "pooler_output")
    if cfg.task is not None:
        bert_head(b, w, cfg.task, x, p, cfg.hidden, cfg.eps, cfg.act)
    return b.build()

"""Transformer building blocks written with GraphBuilder over the canonical (fused) ops, shared by every family."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tremula.errors import TremulaError
from tremula.ir.builder import GraphBuilder
from tremula.models.weights import WeightSource


def scalar(b: GraphBuilder, name: str, value: float, dtype: str = "float32") -> str:
    """A rank-0 constant, made once per graph and shared by every layer that needs it."""
    if name not in b.graph.constants:
        b.const(name, np.array(value, dtype=dtype))
    return name


def linear(b: GraphBuilder, w: WeightSource, x: str, prefix: str, k: int, n: int, *, bias: bool = True,
           layout: str = "out_in") -> str:
    """x[..., k] @ W[k, n] + b. HF nn.Linear stores W as [out, in] ("out_in", transposed once at load);
    GPT-2's Conv1D already stores [in, out] ("in_out")."""
    if layout == "out_in":
        wt = w.get(b, f"{prefix}.weight", (k, n), hf_shape=(n, k), to_ir=lambda a: a.T)
    elif layout == "in_out":
        wt = w.get(b, f"{prefix}.weight", (k, n))
    else:
        raise ValueError(layout)
    ins = [x, wt]
    if bias:
        ins.append(w.get(b, f"{prefix}.bias", (n,), init="zeros"))
    return b.op("Linear", ins, name=prefix)


def layer_norm(b: GraphBuilder, w: WeightSource, x: str, prefix: str, d: int, eps: float) -> str:
    g = w.get(b, f"{prefix}.weight", (d,), init="ones")
    beta = w.get(b, f"{prefix}.bias", (d,), init="zeros")
    return b.op("LayerNorm", [x, g, beta], name=prefix, epsilon=float(eps))


def activation(b: GraphBuilder, x: str, act: str, name: str) -> str:
    if act == "gelu":
        return b.op("Gelu", [x], name=name, approximate="none")
    if act == "gelu_tanh":
        return b.op("Gelu", [x], name=name, approximate="tanh")
    if act == "quick_gelu":  # CLIP: x * sigmoid(1.702 x); no fused op, so built from Mul/Sigmoid
        s = b.op("Sigmoid", [b.op("Mul", [x, scalar(b, "quick_gelu.alpha", 1.702)], name=name)], name=name)
        return b.op("Mul", [x, s], name=name)
    if act == "relu":
        return b.op("Relu", [x], name=name)
    raise TremulaError(f"activation {act!r} is not supported")


def mlp(b: GraphBuilder, w: WeightSource, x: str, fc1: str, fc2: str, d: int, f: int, act: str,
        layout: str = "out_in") -> str:
    h = linear(b, w, x, fc1, d, f, layout=layout)
    h = activation(b, h, act, f"{fc1}.act")
    return linear(b, w, h, fc2, f, d, layout=layout)


def split_heads(b: GraphBuilder, x: str, heads: int, name: str) -> str:
    """[B, S, H*Dh] → [B, H, S, Dh]."""
    bsz, s, d = b.type(x).shape
    x = b.op("Reshape", [x], name=name, shape=(bsz, s, heads, d // heads))
    return b.op("Transpose", [x], name=name, perm=(0, 2, 1, 3))


def merge_heads(b: GraphBuilder, x: str, name: str) -> str:
    """[B, H, S, Dh] → [B, S, H*Dh]."""
    bsz, h, s, dh = b.type(x).shape
    x = b.op("Transpose", [x], name=name, perm=(0, 2, 1, 3))
    return b.op("Reshape", [x], name=name, shape=(bsz, s, h * dh))


def attention(b: GraphBuilder, q: str, k: str, v: str, heads: int, name: str, mask: str | None = None,
              causal: bool = False, scale: float | None = None) -> str:
    """Multi-head scaled dot-product attention on [B, S, D] projections; returns [B, Sq, D] before the out-proj."""
    d = b.type(q).shape[-1]
    if scale is None:
        scale = (d // heads) ** -0.5
    qh, kh, vh = (split_heads(b, t, heads, f"{name}.{t_name}") for t, t_name in ((q, "q"), (k, "k"), (v, "v")))
    ins = [qh, kh, vh] + ([mask] if mask else [])
    o = b.op("Attention", ins, name=name, scale=float(scale), causal=int(causal))
    return merge_heads(b, o, name)


@dataclass(frozen=True)
class LayerNames:
    """Where one pre-LN encoder layer's tensors live in the HF checkpoint, relative to the layer's prefix."""

    ln1: str
    q: str
    k: str
    v: str
    out: str
    ln2: str
    fc1: str
    fc2: str


def pre_ln_layer(b: GraphBuilder, w: WeightSource, x: str, prefix: str, names: LayerNames, d: int, f: int,
                 heads: int, eps: float, act: str, qkv_bias: bool = True) -> str:
    """x + Attn(LN1(x)); then + MLP(LN2(·)) — the ViT / SigLIP / CLIP encoder layer."""
    h = layer_norm(b, w, x, f"{prefix}.{names.ln1}", d, eps)
    q = linear(b, w, h, f"{prefix}.{names.q}", d, d, bias=qkv_bias)
    k = linear(b, w, h, f"{prefix}.{names.k}", d, d, bias=qkv_bias)
    v = linear(b, w, h, f"{prefix}.{names.v}", d, d, bias=qkv_bias)
    a = attention(b, q, k, v, heads, f"{prefix}.attention")
    a = linear(b, w, a, f"{prefix}.{names.out}", d, d)
    x = b.op("Add", [x, a], name=f"{prefix}.residual1")
    h = layer_norm(b, w, x, f"{prefix}.{names.ln2}", d, eps)
    h = mlp(b, w, h, f"{prefix}.{names.fc1}", f"{prefix}.{names.fc2}", d, f, act)
    return b.op("Add", [x, h], name=f"{prefix}.residual2")


def patch_embed(b: GraphBuilder, w: WeightSource, pixels: str, prefix: str, channels: int, patch: int, d: int,
                bias: bool = True) -> str:
    """Conv2d(kernel = stride = patch) as Patchify + Linear: [B, C, H, W] → [B, patches, d].

    The conv weight [d, C, p, p] flattens to [d, C*p*p] in Patchify's (C, ph, pw) feature order, then transposes."""
    k = channels * patch * patch
    x = b.op("Patchify", [pixels], name=prefix, patch=(patch, patch))
    wt = w.get(b, f"{prefix}.weight", (k, d), hf_shape=(d, channels, patch, patch), to_ir=lambda a: a.reshape(d, k).T)
    ins = [x, wt] + ([w.get(b, f"{prefix}.bias", (d,), init="zeros")] if bias else [])
    return b.op("Linear", ins, name=prefix)


def first_token(b: GraphBuilder, x: str, name: str) -> str:
    """[B, S, D] → [B, D]: the CLS (or probe) position."""
    bsz, _, d = b.type(x).shape
    t = b.op("Slice", [x], name=name, starts=(0,), ends=(1,), axes=(1,))
    return b.op("Reshape", [t], name=name, shape=(bsz, d))


def prepend(b: GraphBuilder, token: str, x: str, name: str) -> str:
    """Concatenate a learned [1, 1, D] token in front of [B, S, D] for every batch row."""
    bsz, _, d = b.type(x).shape
    t = b.op("Expand", [token], name=name, shape=(bsz, 1, d)) if bsz != 1 else token
    return b.op("Concat", [t, x], name=name, axis=1)

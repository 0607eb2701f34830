"""Frozen architecture configs: the dimensions and choices that fully decide a model's Graph."""

from __future__ import annotations

from dataclasses import dataclass

from tremula.errors import TremulaError

# HF `hidden_act` strings → how the graph computes them. gelu_new / gelu_pytorch_tanh / gelu_fast are the same tanh
# approximation written three ways; quick_gelu is CLIP's x * sigmoid(1.702 x).
ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "quick_gelu": "quick_gelu",
    "relu": "relu",
}


def activation(hf_name: str) -> str:
    """The canonical activation for an HF `hidden_act` name, or a TremulaError listing the known ones."""
    try:
        return ACTIVATIONS[hf_name]
    except KeyError:
        known = ", ".join(sorted(ACTIVATIONS))
        raise TremulaError(f"activation {hf_name!r} is not supported (known: {known})") from None


@dataclass(frozen=True)
class TaskHead:
    """A task head on top of a base model, as the transformers class named in config.json's `architectures` has it.

    kind: "lm" (GPT-2: logits over the vocabulary from ln_f), "mlm" (BERT: transform + decoder per token),
    "seq_cls" (BERT: classifier on the pooler output), "token_cls" (BERT: classifier per token), "image_cls"
    (ViT: classifier on the CLS token after the final LayerNorm), "image_cls_mean" (SigLIP / CLIP: classifier on the
    mean of the tokens, CLIP's CLS excluded), "projection" (CLIP: visual_projection of the pooled output).
    Heads add an output (`logits`, or `image_embeds` for "projection"); the base model's outputs stay."""

    kind: str
    size: int  # vocabulary, number of labels or projection width

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise TremulaError(f"unknown task head {self.kind!r} (known: {', '.join(HEAD_KINDS)})")
        if self.size < 1:
            raise TremulaError(f"task head {self.kind!r} needs a positive width, got {self.size}")


HEAD_KINDS = ("lm", "mlm", "seq_cls", "token_cls", "image_cls", "image_cls_mean", "projection")


@dataclass(frozen=True)
class VisionConfig:
    """A ViT-style image encoder. family: "vit" (CLS + post-LN + tanh pooler), "siglip" (no CLS, post-LN,
    attention-pooling head), "clip" (CLS, pre-LN before the encoder, post-LN on the pooled CLS only)."""

    family: str
    hidden: int
    layers: int
    heads: int
    mlp: int
    image: int
    patch: int
    eps: float
    act: str  # canonical name, see ACTIVATIONS
    channels: int = 3
    head: bool = True  # ViT pooler / SigLIP attention-pooling head (CLIP always pools the CLS token)
    qkv_bias: bool = True
    task: TaskHead | None = None  # image_cls (ViT), image_cls_mean (SigLIP, CLIP), projection (CLIP)

    def __post_init__(self) -> None:
        if self.family not in ("vit", "siglip", "clip"):
            raise TremulaError(f"unknown vision family {self.family!r} (known: vit, siglip, clip)")
        _check_heads(self.hidden, self.heads)
        if self.image < self.patch:
            raise TremulaError(f"image size {self.image} is smaller than the patch size {self.patch}")

    @property
    def patches(self) -> int:
        return (self.image // self.patch) ** 2

    @property
    def tokens(self) -> int:
        return self.patches + (0 if self.family == "siglip" else 1)  # SigLIP has no CLS token


@dataclass(frozen=True)
class BertConfig:
    """A BERT encoder (post-LN), as in transformers' BertModel with absolute position embeddings."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    mlp: int
    max_positions: int
    seq: int  # default sequence length when a model is built
    type_vocab: int = 2
    eps: float = 1e-12
    act: str = "gelu"
    pooler: bool = True
    task: TaskHead | None = None  # mlm, seq_cls (needs the pooler), token_cls

    def __post_init__(self) -> None:
        _check_heads(self.hidden, self.heads)


@dataclass(frozen=True)
class GPT2Config:
    """A GPT-2 decoder stack (pre-LN, causal, learned positions, final ln_f), prefill only."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    mlp: int
    max_positions: int
    seq: int
    eps: float = 1e-5
    act: str = "gelu_tanh"
    scale_attn: bool = True  # divide scores by sqrt(head_dim) (HF scale_attn_weights)
    scale_by_inverse_layer: bool = False  # and by layer index + 1 (HF scale_attn_by_inverse_layer_idx)
    task: TaskHead | None = None  # lm

    def __post_init__(self) -> None:
        _check_heads(self.hidden, self.heads)


def _check_heads(hidden: int, heads: int) -> None:
    if heads <= 0 or hidden % heads:
        raise TremulaError(f"hidden size {hidden} is not divisible by {heads} attention heads")


def check_seq(seq: int, max_positions: int) -> None:
    if not 1 <= seq <= max_positions:
        raise TremulaError(f"sequence length {seq} is outside 1..{max_positions} (the model's position table)")

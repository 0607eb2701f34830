"""Task heads over a base model (LM, masked LM, sequence / token / image classification, CLIP's projection), computed
as transformers' task classes compute them; each adds one output and leaves the base model's outputs in place."""

from __future__ import annotations

from tremula.errors import TremulaError
from tremula.ir.builder import GraphBuilder
from tremula.models.blocks import activation, first_token, layer_norm, linear
from tremula.models.configs import TaskHead
from tremula.models.weights import WeightSource

# Which heads each family has. The weights keep transformers' names (`lm_head.weight`, `classifier.weight`, ...):
# a checkpoint frontend resolves ties (an LM decoder that is the word-embedding table) when it reads them.
HEADS = {
    "gpt2": ("lm",),
    "bert": ("mlm", "seq_cls", "token_cls"),
    "vit": ("image_cls",),
    "siglip": ("image_cls_mean",),
    "clip": ("image_cls_mean", "projection"),
}


def check_head(family: str, task: TaskHead | None) -> None:
    if task is not None and task.kind not in HEADS.get(family, ()):
        raise TremulaError(f"a {family} model has no {task.kind!r} head (it has: {', '.join(HEADS.get(family, ()))})")


def _classifier(b: GraphBuilder, w: WeightSource, x: str, d: int, labels: int) -> str:
    """nn.Linear(hidden, num_labels) named `classifier`; dropout before it is the identity at inference."""
    return linear(b, w, x, "classifier", d, labels)


def gpt2_head(b: GraphBuilder, w: WeightSource, task: TaskHead, hidden: str, d: int) -> None:
    """GPT2LMHeadModel: logits = ln_f(x) @ lm_head.weight.T, no bias; [B, S, vocab]."""
    wt = w.get(b, "lm_head.weight", (d, task.size), hf_shape=(task.size, d), to_ir=lambda a: a.T)
    b.output(b.op("Linear", [hidden, wt], name="lm_head"), "logits")


def bert_head(b: GraphBuilder, w: WeightSource, task: TaskHead, hidden: str, pooled: str | None, d: int, eps: float,
              act: str) -> None:
    if task.kind == "seq_cls":  # BertForSequenceClassification: classifier(pooler_output) → [B, labels]
        if pooled is None:
            raise TremulaError("sequence classification reads the pooler output, but the checkpoint has no pooler "
                               "(pooler.dense.weight)")
        b.output(_classifier(b, w, pooled, d, task.size), "logits")
    elif task.kind == "token_cls":  # BertForTokenClassification: classifier on every token → [B, S, labels]
        b.output(_classifier(b, w, hidden, d, task.size), "logits")
    else:  # BertForMaskedLM: dense → hidden_act → LayerNorm → decoder (+ its own bias) → [B, S, vocab]
        p = "cls.predictions"
        h = linear(b, w, hidden, f"{p}.transform.dense", d, d)
        h = layer_norm(b, w, activation(b, h, act, f"{p}.transform.act"), f"{p}.transform.LayerNorm", d, eps)
        wt = w.get(b, f"{p}.decoder.weight", (d, task.size), hf_shape=(task.size, d), to_ir=lambda a: a.T)
        bias = w.get(b, f"{p}.decoder.bias", (task.size,), init="zeros")
        b.output(b.op("Linear", [h, wt, bias], name=f"{p}.decoder"), "logits")


def vision_head(b: GraphBuilder, w: WeightSource, task: TaskHead, family: str, hidden: str, pooled: str | None,
                d: int) -> None:
    """`hidden` is the model's last_hidden_state (ViT and SigLIP: after the final LayerNorm; CLIP: before it)."""
    if task.kind == "image_cls":  # ViTForImageClassification: classifier on the CLS token; ViT's pooler is unused
        b.output(_classifier(b, w, first_token(b, hidden, "classifier.cls"), d, task.size), "logits")
    elif task.kind == "image_cls_mean":  # Siglip/CLIPForImageClassification: mean over the tokens (CLIP skips CLS)
        bsz, s, _ = b.type(hidden).shape
        x = hidden
        if family == "clip":
            x = b.op("Slice", [x], name="classifier.tokens", starts=(1,), ends=(s,), axes=(1,))
        # Averaging over the token axis as a last-axis row reduction, the form the planner places.
        x = b.op("Transpose", [x], name="classifier.mean", perm=(0, 2, 1))
        x = b.op("ReduceMean", [x], name="classifier.mean", axes=(-1,), keepdims=0)
        b.output(_classifier(b, w, x, d, task.size), "logits")
    else:  # CLIPModel / CLIPVisionModelWithProjection: image_embeds = visual_projection(pooler_output), no bias
        assert pooled is not None  # CLIP always pools its CLS token
        b.output(linear(b, w, pooled, "visual_projection", d, task.size, bias=False), "image_embeds")

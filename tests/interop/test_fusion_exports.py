"""Real exports → import → canonicalize: every layer's pattern fuses, and the result still matches torch.

Tiny HF ViT, SigLIP vision, CLIP vision, BERT and GPT-2 (2 layers, built offline from configs) are exported with the
legacy exporter (opset 17, and opset 14 where LayerNorm is written out as ReduceMean/Sub/Pow/Sqrt/Div) and with the
dynamo exporter, so the fusions meet the patterns exporters really write, not the ones we imagine.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e .[torch])")
T = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[torch])")
onnx_import = pytest.importorskip("tremula.frontends.onnx_import", reason="the ONNX importer is not available")

from tremula.ir import run  # noqa: E402
from tremula.passes import canonicalize  # noqa: E402

LAYERS = 2
SEQ = 8
COMMON = dict(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=64)
VISION = dict(COMMON, image_size=32, patch_size=8)


def _model(family: str):
    """(model, example input, expected op counts after canonicalize)."""
    torch.manual_seed(0)
    if family == "vit":
        m = T.ViTModel(T.ViTConfig(**VISION), add_pooling_layer=False)
        x = torch.randn(1, 3, 32, 32)
        # per layer: q, k and v fused into one Linear (passes/fuse_qkv.py) and a Split, out, fc1, fc2 Linears,
        # 2 LayerNorms, 1 GELU; plus the patch embedding and final LayerNorm
        want = dict(Attention=LAYERS, LayerNorm=2 * LAYERS + 1, Gelu=LAYERS, Linear=4 * LAYERS + 1, Patchify=1,
                    Split=LAYERS)
    elif family == "siglip":
        m = T.SiglipVisionModel(T.SiglipVisionConfig(**VISION, vision_use_head=False))
        x = torch.randn(1, 3, 32, 32)
        want = dict(Attention=LAYERS, LayerNorm=2 * LAYERS + 1, Gelu=LAYERS, Linear=4 * LAYERS + 1, Patchify=1,
                    Split=LAYERS)
    elif family == "clip":
        m = T.CLIPVisionModel(T.CLIPVisionConfig(**VISION))
        x = torch.randn(1, 3, 32, 32)
        # quick_gelu (x·sigmoid(1.702x)) is not GELU and must not become one; post_layernorm only feeds the pooler
        want = dict(Attention=LAYERS, LayerNorm=2 * LAYERS + 1, Gelu=0, Linear=4 * LAYERS + 1, Patchify=1,
                    Split=LAYERS)
    elif family == "bert":
        m = T.BertModel(T.BertConfig(**COMMON, vocab_size=100, max_position_embeddings=64), add_pooling_layer=False)
        x = torch.randint(0, 100, (1, SEQ))
        want = dict(Attention=LAYERS, LayerNorm=2 * LAYERS + 1, Gelu=LAYERS, Linear=4 * LAYERS, Split=LAYERS)
    else:
        m = T.GPT2Model(T.GPT2Config(n_embd=32, n_layer=LAYERS, n_head=2, n_positions=64, vocab_size=100))
        x = torch.randint(0, 100, (1, SEQ))
        # c_attn (q, k and v in one), c_proj, c_fc, mlp c_proj
        want = dict(Attention=LAYERS, LayerNorm=2 * LAYERS + 1, Gelu=LAYERS, Linear=4 * LAYERS, Split=LAYERS)
    m.config._attn_implementation = "eager"
    return m.eval(), x, want


class _Hidden(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x).last_hidden_state


EXPORTS = [("legacy", 17), ("legacy", 14), ("dynamo", 18)]


@pytest.mark.slow
@pytest.mark.parametrize("exporter,opset", EXPORTS, ids=[f"{e}{o}" for e, o in EXPORTS])
@pytest.mark.parametrize("family", ["vit", "siglip", "clip", "bert", "gpt2"])
def test_export_fuses_and_matches_torch(family, exporter, opset, tmp_path):
    if exporter == "dynamo":
        pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    model, x, want = _model(family)
    with torch.no_grad():  # before exporting: the legacy exporter leaves a BERT giving other numbers afterwards
        ref = model(x).last_hidden_state.numpy()
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Hidden(model), (x,), str(path), dynamo=exporter == "dynamo", opset_version=opset)

    graph = onnx_import.import_onnx(path, batch=1, seq_len=SEQ if x.dtype == torch.int64 else None)
    fused = canonicalize(graph)
    ops = Counter(n.op for n in fused.nodes)
    assert {op: ops[op] for op in want} == want, dict(ops)
    assert not {"MatMul", "Softmax", "Erf", "Tanh", "ReduceMean", "Sqrt", "Pow", "Conv"} & set(ops), dict(ops)
    assert not any(n.op in ("Shape", "Range") for n in fused.nodes)  # host-only arithmetic folded away
    attention = [n for n in fused.nodes if n.op == "Attention"]
    for n in attention:  # q, k, v as [B, H, S, D]; GPT-2's causal triangle is a flag, not a mask tensor
        assert all(len(fused.types[i].shape) == 4 for i in n.inputs[:3])
        assert n.attrs["causal"] == (family == "gpt2") and len(n.inputs) == 3

    feeds = {graph.inputs[0]: x.numpy()}
    got = run(fused, feeds)[fused.outputs[0]]
    before = run(graph, feeds)[graph.outputs[0]]
    scale = float(np.max(np.abs(ref)))
    assert float(np.max(np.abs(got - ref))) <= 1e-4 * scale
    assert float(np.max(np.abs(got - before))) <= 1e-5 * scale  # the passes changed nothing but rounding


class _Masked(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x, mask):
        return self.m(input_ids=x, attention_mask=mask).last_hidden_state


@pytest.mark.slow
@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_padding_mask_stays_an_attention_input(exporter, tmp_path):
    """A BERT fed an attention_mask: the mask computed from it is not causal, so it must reach Attention as input 4."""
    if exporter == "dynamo":
        pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    model, x, _ = _model("bert")
    mask = torch.ones(1, SEQ, dtype=torch.int64)
    mask[0, SEQ - 3:] = 0
    with torch.no_grad():
        ref = _Masked(model)(x, mask).numpy()
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Masked(model), (x, mask), str(path), dynamo=exporter == "dynamo",
                          opset_version=18 if exporter == "dynamo" else 17)
    graph = onnx_import.import_onnx(path, batch=1, seq_len=SEQ)
    fused = canonicalize(graph)
    attention = [n for n in fused.nodes if n.op == "Attention"]
    assert len(attention) == LAYERS and all(len(n.inputs) == 4 and n.attrs["causal"] == 0 for n in attention)
    assert not {"MatMul", "Softmax", "Erf"} & {n.op for n in fused.nodes}
    got = run(fused, dict(zip(graph.inputs, (x.numpy(), mask.numpy()))))[fused.outputs[0]]
    assert float(np.max(np.abs(got - ref))) <= 1e-4 * float(np.max(np.abs(ref)))

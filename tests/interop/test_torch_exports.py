"""torch.onnx exports (dynamo and legacy) of tiny Hugging Face models import and match torch in the interpreter."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e .[torch])")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[torch])")
pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")

from tremula.frontends.onnx_import import import_onnx  # noqa: E402 - after the importorskips
from tremula.ir import run  # noqa: E402

B, S, IMG = 2, 7, 32
_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


class _LastHidden(torch.nn.Module):
    """Positional inputs in, last_hidden_state out: one calling convention that both exporters trace the same way."""

    def __init__(self, model, names: list[str]):
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *xs):
        return self.model(**dict(zip(self.names, xs))).last_hidden_state


def _text_inputs(batch: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 100, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[-1, seq - 2 :] = 0  # padding in the last row, so the mask path matters
    return {"input_ids": ids, "attention_mask": mask}


def _family(name: str, attn: str, batch: int = B, seq: int = S):
    tf = transformers
    vision = dict(image_size=IMG, patch_size=8, attn_implementation=attn, **_SMALL)
    if name == "vit":
        model = tf.ViTModel(tf.ViTConfig(**vision), add_pooling_layer=False)
    elif name == "siglip":
        model = tf.SiglipVisionModel(tf.SiglipVisionConfig(**vision))
    elif name == "clip":
        model = tf.CLIPVisionModel(tf.CLIPVisionConfig(projection_dim=16, **vision))
    elif name == "bert":
        cfg = tf.BertConfig(vocab_size=100, max_position_embeddings=64, attn_implementation=attn, **_SMALL)
        model = tf.BertModel(cfg, add_pooling_layer=False)
    elif name == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_implementation=attn, use_cache=False
        )
        model = tf.GPT2Model(cfg)
    else:
        raise ValueError(name)
    if name in ("bert", "gpt2"):
        inputs = _text_inputs(batch, seq)
    else:
        inputs = {"pixel_values": torch.randn(batch, 3, IMG, IMG)}
    return _LastHidden(model, list(inputs)).eval(), inputs


def _export(model, inputs: dict, path, output_names=("last_hidden_state",), **kw) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, tuple(inputs.values()), str(path), input_names=list(inputs),
                          output_names=list(output_names), **kw)


def _check(path, model, inputs: dict, batch: int = B, seq_len: int | None = None) -> None:
    graph = import_onnx(path, batch=batch, seq_len=seq_len)
    feeds = {k: v.numpy() for k, v in inputs.items()}
    got = run(graph, feeds)[graph.outputs[0]]
    with torch.no_grad():
        ref = model(*inputs.values()).numpy()
    assert got.shape == ref.shape
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, f"max relative error {err:.2e}"


FAMILIES = ["vit", "siglip", "clip", "bert", "gpt2"]
EXPORTERS = {"dynamo": dict(dynamo=True), "legacy": dict(dynamo=False, opset_version=17)}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("exporter", list(EXPORTERS))
@pytest.mark.parametrize("family", FAMILIES)
def test_export_imports_and_matches_torch(family: str, exporter: str, attn: str, tmp_path) -> None:
    torch.manual_seed(0)
    model, inputs = _family(family, attn)
    path = tmp_path / "model.onnx"
    _export(model, inputs, path, **EXPORTERS[exporter])
    if exporter == "dynamo":
        assert (tmp_path / "model.onnx.data").exists()  # weights come through onnx's external-data loader
    _check(path, model, inputs)


@pytest.mark.parametrize("family", ["bert", "vit", "gpt2"])
def test_legacy_opset14_decomposed_layernorm_and_erf_gelu(family: str, tmp_path) -> None:
    # Before opset 17 there is no LayerNormalization: it arrives as ReduceMean/Sub/Pow/Sqrt/Div, GELU as Erf.
    torch.manual_seed(1)
    model, inputs = _family(family, "eager")
    path = tmp_path / "model.onnx"
    _export(model, inputs, path, dynamo=False, opset_version=14)
    _check(path, model, inputs)


@pytest.mark.parametrize("family", ["bert", "siglip"])
def test_dynamo_opset18_without_the_gelu_op(family: str, tmp_path) -> None:
    # Opset 18 has no Gelu op and takes reduction axes as inputs: the other side of the since_version table.
    torch.manual_seed(5)
    model, inputs = _family(family, "eager")
    path = tmp_path / "model.onnx"
    _export(model, inputs, path, dynamo=True, opset_version=18)
    _check(path, model, inputs)


def test_legacy_dynamic_axes_take_batch_and_seq_len(tmp_path) -> None:
    torch.manual_seed(2)
    model, inputs = _family("bert", "eager")
    path = tmp_path / "model.onnx"
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    _export(model, inputs, path, dynamo=False, opset_version=17, dynamic_axes=axes)
    _, other = _family("bert", "eager", batch=3, seq=5)
    _check(path, model, other, batch=3, seq_len=5)


def test_dynamo_dynamic_shapes_take_batch_and_seq_len(tmp_path) -> None:
    torch.manual_seed(3)
    model, inputs = _family("gpt2", "eager")
    path = tmp_path / "model.onnx"
    dims = {0: torch.export.Dim("batch", max=16), 1: torch.export.Dim("seq_len", max=32)}
    _export(model, inputs, path, dynamo=True, dynamic_shapes=((dims, dims),))  # one entry: forward(*xs)
    _, other = _family("gpt2", "eager", batch=3, seq=5)
    _check(path, model, other, batch=3, seq_len=5)


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_batch_probes_import_the_file_once_and_plan_as_the_file_at_that_batch(family: str, tmp_path, monkeypatch):
    """compiler.builder for a file: the batch search's probes rebatch one import (issue #13) instead of importing
    the file per probe, and a probe plans exactly as the file imported at that batch does."""
    from tremula import compiler, frontends
    from tremula.pipeline import plan_graph
    from tremula.target.chip import load_chip

    torch.manual_seed(9)
    model, inputs = _family(family, "eager")
    path = tmp_path / "model.onnx"
    _export(model, inputs, path, dynamo=False, opset_version=17, dynamic_axes={k: {0: "batch"} for k in inputs})
    loads = []
    real = frontends.load_model
    monkeypatch.setattr(frontends, "load_model", lambda *a, **k: loads.append(k.get("batch")) or real(*a, **k))
    build = compiler.builder(str(path), None)
    probes = {b: build(b) for b in (1, 2, 8)}
    assert loads == [1]
    for b, g in probes.items():
        assert g.types[g.inputs[0]].shape[0] == b
    chip = load_chip("c600")
    p, e = plan_graph(probes[8], chip, "float16"), plan_graph(build.exact(8), chip, "float16")
    ps, probe, es, exact = p.state, p.memory, e.state, e.memory
    assert loads == [1, 8]
    assert (len(ps.steps), probe.peak_bytes, probe.fullest_tile, probe.by_category) == (
        len(es.steps), exact.peak_bytes, exact.fullest_tile, exact.by_category)


@pytest.mark.parametrize("family", ["vit", "bert"])
def test_dynamo_unoptimized_export_folds_its_shape_noise(family: str, tmp_path) -> None:
    # Without onnxscript's optimizer the export keeps Constant/Identity/CastLike/Range/Expand noise to fold.
    # (Local functions are tested with a hand-built model in tests/unit: torch 2.13's legacy
    # export_modules_as_functions fails inside torch, and the dynamo exporter inlines its functions.)
    torch.manual_seed(4)
    model, inputs = _family(family, "eager")
    path = tmp_path / "model.onnx"
    _export(model, inputs, path, dynamo=True, optimize=False)
    _check(path, model, inputs)


class _Pooled(torch.nn.Module):
    """pixel_values in; last_hidden_state and the attention-pooling head's pooler_output out."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        out = self.model(pixel_values=pixel_values)
        return out.last_hidden_state, out.pooler_output


@pytest.mark.parametrize("head", [False, True], ids=["body", "head"])
@pytest.mark.parametrize("exporter", list(EXPORTERS))
def test_export_shares_its_layers_as_the_zoo_model_does(exporter, head, tmp_path, monkeypatch) -> None:
    """Issue #14: the seed user's so400m export planned without shared layers, the zoo model with. The legacy
    exporter stores equal initializers once (a fresh model's LayerNorm scales are all one all-ones vector, its biases
    one all-zeros vector), so every layer read the first layer's vectors and no layer could run a template's code; the
    dynamo exporter names nodes node_linear_7 and initializers val_44, so no layer could be found by its name (layers
    are now found by structure, ir/layers.py). Planned with shared layers only, either export shares as many layers
    as the zoo build of the same architecture, and its plan has the zoo model's steps and cycles.

    With the attention-pooling head (torch's MultiheadAttention: sequence-first, one projection for k and v split by
    Gathers, a 3-D attention over batch x heads, its query a constant folded at export), the head is rewritten into
    the zoo's form (passes/fuse_heads.py) and plans as the zoo's head does. Its weights are perturbed there, so that
    no exporter drops a zero bias the zoo model keeps."""
    from tremula import pipeline
    from tremula.check import check_model
    from tremula.compiler import compile_model
    from tremula.models.build import build_from_config
    from tremula.models.configs import VisionConfig
    from tremula.models.weights import LazyWeights

    torch.manual_seed(6)
    dims = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64)
    model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(image_size=IMG, patch_size=8,
                                                                           attn_implementation="eager", **dims))
    inputs = {"pixel_values": torch.randn(B, 3, IMG, IMG)}
    path = tmp_path / "siglip.onnx"
    dynamic = {"dynamic_axes": {"pixel_values": {0: "batch"}}} if exporter == "legacy" else {}  # dynamo: batch B
    if head:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        _export(_Pooled(model).eval(), inputs, path, output_names=["last_hidden_state", "pooler_output"],
                **EXPORTERS[exporter], **dynamic)
    else:
        _export(_LastHidden(model, list(inputs)).eval(), inputs, path, **EXPORTERS[exporter], **dynamic)
    monkeypatch.setattr(pipeline, "PLAN_BUDGETS", ((0.12, None, True),))
    zoo = compile_model(lambda b: build_from_config("siglip", VisionConfig("siglip", 32, 4, 4, 64, IMG, 8, 1e-6,
                                                                           "gelu_tanh", head=head),
                                                    LazyWeights(), batch=b), "c600", 2, "fp16")
    res = check_model(str(path), "c600", 2, "fp16")
    assert res.passed
    assert res.compile.shared_layers == zoo.shared_layers == 3
    got = res.compile
    if head:  # the head's attention reads the projections as the zoo's does, with no re-layout of its own
        attn = [n for n in got.graph.nodes if n.op == "Attention"][-1]
        producers = got.graph.producers()
        assert [producers[x].op for x in attn.inputs[1:3]] == ["Transpose", "Transpose"]
        assert attn.inputs[0] in got.graph.constants and attn.attrs["scale"] == 1.0
    # and plans as the zoo model does: the same steps and cycles (the legacy exporter's tied vectors untied per node,
    # plan/layers.untie_layer_vectors), and the same memory, except that the dynamo exporter's optimizer drops the
    # patch embedding's bias of a fresh model, all zeros, by folding it into the position embedding it is added to:
    # one vector fewer, a few bytes fewer on the fullest tile (the perturbed model keeps it)
    assert (got.steps, got.cycles, got.compute_cycles, got.exchange_cycles, got.sync_cycles) == \
        (zoo.steps, zoo.cycles, zoo.compute_cycles, zoo.exchange_cycles, zoo.sync_cycles)
    if exporter == "legacy" or head:
        assert (got.peak_tile_bytes, got.memory_by_category) == (zoo.peak_tile_bytes, zoo.memory_by_category)
    else:
        assert len(got.graph.constants) == len(zoo.graph.constants) - 1
        assert 0 <= zoo.peak_tile_bytes - got.peak_tile_bytes <= 64


class _SelfAttention(torch.nn.Module):
    """x + MultiheadAttention(LayerNorm(x)), then a Linear: torch's own attention module, batch-first."""

    def __init__(self, need_weights: bool):
        super().__init__()
        self.need_weights = need_weights
        self.ln = torch.nn.LayerNorm(32)
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, x):
        h = self.ln(x)
        return self.fc(x + self.attn(h, h, h, need_weights=self.need_weights)[0])


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("exporter", list(EXPORTERS))
def test_multihead_attention_module_reads_its_projection_per_head(exporter, need_weights, tmp_path) -> None:
    """nn.MultiheadAttention(batch_first=True) runs sequence-first inside and transposes back after its
    out-projection; after passes/fuse_heads.py its attention reads q, k and v as head views of its one in-projection
    and writes the output where the out-projection reads it, as the zoo's attention does (no re-layout of its own)."""
    from tremula.pipeline import canonical
    from tremula.plan.head_views import head_views

    torch.manual_seed(2)
    model = _SelfAttention(need_weights).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    inputs = {"x": torch.randn(B, 10, 32)}
    path = tmp_path / "mha.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (inputs["x"],), str(path), input_names=["x"], output_names=["y"],
                          **EXPORTERS[exporter])
    g = canonical(import_onnx(path, batch=B))
    (attn,) = [n for n in g.nodes if n.op == "Attention"]
    ins, outs, skip = head_views(g)
    assert set(attn.inputs[:3]) <= set(ins) and attn.outputs[0] in outs
    assert g.types[attn.outputs[0]].shape == (B, 4, 10, 8)
    with torch.no_grad():
        ref = model(inputs["x"]).numpy()
    got = run(g, {"x": inputs["x"].numpy()})["y"]
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-4


@pytest.mark.parametrize("exporter", list(EXPORTERS))
def test_bert_export_masks_and_token_types_plan_as_the_checkpoint(exporter, tmp_path) -> None:
    """transformers' BERT export builds its padding mask as [B, 1, S, S] (the [B, S] mask flattened, gathered back,
    and-ed with an all-true pattern, then Where) and folds its token-type embedding of all-zero ids to [B, S, D]. The
    folding simplifications take both back to what the same checkpoint's folder builds: a [B, 1, 1, S] additive mask
    that attention broadcasts, and one token-type row. The plan then has the folder's steps and fullest tile."""
    from tremula.compiler import compile_model
    from tremula.frontends import load_model
    from tremula.pipeline import canonical

    torch.manual_seed(0)
    wrapper, inputs = _family("bert", "eager")
    with torch.no_grad():
        for p in wrapper.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path / "bert"
    wrapper.model.save_pretrained(folder, safe_serialization=True)
    path = tmp_path / "bert.onnx"
    _export(wrapper, inputs, path, **EXPORTERS[exporter])
    g = canonical(import_onnx(path, batch=B, seq_len=S))
    masks = {g.types[n.inputs[3]].shape for n in g.nodes if n.op == "Attention"}
    assert masks == {(B, 1, 1, S)}
    assert [n.op for n in g.nodes].count("Gather") == 1  # the word lookup only
    emb = [n for n in g.nodes if n.op == "Add"][:2]  # the token-type and position sums
    assert sorted(g.types[n.inputs[1]].shape[:-1] for n in emb) == [(1, 1), (1, S)]
    _check(path, wrapper, inputs, seq_len=S)
    got = compile_model(lambda b: load_model(str(path), b, seq_len=S), "c600", B, "fp16")
    ref = compile_model(lambda b: load_model(str(folder), b, seq_len=S), "c600", B, "fp16")
    assert (got.steps, got.peak_tile_bytes) == (ref.steps, ref.peak_tile_bytes)

"""Every tiny zoo model: the reference interpreter on its Graph equals onnxruntime on the Graph's ONNX export."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from tremula.export.onnx_export import export_onnx
from tremula.frontends.zoo import ZOO, build_zoo
from tremula.ir.interp import run

TINY = [n for n, e in ZOO.items() if e.tiny]


def feeds_for(graph, rng: np.random.Generator, vocab: int | None) -> dict[str, np.ndarray]:
    feeds = {}
    for name in graph.inputs:
        t = graph.types[name]
        if name == "pixel_values":
            feeds[name] = rng.standard_normal(t.shape).astype(np.float32)
        elif name == "input_ids":
            feeds[name] = rng.integers(0, vocab, t.shape).astype(np.int64)
        elif name == "attention_mask":
            m = np.ones(t.shape, np.int64)
            m[-1, t.shape[1] // 2:] = 0  # the last row is padded
            feeds[name] = m
        elif name == "token_type_ids":
            feeds[name] = (np.arange(t.shape[1]) >= t.shape[1] // 3).astype(np.int64)[None].repeat(t.shape[0], 0)
        else:
            raise AssertionError(f"no feed for {name}")
    return feeds


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", TINY)
def test_tiny_zoo_matches_onnxruntime(name, batch):
    g = build_zoo(name, batch=batch, seed=7)
    # Zoo init leaves biases at 0 and LayerNorms at 1 like HF; perturb them so a swapped or ignored bias shows.
    rng = np.random.default_rng(11)
    for c in g.constants.values():
        v = c.value()
        if v.dtype == np.float32 and v.ndim >= 1:
            c.data = (v + rng.standard_normal(v.shape).astype(np.float32) * np.float32(0.05)).astype(np.float32)
    feeds = feeds_for(g, rng, getattr(ZOO[name].config, "vocab", None))
    ours = run(g, feeds)
    sess = ort.InferenceSession(export_onnx(g).SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    assert set(theirs) == set(g.outputs)
    for k in g.outputs:
        assert ours[k].shape == theirs[k].shape
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_tiny_text_models_honour_seq_len():
    for name in ("bert-tiny", "gpt2-tiny"):
        g = build_zoo(name, batch=2, seq_len=5)
        assert g.types["input_ids"].shape == (2, 5)
        assert g.types["last_hidden_state"].shape[:2] == (2, 5)

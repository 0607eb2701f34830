"""A repeated layer lowered once and copied (plan/replay.py) is exactly what lowering every layer makes: the whole
lowering state compared field by field, on models of every family, and layers the copy cannot rename lowered."""

import dataclasses
import random

import numpy as np
import pytest

from tremula.frontends import load_model
from tremula.ir.layers import find_layers
from tremula.pipeline import lower_precision
from tremula.plan.layers import untie_layer_vectors
from tremula.plan.lower_ops import Lowerer
from tremula.target.chip import load_chip

TINY16, TINY64 = "examples/chips/tiny16.toml", "examples/chips/tiny64.toml"
STATE = ("bufs", "steps", "consts", "layouts", "strategies", "split_sums", "paired", "host_in", "host_out", "wload",
         "placed", "cursor", "row_cursor", "weight_layer")


def _same(a, b, path: str) -> None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b), path
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), path
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (path, set(a) ^ set(b))
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def _graph(model: str, batch: int, dtype: str, chip, edit=None):
    g = load_model(model, batch)
    scales = None
    if dtype == "fp8":  # calibrated-like scales that differ from layer to layer (and sometimes repeat)
        from tremula.batch_search import placeholder_scales

        rnd = random.Random(0)
        scales = {k: rnd.choice([-2, -1, 0, 1, 2]) for k in placeholder_scales(g)}
    g = untie_layer_vectors(lower_precision(g, dtype, chip, scales, "half"))
    if edit is not None:
        edit(g)
    return g


def _both(g, chip, temp_fraction=0.15, perm_fraction=0.4):
    layers = find_layers(g)
    return [Lowerer(g, chip, temp_fraction=temp_fraction, perm_fraction=perm_fraction, share_layers=True,
                    layers=layers, replay=replay).lower() for replay in (False, True)]


@pytest.mark.parametrize("model,batch,dtype,chip", [
    ("bert-tiny", 4, "float16", "c600"),
    ("siglip-tiny", 2, "fp8", "c600"),
    ("minilm-tiny", 3, "fp8", "c600"),
    ("gpt2-tiny", 2, "float32", TINY64),
    ("clip-tiny", 2, "float16", "c600"),
    ("vit-tiny", 4, "float16", TINY16),  # serial splits: rounds of every matmul
    ("bert-tiny", 8, "float16", TINY16),
])
def test_a_copied_layer_is_what_lowering_it_makes(model, batch, dtype, chip):
    chip = load_chip(chip)
    full, copied = _both(_graph(model, batch, dtype, chip), chip)
    runs = {k[0] for k in find_layers(copied.graph).values()}
    replayed = {k for k in set(find_layers(copied.graph).values()) if k[1] > 0}
    assert replayed and not copied.replay_misses and all(copied._templates[r] is not None for r in runs)
    for f in STATE:
        _same(getattr(full, f), getattr(copied, f), f)


def test_a_layer_with_another_attribute_is_lowered_not_copied():
    """A LayerNorm epsilon is no per-layer parameter the copy rewrites: the layer that differs is lowered, and the
    state is still the full lowering's."""
    chip = load_chip("c600")

    def edit(g):
        lns = [n for n in g.nodes if n.op == "LayerNorm" and ".1." in (n.name or "")]
        assert lns
        lns[0].attrs = {**lns[0].attrs, "epsilon": 1e-3}

    full, copied = _both(_graph("bert-tiny", 4, "float16", chip, edit), chip)
    assert list(copied.replay_misses.values()) == ["a node attribute differs outside the per-layer parameters"]
    for f in STATE:
        _same(getattr(full, f), getattr(copied, f), f)


def test_stochastic_rounding_is_lowered_not_copied():
    chip = load_chip("c600")

    def edit(g):
        for n in g.nodes:
            if n.op == "Fp8Quantize":
                n.attrs = {**n.attrs, "rounding": "stochastic"}

    full, copied = _both(_graph("siglip-tiny", 2, "fp8", chip, edit), chip)
    assert copied.replay_misses
    for f in STATE:
        _same(getattr(full, f), getattr(copied, f), f)


@pytest.mark.parametrize("model,batch,dtype", [("siglip-tiny", 2, "fp8"), ("bert-tiny", 4, "float16")])
def test_sharing_checks_a_replays_renaming_before_it_uses_it(model, batch, dtype):
    """find_sharing pairs a replayed layer's buffers through the replay's renaming once every id checks against it
    (plan/share._hinted_pairs): the same Sharing as pairing them the long way; a renaming that lies is refused."""
    from tremula.plan import share

    chip = load_chip("c600")
    _, copied = _both(_graph(model, batch, dtype, chip), chip)
    kept = dict(copied.replayed)
    assert kept
    hinted = share.find_sharing(copied)
    copied.replayed = {}
    plain = share.find_sharing(copied)
    assert plain.shared_layers > 0
    _same(hinted, plain, "sharing")
    # two ids the template names swapped in one layer's renaming: every place is checked, so the hint is refused
    key, (tkey, bmap) = next(iter(kept.items()))
    entries = share._entries(copied)
    ids = share._named_ids(copied, entries[tkey])
    a, b = ids[bmap[ids] >= 0][:2]
    lie = bmap.copy()
    lie[a], lie[b] = bmap[b], bmap[a]
    is_w = np.array([x.category == "weights" for x in copied.bufs], bool)
    truth = share._match(copied, entries[tkey], entries[key], is_w)
    assert truth is not None
    for renaming, want in ((bmap, truth), (lie, truth)):
        hint = share._Renaming(renaming, len(copied.bufs), lambda: ids)
        got = share._match(copied, entries[tkey], entries[key], is_w, hint)
        assert got[0] == want[0] and np.array_equal(got[1], want[1])
    named = []  # the lie alone gives no pairs: _match paired them the long way
    for (ka, kind, ia), (kb, _, ib) in zip(entries[tkey], entries[key]):
        if kind == 0:
            named.append((copied.steps[kb].groups[ib].bufs, copied.steps[ka].groups[ia].bufs))
        else:
            ta, tb = copied.steps[ka].transfers[ia], copied.steps[kb].transfers[ib]
            named += [(tb.src_buf, ta.src_buf), (tb.d_buf, ta.d_buf)]
    assert share._hinted_pairs(share._Renaming(lie, len(copied.bufs), lambda: ids), named) is None
    assert share._hinted_pairs(share._Renaming(bmap, len(copied.bufs), lambda: ids), named) is not None
    copied.replayed = {**kept, key: (tkey, lie)}
    _same(share.find_sharing(copied), plain, "sharing with a false renaming")

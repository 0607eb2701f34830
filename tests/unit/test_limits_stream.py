"""The lower bound with streamed weights (limits.needs(stream=True)): runs of three or more repeated layers keep
two layers' constants on the chip, everything else counts as before."""

from tremula import limits
from tremula.frontends import load_model
from tremula.frontends.zoo import _vision
from tremula.ir.layers import find_layers, node_key
from tremula.models.build import build_from_config
from tremula.models.weights import LazyWeights
from tremula.pipeline import canonical


def _layer_bytes(g, dtype: str) -> dict:
    """layer -> bytes of the constants its nodes read, at `dtype` on the chip."""
    layers = find_layers(g)
    per: dict = {}
    for n in g.nodes:
        key = layers.get(node_key(n))
        for v in n.inputs:
            if key is not None and v in g.constants:
                per.setdefault(key, {})[v] = g.types[v].size * limits.stored_itemsize(g.types[v], dtype)
    return {k: sum(d.values()) for k, d in per.items()}


def test_two_layers_are_too_few_to_stream():
    g = canonical(load_model("bert-tiny", batch=1))
    assert limits.needs(g, "float16", 1, stream=True) == limits.needs(g, "float16", 1)


def test_streaming_leaves_two_layers_of_each_run():
    g = canonical(build_from_config("siglip", _vision("siglip", 32, 4, 4, 48, 32, 8, 1e-6, "gelu_tanh"),
                                    LazyWeights(), batch=1, name="siglip-tiny4"))
    per = _layer_bytes(g, "float16")
    assert len(per) == 4 and len(set(per.values())) == 1
    resident, streamed = limits.needs(g, "float16", 1), limits.needs(g, "float16", 1, stream=True)
    assert resident.weights - streamed.weights == 2 * next(iter(per.values()))
    assert streamed.live == resident.live
    assert limits.needs(g, None, 1, stream=True).weights == limits.needs(g, None, 1).weights  # the host holds all

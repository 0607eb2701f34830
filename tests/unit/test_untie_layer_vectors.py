"""plan/layers.untie_layer_vectors: vector constants several layers read get one copy per layer; matrices stay tied."""

import numpy as np

from tremula.ir import GraphBuilder, run
from tremula.ir.layers import find_layers
from tremula.plan.layers import untie_layer_vectors


def _two_layers(shared_matrix: bool):
    b = GraphBuilder("tied")
    x = b.input("x", (2, 4), "float32")
    ones = b.const("ones", np.ones(4, np.float32))  # one vector read by both layers, as an exporter stores it
    w0 = b.const("w", np.arange(16, dtype=np.float32).reshape(4, 4) / 16)
    w1 = w0 if shared_matrix else b.const("w1", np.eye(4, dtype=np.float32))
    h = x
    for i, w in enumerate((w0, w1)):
        h = b.op("LayerNorm", [h, ones, ""], name=f"enc.layers.{i}.ln")
        h = b.op("Linear", [h, w, ones], name=f"enc.layers.{i}.fc")
    b.output(h)
    return b.build()


def test_each_layer_gets_its_own_vector_and_the_values_do_not_change():
    g = _two_layers(shared_matrix=False)
    u = untie_layer_vectors(g, find_layers(g))
    reads = {n.name: [v for v in n.inputs if v in u.constants and len(u.types[v].shape) == 1] for n in u.nodes}
    assert set(reads["enc.layers.0.ln"]) == {"ones"}  # the first layer keeps the original
    assert set(reads["enc.layers.1.ln"]) == set(reads["enc.layers.1.fc"]) == {"ones@run0.1"}
    assert np.array_equal(u.constants["ones@run0.1"].value(), g.constants["ones"].value())
    x = {"x": np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)}
    assert np.array_equal(run(u, x)[u.outputs[0]], run(g, x)[g.outputs[0]])
    assert "ones" in g.nodes[2].inputs and "ones@run0.1" not in g.constants  # the input graph is left as it was


def test_matrices_stay_tied_and_an_untied_graph_is_returned_as_it_is():
    g = _two_layers(shared_matrix=True)
    u = untie_layer_vectors(g, find_layers(g))
    assert [n.inputs[1] for n in u.nodes if n.op == "Linear"] == ["w", "w"]
    g = _two_layers(shared_matrix=False)
    g.nodes = [n for n in g.nodes if n.name.startswith("enc.layers.0")]
    g.outputs = [g.nodes[-1].outputs[0]]
    assert untie_layer_vectors(g, find_layers(g)) is g

"""plan/layers.untie_layer_vectors: vector constants several nodes read get one copy per node, as a model built with its
own per node has them; matrices stay tied."""

import numpy as np

from tremula.ir import GraphBuilder, run
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


def test_each_node_gets_its_own_vector_and_the_values_do_not_change():
    g = _two_layers(shared_matrix=False)
    u = untie_layer_vectors(g)
    reads = {n.name: [v for v in n.inputs if v in u.constants and len(u.types[v].shape) == 1] for n in u.nodes}
    assert reads["enc.layers.0.ln"] == ["ones"]  # the first reader keeps the original
    copies = [reads[f"enc.layers.{i}.{op}"] for i in (0, 1) for op in ("ln", "fc")][1:]
    assert all(len(c) == 1 for c in copies) and len({c[0] for c in copies} | {"ones"}) == 4  # within a layer too
    assert copies[0] == ["ones@enc.layers.0.fc"]
    for (c,) in copies:
        assert np.array_equal(u.constants[c].value(), g.constants["ones"].value())
    x = {"x": np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)}
    assert np.array_equal(run(u, x)[u.outputs[0]], run(g, x)[g.outputs[0]])
    assert "ones" in g.nodes[2].inputs and "ones@enc.layers.0.fc" not in g.constants  # the input is left as it was


def test_matrices_stay_tied_and_an_untied_graph_is_returned_as_it_is():
    g = _two_layers(shared_matrix=True)
    u = untie_layer_vectors(g)
    assert [n.inputs[1] for n in u.nodes if n.op == "Linear"] == ["w", "w"]
    g = _two_layers(shared_matrix=False)
    g.nodes = [n for n in g.nodes if n.name == "enc.layers.0.ln"]
    g.outputs = [g.nodes[-1].outputs[0]]
    assert untie_layer_vectors(g) is g


def test_a_model_without_repeated_layers_is_untied_too():
    """One layer: nothing to share, but it still plans as the model built with its own vectors does."""
    g = _two_layers(shared_matrix=False)
    keep = {"enc.layers.0.ln", "enc.layers.0.fc"}
    g.nodes = [n for n in g.nodes if n.name in keep]
    g.outputs = [g.nodes[-1].outputs[0]]
    u = untie_layer_vectors(g)
    assert [v for n in u.nodes for v in n.inputs if v.startswith("ones")] == ["ones", "ones@enc.layers.0.fc"]

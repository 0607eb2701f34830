"""ir/layers.find_layers: repeated layers found by structure agree with the zoo's layer names, whatever the names."""

import re

import numpy as np
import pytest

from tremula.frontends import load_model
from tremula.ir import GraphBuilder
from tremula.ir.graph import Constant, Graph, Node
from tremula.ir.layers import find_layers, layer_roles, node_key
from tremula.pipeline import canonical

# The zoo names each layer's nodes <prefix><index>.…: the oracle the structure must reproduce.
_NAMED = re.compile(r"^(encoder\.layers?\.|h\.|text_model\.encoder\.layers\.)(\d+)\.")
TINY = ("bert-tiny", "minilm-tiny", "gpt2-tiny", "vit-tiny", "siglip-tiny", "clip-tiny")


def _partition(keys: dict[str, tuple]) -> list[list[str]]:
    groups: dict[tuple, list[str]] = {}
    for name, key in keys.items():
        groups.setdefault(key, []).append(name)
    return sorted(sorted(v) for v in groups.values())


def _by_name(g: Graph) -> dict[str, tuple]:
    out = {}
    for n in g.nodes:
        m = _NAMED.match(node_key(n))
        if m:
            out[node_key(n)] = (m.group(1), int(m.group(2)))
    return out


def _anonymous(g: Graph) -> Graph:
    """The graph with every node, value and constant renamed as the dynamo exporter names them (node_7, val_44)."""
    ren = {v: f"val_{i}" for i, v in enumerate(g.types) if v not in g.inputs and v not in g.outputs}
    r = lambda v: ren.get(v, v)
    return Graph(g.name, list(g.inputs), list(g.outputs),
                 [Node(n.op, [r(v) if v else v for v in n.inputs], [r(v) for v in n.outputs], dict(n.attrs),
                       f"node_{i}") for i, n in enumerate(g.nodes)],
                 {r(k): Constant(r(k), c.type, data=c.data) if not c.is_lazy else c for k, c in g.constants.items()},
                 {r(k): t for k, t in g.types.items()})


@pytest.mark.parametrize("model", TINY)
def test_layers_by_structure_are_the_zoo_models_named_layers(model):
    g = canonical(load_model(model, batch=2))
    found = find_layers(g)
    assert len(set(found.values())) == 2
    assert _partition(found) == _partition(_by_name(g))


@pytest.mark.parametrize("model", ("bert-tiny", "vit-tiny"))  # post-norm and pre-norm: where a layer starts differs
def test_renamed_nodes_give_the_same_layers(model):
    g = canonical(load_model(model, batch=2))
    anon = _anonymous(g)
    found, found_anon = find_layers(g), find_layers(anon)
    per_node = [found.get(node_key(n)) for n in g.nodes]
    assert per_node == [found_anon.get(node_key(n)) for n in anon.nodes]
    first = next(i for i, k in enumerate(per_node) if k is not None)
    assert node_key(g.nodes[first]).startswith(("encoder.layer.0.", "encoder.layers.0."))  # not one LayerNorm early


def _stack(n: int, with_skip: bool = False) -> Graph:
    """n blocks of LayerNorm, Linear, Gelu, Linear and a residual Add; with_skip, block 2's Add reads block 0's
    output."""
    b = GraphBuilder("stack")
    h = b.input("x", (4, 8), "float32")
    outs = []
    for i in range(n):
        ones = b.const(f"g{i}", np.ones(8, np.float32))
        y = b.op("LayerNorm", [h, ones, ""], name=f"a{i}")
        y = b.op("Linear", [y, b.const(f"w{i}", np.eye(8, 16, dtype=np.float32)), ""], name=f"b{i}")
        y = b.op("Gelu", [y], name=f"c{i}")
        y = b.op("Linear", [y, b.const(f"v{i}", np.eye(16, 8, dtype=np.float32)), ""], name=f"d{i}")
        h = b.op("Add", [outs[0] if with_skip and i == 2 else h, y], name=f"e{i}")
        outs.append(h)
    b.output(h)
    return b.build()


def test_a_stack_of_blocks_is_one_run_with_one_layer_per_block():
    found = find_layers(_stack(4))
    assert _partition(found) == [[f"{c}{i}" for c in "abcde"] for i in range(4)]
    assert len({run for run, _ in found.values()}) == 1


def test_a_block_wired_differently_is_not_a_layer_of_the_run_and_one_block_is_no_run():
    found = find_layers(_stack(3, with_skip=True))  # block 2's residual reads block 0's output, not block 1's
    assert _partition(found) == [[f"{c}{i}" for c in "abcde"] for i in range(2)]
    assert find_layers(_stack(1)) == {}


@pytest.mark.parametrize("name", ["bert-tiny", "vit-tiny"])
def test_layer_roles_map_every_layer_onto_its_runs_first(name):
    g = canonical(load_model(name, batch=2))
    at, role = find_layers(g), layer_roles(g)
    nodes = {node_key(n): n for n in g.nodes}
    assert set(role) == set(at)
    for k, r in role.items():
        assert at[r] == (at[k][0], 0) and nodes[r].op == nodes[k].op
        assert (r == k) == (at[k][1] == 0)
    # a layer's nodes map one to one onto the first layer's
    per_layer: dict = {}
    for k, r in role.items():
        per_layer.setdefault(at[k], []).append(r)
    firsts = {key: sorted(v) for key, v in per_layer.items() if key[1] == 0}
    assert all(sorted(v) == firsts[(key[0], 0)] for key, v in per_layer.items())

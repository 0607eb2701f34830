"""Dead-code elimination: drop the nodes and constants that no graph output depends on."""

from __future__ import annotations

from tremula.ir.graph import Graph


def eliminate_dead_code(graph: Graph) -> Graph:
    """A new graph with only what the outputs need. Graph inputs stay even if unused: they are the interface."""
    g = graph.copy()
    live = set(g.outputs)
    kept = []
    for node in reversed(g.nodes):
        if any(o in live for o in node.outputs):  # a multi-output node (Split) stays whole if any output is read
            kept.append(node)
            live.update(i for i in node.inputs if i)
    g.nodes = kept[::-1]
    g.constants = {k: c for k, c in g.constants.items() if k in live}
    defined = set(g.inputs) | set(g.constants) | {o for n in g.nodes for o in n.outputs}
    g.types = {k: t for k, t in g.types.items() if k in defined}
    return g

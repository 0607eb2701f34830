"""The NumPy reference interpreter: the numerical specification of a Graph, checked against onnxruntime."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tremula.errors import TremulaError
from tremula.ir.graph import Graph, Node, TensorType
from tremula.ir.ops import RefRule, infer, rule


def infer_types(graph: Graph) -> Graph:
    """Recompute the type of every node output from the op rules, checking that the nodes are in topological order."""
    types: dict[str, TensorType] = {n: graph.types[n] for n in graph.inputs}
    types.update({n: c.type for n, c in graph.constants.items()})
    for node in graph.nodes:
        ins = []
        for i in node.inputs:
            if i and i not in types:
                raise TremulaError(f"node {node.name or node.op} reads {i!r} before it is defined")
            ins.append(types[i] if i else None)
        while ins and ins[-1] is None:  # trailing omitted optional inputs
            ins.pop()
        outs = infer(node.op, ins, node.attrs)
        if len(outs) != len(node.outputs):
            raise TremulaError(
                f"node {node.name or node.op} has {len(node.outputs)} outputs, {node.op} makes {len(outs)}"
            )
        types.update(zip(node.outputs, outs))
    for o in graph.outputs:
        if o not in types:
            raise TremulaError(f"graph output {o!r} is never produced")
    graph.types = types
    return graph


def check_feeds(graph: Graph, feeds: dict[str, np.ndarray]) -> None:
    for name in graph.inputs:
        if name not in feeds:
            raise TremulaError(f"missing input {name!r} ({graph.types[name]})")
        t, x = graph.types[name], feeds[name]
        if tuple(x.shape) != t.shape:
            raise TremulaError(f"input {name!r} has shape {tuple(x.shape)}, the graph expects {t.shape}")


def run(graph: Graph, feeds: dict[str, np.ndarray], keep: set[str] | None = None,
        override: Callable[[Node], RefRule | None] | None = None,
        observe: Callable[[str, np.ndarray], None] | None = None) -> dict[str, np.ndarray]:
    """Evaluate the graph; returns its outputs (and any values named in `keep`). `override` may give a node another
    evaluation than its op's rule (the precision-matched reference's K-split matmuls, sim/reference.py). `observe`
    is called with each input (in the graph's dtype) and each node output as it is made (a value seen so need not
    be kept to the end)."""
    check_feeds(graph, feeds)
    env: dict[str, np.ndarray] = {n: np.asarray(feeds[n]).astype(graph.types[n].dtype) for n in graph.inputs}
    if observe is not None:
        for n in graph.inputs:
            observe(n, env[n])
    last_use: dict[str, int] = {}
    for idx, node in enumerate(graph.nodes):
        for i in node.inputs:
            last_use[i] = idx
    wanted = set(graph.outputs) | (keep or set())
    for idx, node in enumerate(graph.nodes):
        args = [
            (env[i] if i in env else graph.constants[i].value()) if i else None for i in node.inputs
        ]
        while args and args[-1] is None:
            args.pop()
        ref = override(node) if override is not None else None
        outs = (ref or rule(node.op).ref)(args, node.attrs)
        for name, val in zip(node.outputs, outs):
            env[name] = val
            if observe is not None:
                observe(name, val)
        for i in node.inputs:  # free what no later node reads, so a big model runs in bounded memory
            if i in env and last_use.get(i) == idx and i not in wanted:
                del env[i]
    return {n: (env[n] if n in env else graph.constants[n].value()) for n in wanted}

"""Pipeline stages: a canonical Graph cut between its repeated layers into consecutive sub-graphs, one per chip,
balanced by what each stage computes and holds.

A stage is the nodes [first, end) of the graph in topological order. Its inputs are the values it reads that it
does not make: graph inputs (streamed from the host to the chip that reads them) and values an earlier stage made
(sent over IPU-Links). Its outputs are the values it makes that a later stage reads or that are graph outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tremula.errors import TremulaError
from tremula.ir.graph import Graph
from tremula.ir.layers import find_layers, node_key
from tremula.ir.ops import flops
from tremula.limits import stored_itemsize


@dataclass(frozen=True)
class Stage:
    graph: Graph
    first: int  # the stage's nodes are the whole graph's nodes [first, end)
    end: int
    sources: dict[str, int]  # each input -> the stage that makes it (-1: a graph input, from the host)


def cut_points(graph: Graph) -> list[int]:
    """Node positions a pipeline may be cut at: where one repeated layer ends and the next starts, and before and
    after each run of layers (a transformer's residual stream, and the values every layer reads such as a mask,
    are all that crosses there). A graph without repeated layers may be cut anywhere."""
    layers = find_layers(graph)
    at = [layers.get(node_key(n)) for n in graph.nodes]
    cuts = {i for i in range(1, len(at)) if at[i] is not None and at[i] != at[i - 1]}
    cuts |= {i for i in range(1, len(at)) if at[i - 1] is not None and at[i] is None}
    return sorted(cuts) if cuts else list(range(1, len(graph.nodes)))


def node_loads(graph: Graph, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(FLOPs, weight bytes at the compile dtype) of each node; a constant read by several nodes counts at its
    first reader (the stage that holds it)."""
    f = np.zeros(len(graph.nodes), np.float64)
    w = np.zeros(len(graph.nodes), np.float64)
    seen: set[str] = set()
    for i, n in enumerate(graph.nodes):
        f[i] = flops(n.op, [graph.types[v] for v in n.inputs if v], [graph.types[o] for o in n.outputs], n.attrs)
        for v in n.inputs:
            if v in graph.constants and v not in seen:
                seen.add(v)
                t = graph.constants[v].type
                w[i] += t.size * stored_itemsize(t, dtype)
    return f, w


def balanced_cuts(graph: Graph, stages: int, dtype: str) -> list[int]:
    """stages - 1 cut positions (from cut_points) that minimise the largest stage's load, a stage's load being the
    larger of its share of the FLOPs (its time, when stages run side by side) and its share of the weight bytes
    (what decides whether it fits). Exact, by dynamic programming over the cut points."""
    if stages == 1:
        return []
    points = cut_points(graph)
    if len(points) < stages - 1:
        raise TremulaError(f"{graph.name} has {len(points) + 1} places to cut a pipeline between its layers: it "
                           f"cannot be cut into {stages} stages")
    f, w = node_loads(graph, dtype)
    cf = np.concatenate([[0.0], np.cumsum(f)]) / max(f.sum(), 1.0)
    cw = np.concatenate([[0.0], np.cumsum(w)]) / max(w.sum(), 1.0)
    bounds = [0, *points, len(graph.nodes)]  # bounds[j]: a stage may start or end here

    def load(a: int, b: int) -> float:
        return max(cf[bounds[b]] - cf[bounds[a]], cw[bounds[b]] - cw[bounds[a]])

    m = len(bounds)
    inf = float("inf")
    # best[s][j]: the least largest load of s stages covering bounds[0]..bounds[j]; how[s][j]: where the last begins
    best = [[inf] * m for _ in range(stages + 1)]
    how = [[0] * m for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(1, m):
            for k in range(s - 1, j):
                if best[s - 1][k] < inf:
                    v = max(best[s - 1][k], load(k, j))
                    if v < best[s][j]:
                        best[s][j], how[s][j] = v, k
    cuts, j = [], m - 1
    for s in range(stages, 0, -1):
        j = how[s][j]
        cuts.append(bounds[j])
    return sorted(cuts)[1:]  # the first stage's start (0) is not a cut


def split(graph: Graph, cuts: list[int]) -> list[Stage]:
    """The stages of `graph` cut before each node position in `cuts`."""
    n = len(graph.nodes)
    edges = [0, *cuts, n]
    if any(b <= a for a, b in zip(edges, edges[1:])) or edges[-1] != n:
        raise TremulaError(f"pipeline cuts {cuts} must be increasing node positions inside 1..{n - 1}")
    made_in: dict[str, int] = {}
    for k, (a, b) in enumerate(zip(edges, edges[1:])):
        for node in graph.nodes[a:b]:
            for o in node.outputs:
                made_in[o] = k
    read_later: set[str] = set()  # values read by a later stage than the one that makes them
    for k, (a, b) in enumerate(zip(edges, edges[1:])):
        for node in graph.nodes[a:b]:
            read_later.update(v for v in node.inputs if v and made_in.get(v, k) < k)
    out = []
    copied = graph.copy().nodes  # each stage's nodes are its own objects (passes may rewrite them)
    for k, (a, b) in enumerate(zip(edges, edges[1:])):
        nodes = copied[a:b]
        read = list(dict.fromkeys(v for node in nodes for v in node.inputs if v))
        inputs = [v for v in read if v not in graph.constants and made_in.get(v, -1) != k]
        made = [o for node in nodes for o in node.outputs]
        outputs = [o for o in made if o in read_later or o in graph.outputs]
        if not outputs:
            raise TremulaError(f"pipeline stage {k} of {graph.name} (nodes {a}..{b - 1}) makes nothing a later stage "
                               "or the host reads")
        consts = {v: graph.constants[v] for v in read if v in graph.constants}
        types = {v: graph.types[v] for v in [*inputs, *consts, *made]}
        g = Graph(f"{graph.name}.stage{k}", inputs, outputs, nodes, consts, types)
        out.append(Stage(g, a, b, {v: made_in.get(v, -1) for v in inputs}))
    return out

"""Repeated layers found by structure: runs of consecutive blocks of nodes with the same ops, shapes and wiring.

The planner lowers identical layers identically so they can share one copy of their code (plan/layers.py,
plan/share.py). Which nodes form a layer used to be read from node names (`encoder.layer.3.…`); exporters do not keep
them: torch.onnx's dynamo exporter names nodes `node_linear_7`, `node_MatMul_113`, and initializers `val_44`. Here a
layer is what the graph's structure says it is, whatever the names:

- Every node gets a signature: its op, its attributes (except float values and PER_LAYER_ATTRS, which may differ
  per layer: plan/share.py patches those), the shape and dtype of each input and output, and for each input whether it
  is a constant or an activation (a graph input is one).
- A run is a stretch of the topological node order that repeats with period L at least twice. The run covering the
  most nodes is taken first (the shortest period on a tie, so two layers never count as one), then the stretches
  before and after it are searched again (a CLIP's text and vision towers are two runs).
- Within a periodic stretch the layer's first node (its phase) is chosen so that the blocks are wired like one
  another (each input comes from the same offset in its own block, the previous block, or the same value before the
  run), with as few values as possible carried from one block to the next, and the carried value read by as many of
  the block's nodes as possible: a transformer layer starts where the residual stream enters it (read by the
  attention's projections and the residual add), not one LayerNorm earlier or later.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from tremula.ir.graph import Graph, Node

MIN_BLOCK = 2  # nodes: a single repeated node (Q, K and V side by side) is not a layer
# Attributes whose values differ from layer to layer without making the layers different code: FP8 scales and the
# stochastic-rounding seed of a quantize are vertex parameters, which plan/share.py rewrites before each call.
PER_LAYER_ATTRS = frozenset({"scale", "x_scale", "seed"})
LayerKey = tuple[str, int]  # (run, index of the layer in the run)


def node_key(n: Node) -> str:
    """The name the planner knows a node by (its owner string): its name, else its first output."""
    return n.name or n.outputs[0]


def find_layers(graph: Graph) -> dict[str, LayerKey]:
    """node_key -> (run, layer index) for every node in a run of repeated layers; nodes outside runs are absent.
    Runs are named "run<position of its first node>"; indices count from 0 in node order."""
    nodes = graph.nodes
    sig = _signatures(graph)
    at: list[LayerKey | None] = [None] * len(nodes)
    todo = [(0, len(nodes))]
    while todo:
        a, b = todo.pop()
        found = _best_run(graph, sig, a, b)
        if found is None:
            continue
        s, period, count = found
        for i in range(s, s + period * count):
            at[i] = (f"run{s}", (i - s) // period)
        todo += [(a, s), (s + period * count, b)]
    # The planner knows nodes by node_key, which several nodes may share (a Reshape and the Transpose after it named
    # alike): a run with such a name in two layers, or in a layer and outside, is dropped.
    seen: dict[str, set] = {}
    for n, key in zip(nodes, at):
        seen.setdefault(node_key(n), set()).add(key)
    bad = {key[0] for keys in seen.values() if len(keys) > 1 for key in keys if key is not None}
    return {node_key(n): key for n, key in zip(nodes, at) if key is not None and key[0] not in bad}


def layer_roles(graph: Graph, at: dict[str, LayerKey] | None = None) -> dict[str, str]:
    """node_key -> the key of the same node in the first layer of its run (its role: what the planner decides once
    for every layer of the run), for the nodes in runs (`at`: find_layers' answer, made here when not given)."""
    at = find_layers(graph) if at is None else at
    layer: dict[LayerKey, list[str]] = {}  # (run, index) -> its nodes' keys in node order
    for n in graph.nodes:
        k = node_key(n)
        if k in at:
            layer.setdefault(at[k], []).append(k)
    return {k: layer[(run, 0)][p] for (run, _), keys in layer.items() for p, k in enumerate(keys)}


def _signatures(graph: Graph) -> np.ndarray:
    """One int per node: equal for nodes with the same op, attributes, input kinds and types, output types."""
    ids: dict[Hashable, int] = {}
    out = np.empty(len(graph.nodes), np.int64)
    for i, n in enumerate(graph.nodes):
        attrs = tuple(sorted((k, _hashable(v)) for k, v in n.attrs.items()
                             if k not in PER_LAYER_ATTRS and not isinstance(v, float)))
        ins = tuple(("",) if not v else (_kind(graph, v), graph.types[v].shape, graph.types[v].dtype) for v in n.inputs)
        outs = tuple((graph.types[o].shape, graph.types[o].dtype) for o in n.outputs)
        out[i] = ids.setdefault((n.op, attrs, ins, outs), len(ids))
    return out


def _kind(graph: Graph, v: str) -> str:
    return "const" if v in graph.constants else "act"  # a graph input is an activation made before every node


def _hashable(v):
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    if isinstance(v, np.ndarray):
        return (v.dtype.str, v.shape, v.tobytes())
    return v


def _best_run(graph: Graph, sig: np.ndarray, a: int, b: int) -> tuple[int, int, int] | None:
    """(first node, period, layers) of the run in nodes [a, b) covering the most nodes, or None."""
    pos = {o: i for i, n in enumerate(graph.nodes) for o in n.outputs}
    best: tuple[int, int, int, int, int] | None = None  # (covered, -period, first node, period, layers)
    seg = sig[a:b]
    for period in range(MIN_BLOCK, len(seg) // 2 + 1):
        eq = np.concatenate([[False], seg[:-period] == seg[period:], [False]])
        edges = np.flatnonzero(np.diff(eq.astype(np.int8)))
        for lo, hi in zip(edges[::2].tolist(), edges[1::2].tolist()):  # seg[lo:hi+period] repeats with this period
            count = (hi - lo + period) // period
            if count < 2 or (best is not None and (count * period, -period) <= best[:2]):
                continue
            phase = _best_phase(graph, pos, a + lo, period, a + hi + period)
            if phase is not None and (best is None or (phase[1] * period, -period) > best[:2]):
                best = (phase[1] * period, -period, phase[0], period, phase[1])
    return None if best is None else best[2:]


def _best_phase(graph: Graph, pos: dict[str, int], lo: int, period: int, hi: int) -> tuple[int, int] | None:
    """(first node, layers) of the longest run of blocks wired alike that starts in the first period of the periodic
    stretch [lo, hi); on a tie, the phase with the fewest values carried between blocks and the
    most reads of them. (Blocks after a break in the wiring are left to the search of what follows the run.)"""
    choice: tuple[tuple[int, int, int], int] | None = None
    for s in range(lo, min(lo + period, hi - 2 * period + 1)):
        n, score = _wiring(graph, pos, s, period, (hi - s) // period)
        if n >= 2 and (choice is None or (n, *score) > choice[0]):
            choice = ((n, *score), s)
    return None if choice is None else (choice[1], choice[0][0])


def _wiring(graph: Graph, pos: dict[str, int], s: int, period: int, count: int) -> tuple[int, tuple[int, int]]:
    """(blocks from s wired as block 0, up to count; (-values carried per block, reads of them)). An activation input
    must come from the same offset in the node's own block, from the previous block (a carried value, at the same
    offset in every block; block 0 reads it from before the run), or be the same value made before the run (an
    attention mask every layer reads), and the same one of these in every block."""
    nodes = graph.nodes
    wiring: dict[tuple[int, int], tuple] = {}  # (node offset, input index) -> where blocks 1.. read it from
    for k in range(1, count):
        base = s + k * period
        block = dict(wiring)
        if not _block_alike(graph, pos, s, base, period, block):
            count = k
            break
        wiring = block
    carried = {nodes[s + period + p].inputs[q] for (p, q), w in wiring.items() if w[0] == "carried"}
    if not carried:
        return 1, (0, 0)
    return count, (-len(carried), sum(w[0] == "carried" for w in wiring.values()))


def _block_alike(graph: Graph, pos: dict[str, int], s: int, base: int, period: int, wiring: dict) -> bool:
    """Whether the block at `base` is wired as the block at s, recording where it reads each input in `wiring`."""
    nodes = graph.nodes
    for p in range(period):
        for q, (v0, vk) in enumerate(zip(nodes[s + p].inputs, nodes[base + p].inputs)):
            if not vk or vk in graph.constants:
                continue
            j0, jk = pos.get(v0, -1), pos.get(vk, -1)  # -1: a graph input
            if jk >= base:  # made in its own block
                where: tuple = ("own", jk - base)
                ok = jk - base == j0 - s
            elif jk >= base - period:  # carried from the block before (block 0 reads it from before the run)
                where, ok = ("carried", jk - base + period), j0 < s
            else:  # from before the run: the same value for every block
                where, ok = ("before", vk), vk == v0
            if not ok or wiring.setdefault((p, q), where) != where:
                return False
    return True

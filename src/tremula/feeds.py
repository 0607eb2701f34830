"""Seeded model inputs: token ids below the vocabulary of the table they index, masks with padding, normal floats."""

from __future__ import annotations

import numpy as np

from tremula.ir.graph import Graph


def index_tables(graph: Graph) -> dict[str, int]:
    """Integer inputs that index a constant table (token ids), with the number of rows each may pick from."""
    tables: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "Gather" and n.inputs[0] in graph.constants and n.inputs[1] in graph.inputs:
            rows = graph.types[n.inputs[0]].shape[n.attrs.get("axis", 0)]
            tables[n.inputs[1]] = min(rows, tables.get(n.inputs[1], rows))
    return tables


def make_feeds(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs: token ids below the vocabulary of the table they index, attention masks with some padding,
    normal floats elsewhere."""
    rng = np.random.default_rng(seed)
    tables = index_tables(graph)
    feeds = {}
    for name in graph.inputs:
        t = graph.types[name]
        if t.dtype.startswith("float"):
            feeds[name] = rng.standard_normal(t.shape).astype(t.dtype)
        elif "mask" in name.lower():
            m = np.ones(t.shape, t.dtype)
            if len(t.shape) >= 2 and t.shape[-1] > 2:
                for b in range(t.shape[0]):  # row b pads its last b % 3 positions (row 0 has none)
                    pad = (b + 1) % 3
                    if pad:
                        m[b, ..., t.shape[-1] - pad:] = 0
            feeds[name] = m
        else:
            feeds[name] = rng.integers(0, tables.get(name, 2), t.shape).astype(t.dtype)
    return feeds

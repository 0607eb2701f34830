"""int64 tensors become int32: the IPU has no 64-bit integer type, so token ids, masks and integer constants are held,
exchanged and streamed from the host as 32-bit words.

PopART, under PopRT, does the same by default (SessionOptions.enableSupportedDataTypeCasting = true: INT64 -> INT32,
an error on overflow): its Poplar tensors and host streams are int32. The host narrows the user's int64 inputs
(sim/functional.Machine.host_in refuses a value out of range, as PopART does); the graph's int64 constants are narrowed
here when their values fit. A graph holding an int64 constant that does not fit keeps int64 throughout, so no op
meets a mix of the two.
"""

from __future__ import annotations

import numpy as np

from tremula.ir.graph import Constant, Graph, Node
from tremula.ir.interp import infer_types

I32 = np.iinfo(np.int32)


def fits_int32(a: np.ndarray) -> bool:
    return a.size == 0 or (int(a.min()) >= I32.min and int(a.max()) <= I32.max)


def narrow_int64(graph: Graph) -> Graph:
    """The graph with its int64 inputs, constants and Cast targets in int32 (unchanged when it has none, or when an
    int64 constant's values do not fit)."""
    consts = {n: c for n, c in graph.constants.items() if c.type.dtype == "int64"}
    inputs = [n for n in graph.inputs if graph.types[n].dtype == "int64"]
    casts = {i for i, n in enumerate(graph.nodes) if n.op == "Cast" and n.attrs.get("to") == "int64"}
    if not (consts or inputs or casts) or not all(fits_int32(c.value()) for c in consts.values()):
        return graph
    g = graph.copy()
    for name, c in consts.items():
        g.constants[name] = Constant.of(name, c.value().astype(np.int32))
        g.types[name] = g.constants[name].type
    for name in inputs:
        t = g.types[name]
        g.types[name] = type(t)(t.shape, "int32")
    g.nodes = [Node(n.op, n.inputs, n.outputs, {**n.attrs, "to": "int32"}, n.name) if i in casts else n
               for i, n in enumerate(g.nodes)]
    return infer_types(g)

"""Weights must be numbers: a NaN in any constant, or ±Inf in a parameter, is refused at load, naming the tensor.

Every frontend's Graph passes here (frontends.load_model), so a broken checkpoint or ONNX initializer is one line
instead of a compiled model whose check reports "cosine -inf". ±Inf is legitimate outside parameters: ONNX exports
carry -inf (or float32 min) in causal-mask constants and Where fills, which this leaves alone."""

from __future__ import annotations

import numpy as np

from tremula.errors import TremulaError
from tremula.ir.graph import Graph, Node

# Ops whose constant inputs are weights (Gather: only its table; its indices are integers).
_WEIGHT_OPS = ("Linear", "LinearFp8", "MatMul", "Conv", "LayerNorm")
# A rank-1 constant added to one of these ops' outputs is a bias (ONNX: MatMul then Add; Gemm's C).
_BIASED_OPS = ("Linear", "MatMul", "Conv")


def _is_parameter(name: str, graph: Graph, consumers: dict[str, list[Node]], producers: dict[str, Node]) -> bool:
    rank = len(graph.types[name].shape)
    for n in consumers.get(name, []):
        if n.op in _WEIGHT_OPS or (n.op == "Gather" and n.inputs[0] == name):
            return True
        if n.op == "Add" and rank == 1:
            others = [producers.get(i) for i in n.inputs if i and i != name]
            if any(p is not None and p.op in _BIASED_OPS for p in others):
                return True
    return False


def refuse_nonfinite(graph: Graph, model: str) -> None:
    """Raise TremulaError for the first concrete float constant with a NaN, or a parameter with ±Inf.

    Lazy constants (the zoo's seeded weights) are finite by construction and are not made here. One sum per tensor
    is the fast path: it is finite exactly when every element is (barring float overflow, which falls through to the
    element-wise test), so a clean 100M-parameter checkpoint costs one pass over its weights without temporaries."""
    consumers: dict[str, list[Node]] | None = None
    producers: dict[str, Node] = {}
    for name, c in graph.constants.items():
        if c.is_lazy or not c.type.dtype.startswith("float") or c.type.size == 0:
            continue
        a = c.value()
        if np.isfinite(a.sum(dtype=np.float32 if a.dtype == np.float16 else a.dtype)):
            continue
        nan = int(np.count_nonzero(np.isnan(a)))
        if nan:
            raise TremulaError(f"weight {name!r} of {model} has {nan:,} NaN value(s) of {a.size:,}; the model is "
                               "broken (re-save it from weights that are finite)")
        inf = int(np.count_nonzero(np.isinf(a)))
        if inf:
            if consumers is None:  # built only when some constant holds an infinity
                consumers, producers = graph.consumers(), graph.producers()
            if _is_parameter(name, graph, consumers, producers):
                raise TremulaError(f"weight {name!r} of {model} has {inf:,} infinite value(s) of {a.size:,}; the "
                                   "model is broken (re-save it from weights that are finite)")

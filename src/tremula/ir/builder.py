"""GraphBuilder: writes a Graph node by node, inferring each output's type from the op rules as it goes."""

from __future__ import annotations

from typing import Any

import numpy as np

from tremula.ir.graph import Constant, Graph, LazyInit, Node, TensorType, name_seed
from tremula.ir.ops import infer


class GraphBuilder:
    def __init__(self, name: str, seed: int = 0):
        self.graph = Graph(name, [], [], [], {}, {})
        self.seed = seed
        self._counter = 0

    def _fresh(self, base: str) -> str:
        self._counter += 1
        return self.graph.fresh_name(f"{base}_{self._counter}")

    def input(self, name: str, shape: tuple[int, ...], dtype: str = "float32") -> str:
        self.graph.inputs.append(name)
        self.graph.types[name] = TensorType(tuple(shape), dtype)
        return name

    def const(self, name: str, array: np.ndarray) -> str:
        c = Constant.of(name, np.asarray(array))
        self.graph.constants[name] = c
        self.graph.types[name] = c.type
        return name

    def param(self, name: str, shape: tuple[int, ...], kind: str = "normal", std: float = 0.02, mean: float = 0.0,
              dtype: str = "float32") -> str:
        """A lazy, seeded weight: its values exist only once something asks for them."""
        t = TensorType(tuple(shape), dtype)
        self.graph.constants[name] = Constant(name, t, init=LazyInit(kind, name_seed(self.seed, name), mean, std))
        self.graph.types[name] = t
        return name

    def op(self, op: str, inputs: list[str], n_out: int = 1, name: str = "", **attrs: Any) -> str | list[str]:
        types = [self.graph.types[i] if i else None for i in inputs]
        while types and types[-1] is None:
            types.pop()
        outs_t = infer(op, types, attrs)
        base = name or op.lower()
        outs = [self._fresh(base) for _ in range(len(outs_t))]
        for o, t in zip(outs, outs_t):
            self.graph.types[o] = t
        self.graph.nodes.append(Node(op, list(inputs), outs, attrs, name or outs[0]))
        return outs[0] if len(outs) == 1 else outs

    def type(self, value: str) -> TensorType:
        return self.graph.types[value]

    def output(self, value: str, name: str | None = None) -> str:
        if name and name != value:
            value = self.op("Identity", [value], name=name)
            # Rename the Identity's output to the requested public name.
            node = self.graph.nodes[-1]
            self.graph.types[name] = self.graph.types.pop(node.outputs[0])
            node.outputs = [name]
            value = name
        self.graph.outputs.append(value)
        return value

    def build(self) -> Graph:
        return self.graph

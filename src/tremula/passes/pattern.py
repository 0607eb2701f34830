"""Pattern helpers shared by the fusions: look up producers/consumers/constants and replace matched subgraphs."""

from __future__ import annotations

from typing import Any

import numpy as np

from tremula.ir.graph import Constant, Graph, Node
from tremula.ir.ops import infer

# Binary ops whose operands may come in either order.
COMMUTATIVE = {"Add", "Mul", "Max", "Min", "Equal", "And", "Or"}
# The largest constant whose values a matcher may read without caching them; reading a lazy weight is never needed.
SMALL = 64


class Rewriter:
    """A copy of a graph plus the matches found on it; `result()` builds the rewritten graph.

    A match replaces its *tail* node (the one whose outputs the rest of the graph reads) by new nodes writing the same
    output names, and deletes its interior nodes. Interior values must be private to the match (`private`), so
    deleting them never breaks another reader, and every node belongs to at most one match.
    """

    def __init__(self, graph: Graph):
        self.g = graph.copy()
        self.producer = self.g.producers()
        self.users = self.g.consumers()
        self.outputs = set(self.g.outputs)
        self._claimed: set[int] = set()
        self._replace: dict[int, list[Node]] = {}

    # ------------------------------------------------------------------------------------------------ queries

    def prod(self, value: str, *ops: str) -> Node | None:
        """The node making `value`, if its op is one of `ops` and it is not part of an earlier match."""
        node = self.producer.get(value)
        if node is None or id(node) in self._claimed or (ops and node.op not in ops):
            return None
        return node

    def private(self, value: str, *readers: Node) -> bool:
        """True if only `readers` read `value` and it is not a graph output."""
        ids = {id(n) for n in readers}
        return value not in self.outputs and all(id(n) in ids for n in self.users.get(value, []))

    def const(self, value: str) -> Constant | None:
        return self.g.constants.get(value)

    def small_value(self, value: str) -> np.ndarray | None:
        """The values of a small constant; a lazy one is made without being cached, so the input graph stays lazy."""
        c = self.g.constants.get(value)
        if c is None or c.type.size > SMALL:
            return None
        return c.data if c.data is not None else c.init.make(c.type)  # type: ignore[union-attr]

    def scalar(self, value: str) -> float | None:
        """The value of a one-element numeric constant (any rank), else None."""
        v = self.small_value(value)
        if v is None or v.size != 1 or not (np.issubdtype(v.dtype, np.floating) or np.issubdtype(v.dtype, np.integer)):
            return None
        return float(v.reshape(()))

    def is_zero(self, value: str) -> bool:
        return self.scalar(value) == 0.0

    def is_scalar(self, value: str, target: float, rtol: float = 1e-5) -> bool:
        s = self.scalar(value)
        return s is not None and abs(s - target) <= rtol * abs(target)

    def operands(self, node: Node) -> list[tuple[str, str]]:
        """(a, b) orderings of a binary node's inputs: both orders if the op is commutative."""
        a, b = node.inputs[0], node.inputs[1]
        return [(a, b), (b, a)] if node.op in COMMUTATIVE and a != b else [(a, b)]

    def vector(self, value: str, n: int) -> str | None:
        """A constant holding n values broadcast along the last axis, as a [n] constant (reshaped if concrete)."""
        c = self.g.constants.get(value)
        if c is None or c.type.size != n or (c.type.shape and c.type.shape[-1] != n):
            return None
        if c.type.shape == (n,):
            return value
        if c.data is None:
            return None  # a lazy [1,..,n] weight: reshaping it would need its values (or a node); leave it unfused
        return self.constant(value, c.data.reshape(n))

    def free(self, *nodes: Node) -> bool:
        return all(id(n) not in self._claimed for n in nodes)

    # ------------------------------------------------------------------------------------------------ building

    def constant(self, base: str, array: np.ndarray) -> str:
        name = self.g.fresh_name(base)
        c = Constant.of(name, np.ascontiguousarray(array))
        self.g.constants[name] = c
        self.g.types[name] = c.type
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str] | None = None, name: str = "", **attrs: Any) -> Node:
        """A new node with its output types inferred; fresh output names unless given."""
        return new_node(self.g, op, inputs, outputs, name, **attrs)

    def replace(self, tail: Node, interior: list[Node], new_nodes: list[Node]) -> bool:
        """Record a match: `new_nodes` (in order) take the tail's place; interior nodes go. False if overlapping."""
        nodes = [tail, *interior]
        if not self.free(*nodes) or len({id(n) for n in nodes}) != len(nodes):
            return False
        made = {o for n in new_nodes for o in n.outputs}
        if not set(tail.outputs) <= made:
            raise AssertionError(f"fusion of {tail.op} does not write its outputs {tail.outputs}")
        self._claimed.update(id(n) for n in nodes)
        self._replace[id(tail)] = new_nodes
        for n in interior:
            self._replace[id(n)] = []
        return True

    def result(self) -> Graph:
        out: list[Node] = []
        for n in self.g.nodes:
            out.extend(self._replace.get(id(n), [n]))
        g = self.g
        g.nodes = out
        live = set(g.inputs) | set(g.constants) | {o for n in out for o in n.outputs}
        g.types = {k: t for k, t in g.types.items() if k in live}
        return g


def new_node(g: Graph, op: str, inputs: list[str], outputs: list[str] | None = None, name: str = "",
             **attrs: Any) -> Node:
    """A new node of graph g (not yet in its node list) with its output types inferred into g.types; fresh output
    names `name`_out (each registered as it is made, so several outputs get distinct names) unless given."""
    ins = [g.types[i] if i else None for i in inputs]
    while ins and ins[-1] is None:
        ins.pop()
    types = infer(op, ins, attrs)  # type: ignore[arg-type]
    if outputs is None:
        outputs = []
        for t in types:
            outputs.append(g.fresh_name(f"{name or op.lower()}_out"))
            g.types[outputs[-1]] = t
    for o, t in zip(outputs, types):
        g.types[o] = t
    return Node(op, list(inputs), list(outputs), dict(attrs), name or outputs[0])


def last_axis(axes: Any, rank: int) -> bool:
    """True if a reduction's `axes` attribute names exactly the last axis."""
    return axes is not None and len(axes) == 1 and int(axes[0]) % rank == rank - 1

"""GELU fusion: erf form 0.5·x·(1+erf(x/√2)) and tanh form 0.5·x·(1+tanh(√(2/π)·(x+0.044715·x³)))."""

from __future__ import annotations

import math

from tremula.ir.graph import Graph, Node
from tremula.passes.pattern import Rewriter

SQRT2 = math.sqrt(2.0)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
KAPPA = 0.044715


def fuse_gelu(graph: Graph) -> Graph:
    rw = Rewriter(graph)
    for tail in list(rw.g.nodes):
        if tail.op == "Mul" and rw.free(tail):
            _match(rw, tail)
    return rw.result()


def _products(rw: Rewriter, tail: Node) -> list[tuple[list[str], list[Node]]]:
    """Ways to read the tail as a product of three factors through one private inner Mul: (factors, [inner])."""
    ways = []
    for i, v in enumerate(tail.inputs):
        inner = rw.prod(v, "Mul")
        if inner is not None and rw.private(v, tail):
            ways.append(([*inner.inputs, tail.inputs[1 - i]], [inner]))
    return ways


def _match(rw: Rewriter, tail: Node) -> bool:
    for factors, inner in _products(rw, tail):
        for h in range(3):
            if not rw.is_scalar(factors[h], 0.5):
                continue
            for a in range(3):
                if a == h:
                    continue
                x = factors[3 - h - a]
                found = _one_plus(rw, factors[a], x)
                if found is None:
                    continue
                approximate, nodes = found
                # Every value inside the pattern is read only by pattern nodes, so removing them is safe.
                body = [*inner, *nodes]
                if all(rw.private(o, *body, tail) for n in body for o in n.outputs):
                    gelu = rw.node("Gelu", [x], tail.outputs, tail.name, approximate=approximate)
                    return rw.replace(tail, body, [gelu])
    return False


def _one_plus(rw: Rewriter, value: str, x: str) -> tuple[str, list[Node]] | None:
    """Match value = 1 + erf(x/√2) or 1 + tanh(√(2/π)(x + κx³)); returns (approximate, the nodes)."""
    add = rw.prod(value, "Add")
    if add is None:
        return None
    for one, t in rw.operands(add):
        if not rw.is_scalar(one, 1.0):
            continue
        erf = rw.prod(t, "Erf")
        if erf is not None:
            scaled = _scaled_x(rw, erf.inputs[0], x, 1.0 / SQRT2)
            if scaled is not None:
                return "none", [add, erf, scaled]
        tanh = rw.prod(t, "Tanh")
        if tanh is not None:
            nodes = _tanh_arg(rw, tanh.inputs[0], x)
            if nodes is not None:
                return "tanh", [add, tanh, *nodes]
    return None


def _scaled_x(rw: Rewriter, value: str, x: str, factor: float) -> Node | None:
    """The node computing x·factor (as Mul by factor or Div by 1/factor)."""
    n = rw.prod(value, "Mul", "Div")
    if n is None:
        return None
    if n.op == "Div":
        return n if n.inputs[0] == x and rw.is_scalar(n.inputs[1], 1.0 / factor) else None
    return n if any(a == x and rw.is_scalar(c, factor) for a, c in rw.operands(n)) else None


def _tanh_arg(rw: Rewriter, value: str, x: str) -> list[Node] | None:
    """Match √(2/π)·(x + κ·x³), with x³ as Pow(x, 3), x·(x·x) or (x·x)·x."""
    outer = rw.prod(value, "Mul")
    if outer is None:
        return None
    for c, s in rw.operands(outer):
        if not rw.is_scalar(c, SQRT_2_OVER_PI):
            continue
        add = rw.prod(s, "Add")
        if add is None:
            continue
        for xx, k in rw.operands(add):
            if xx != x:
                continue
            kmul = rw.prod(k, "Mul")
            if kmul is None:
                continue
            for kc, cube in rw.operands(kmul):
                cube_nodes = _cube(rw, cube, x) if rw.is_scalar(kc, KAPPA) else None
                if cube_nodes is not None:
                    return [outer, add, kmul, *cube_nodes]
    return None


def _cube(rw: Rewriter, value: str, x: str) -> list[Node] | None:
    n = rw.prod(value, "Pow", "Mul")
    if n is None:
        return None
    if n.op == "Pow":
        return [n] if n.inputs[0] == x and rw.is_scalar(n.inputs[1], 3.0) else None
    for a, b in rw.operands(n):
        sq = rw.prod(b, "Mul")
        if a == x and sq is not None and sq.inputs == [x, x]:
            return [n, sq]
    return None

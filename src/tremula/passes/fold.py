"""Constant folding (including host-only shape arithmetic) and the local simplifications that expose fusions.

Lazy weights are never materialised here. A node reading a lazy constant folds to a lazy constant (ir/graph.FoldInit)
that computes the op when its values are first needed, so a zoo model folds exactly what the same architecture with a
checkpoint's weights folds (a BERT's position-table slice, a ViT's CLS token expanded over the batch, SigLIP's probe
projection) and both plan alike, while planning a 400M-parameter model still allocates nothing.
"""

from __future__ import annotations

import numpy as np

from tremula.ir.graph import Constant, FoldInit, Graph, Node
from tremula.ir.interp import infer_types
from tremula.ir.ops import infer, rule, transpose_perm
from tremula.passes.pattern import new_node

# Folding replaces a node by its result; a node that *broadcasts* small constants into a huge one (Expand, Where) is
# better left as a node than stored as a weight. Host-only ops are always folded: they cannot run on the chip.
MAX_FOLDED_ELEMENTS = 1 << 24
# The largest input whose Gather pattern is checked on an index array (a mask of batch x sequence is far smaller).
SMALL_MAP = 1 << 22


def _op_args(inputs: list[str], values: list[np.ndarray]) -> list[np.ndarray | None]:
    """An op's arguments: `values` (of its present inputs) at their places, omitted optional inputs None."""
    it = iter(values)
    args = [next(it) if i else None for i in inputs]
    while args and args[-1] is None:
        args.pop()
    return args


def fold_constants(graph: Graph) -> Graph:
    """A new graph where every node computable at compile time is a Constant and trivial nodes are gone."""
    return _Folder(graph).run()


class _Folder:
    def __init__(self, graph: Graph):
        self.g = graph.copy()
        self.outputs = set(self.g.outputs)
        self.subst: dict[str, str] = {}  # value -> the value that replaces it (aliases of removed nodes)
        self.made: dict[str, Node] = {}  # value -> kept node producing it
        self.kept: list[Node] = []

    def run(self) -> Graph:
        for node in self.g.nodes:
            node.inputs = [self.subst.get(i, i) for i in node.inputs]
            if self._fold(node):
                continue
            node = self._simplify(node)
            if node is None:
                continue
            self.kept.append(node)
            self.made.update({o: node for o in node.outputs})
        self.g.nodes = self.kept
        return infer_types(self.g)

    # ------------------------------------------------------------------------------------------------ evaluation

    def _fold(self, node: Node) -> bool:
        r = rule(node.op)
        ins = [i for i in node.inputs if i]
        if node.op == "Shape":  # shapes are static, so Shape of anything is known
            shape = np.array(self.g.types[ins[0]].shape, np.int64)
            self._set_const(node, [shape[node.attrs.get("start", 0) : node.attrs.get("end")]])
            return True
        consts = [self.g.constants.get(i) for i in ins]
        if any(c is None for c in consts):
            return False
        if node.op == "Identity" and self._alias(node.outputs[0], ins[0]):
            return True
        in_types = [self.g.types[i] if i else None for i in node.inputs]
        while in_types and in_types[-1] is None:  # trailing omitted optional inputs
            in_types.pop()
        out_types = infer(node.op, in_types, node.attrs)
        in_size = sum(c.type.size for c in consts)  # type: ignore[union-attr]
        if not r.host_only and sum(t.size for t in out_types) > max(MAX_FOLDED_ELEMENTS, in_size):
            return False
        if any(c.is_lazy for c in consts):  # type: ignore[union-attr]
            self._set_lazy(node, out_types)
            return True
        vals = r.ref(_op_args(node.inputs, [self.g.constants[i].value() for i in ins]), node.attrs)
        self._set_const(node, [np.asarray(v).astype(t.dtype).reshape(t.shape) for v, t in zip(vals, out_types)])
        return True

    def _set_lazy(self, node: Node, out_types) -> None:
        """Each output a lazy constant computing the op from its (lazy or concrete) constant inputs when needed."""
        r, inputs, attrs = rule(node.op), list(node.inputs), dict(node.attrs)
        sources = tuple(self.g.constants[i] for i in inputs if i)
        for k, (name, t) in enumerate(zip(node.outputs, out_types)):
            def fn(values, k=k):
                return r.ref(_op_args(inputs, values), attrs)[k]
            self.g.constants[name] = Constant(name, t, init=FoldInit(sources, fn, f"{node.op} {node.name or name}"))
            self.g.types[name] = t

    def _set_const(self, node: Node, values: list[np.ndarray]) -> None:
        for name, v in zip(node.outputs, values):
            c = Constant.of(name, np.ascontiguousarray(v))
            self.g.constants[name] = c
            self.g.types[name] = c.type

    # ------------------------------------------------------------------------------------------------ simplification

    def _simplify(self, node: Node) -> Node | None:
        """The node to keep (possibly rewritten), or None if it became an alias of its input."""
        op, a = node.op, node.attrs
        if not node.inputs or not node.inputs[0]:
            return node
        x = node.inputs[0]
        tx = self.g.types[x]
        if op == "Reshape":
            inner = self.made.get(x)
            if inner is not None and inner.op == "Reshape":  # Reshape(Reshape(y)) == Reshape(y)
                node.inputs = [inner.inputs[0]]
                x, tx = node.inputs[0], self.g.types[node.inputs[0]]
            same = tuple(a["shape"]) == tx.shape
        elif op == "Transpose":
            perm = list(transpose_perm(a, len(tx.shape)))
            inner = self.made.get(x)
            if inner is not None and inner.op == "Transpose":  # two transposes compose into one
                p1 = transpose_perm(inner.attrs, len(self.g.types[inner.inputs[0]].shape))
                perm = [p1[p] for p in perm]
                node.inputs = [inner.inputs[0]]
                node.attrs = {**a, "perm": tuple(perm)}
                x = node.inputs[0]
            same = perm == list(range(len(perm)))
        elif op in ("Identity",):
            same = True
        elif op == "Cast":
            same = a["to"] == tx.dtype
        elif op == "Expand":
            same = tuple(np.broadcast_shapes(tx.shape, tuple(a["shape"]))) == tx.shape
        elif op == "Concat":
            same = len([i for i in node.inputs if i]) == 1
        elif op == "Gather" and self._gathers_in_order(node):
            # every element in order: an exporter's x[:, 0] of a one-token sequence, or a padding mask flattened
            # and gathered back to [B, 1, 1, S] (transformers' BERT)
            node = Node("Reshape", [x], node.outputs, {"shape": self.g.types[node.outputs[0]].shape}, node.name)
            return self._simplify(node)
        elif op in ("And", "Or") and (kept := self._neutral(node)) is not None:
            # x and an all-true constant (or x or an all-false one) is x, broadcast (a bidirectional mask's
            # "allowed" pattern in transformers' mask builder)
            node = Node("Expand", [kept], node.outputs, {"shape": self.g.types[node.outputs[0]].shape}, node.name)
            return self._simplify(node)
        elif op == "Where" and (expand := self._pushed_expand(node)) is not None:
            return expand
        elif op == "Attention" and len(node.inputs) > 3 and node.inputs[3] and \
                self.made.get(node.inputs[3]) is not None and self.made[node.inputs[3]].op == "Expand":
            # attention broadcasts its mask itself: the mask before it was expanded over the query rows
            m = self.made[node.inputs[3]].inputs[0]
            if len(self.g.types[m].shape) == 4:
                node.inputs = [*node.inputs[:3], m, *node.inputs[4:]]
            return node
        elif op in ("Add", "Sub", "Mul", "Div") and len(node.inputs) == 2:
            self._shrink_repeated(node)
            return node
        elif op == "Slice":
            same = self.g.types[node.outputs[0]].shape == tx.shape and all(s > 0 for s in (a.get("steps") or [1]))
        else:
            return node
        if same and self._alias(node.outputs[0], x):
            return None
        return node

    def _gathers_in_order(self, node: Node) -> bool:
        """True if the Gather (constant indices) takes every element of its input in order: a Reshape."""
        x, idx = node.inputs[0], self.g.constants.get(node.inputs[1])
        tx, out = self.g.types[x], self.g.types[node.outputs[0]]
        if idx is None or idx.is_lazy or not tx.shape or out.size != tx.size or idx.type.size > SMALL_MAP:
            return False
        axis = node.attrs.get("axis", 0) % len(tx.shape)
        n, at = tx.shape[axis], idx.value()
        if not np.issubdtype(at.dtype, np.integer) or np.any((at < -n) | (at >= n)):
            return False  # out of range: left for the Gather to refuse at run time
        if n == 1:  # the only element of its axis
            return True
        if tx.size > SMALL_MAP:
            return False
        pos = np.take(np.arange(tx.size).reshape(tx.shape), np.where(at < 0, at + n, at), axis=axis)
        return bool(np.array_equal(pos.reshape(-1), np.arange(tx.size)))

    def _neutral(self, node: Node) -> str | None:
        """For And / Or with a concrete all-true / all-false constant operand: the other operand, else None."""
        want = node.op == "And"
        for c, other in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
            k = self.g.constants.get(c)
            if k is not None and not k.is_lazy and other not in self.g.constants and \
                    bool(np.all(k.value() == want)) and self.g.types[node.outputs[0]].shape == \
                    tuple(np.broadcast_shapes(self.g.types[other].shape, k.type.shape)):
                return other
        return None

    def _pushed_expand(self, node: Node) -> Node | None:
        """Where(Expand(c), a, b) with scalar constants a, b as Expand(Where(c, a, b)): the small Where is kept here
        and the Expand returned, so a consumer that broadcasts (attention's mask) can read the small one."""
        cond, a, b = node.inputs
        ex = self.made.get(cond)
        if ex is None or ex.op != "Expand" or any(self.g.constants.get(v) is None or self.g.types[v].size != 1
                                                  for v in (a, b)):
            return None
        where = new_node(self.g, "Where", [ex.inputs[0], a, b], [self.g.fresh_name(f"{node.outputs[0]}_small")],
                         node.name, **node.attrs)
        self.kept.append(where)
        self.made[where.outputs[0]] = where
        return Node("Expand", where.outputs, node.outputs, {"shape": self.g.types[node.outputs[0]].shape},
                    f"{node.name}_b")

    def _shrink_repeated(self, node: Node) -> None:
        """A concrete constant operand of a broadcasting binary op whose values repeat along leading axes (not the
        last) that the other operand spans: those axes cut to one (an exporter's token-type embedding folded to
        [B, S, D] from all-zero type ids is one row, broadcast). The last axis is kept: a LayerNorm's all-ones scale
        must stay the vector the fusions look for."""
        out = self.g.types[node.outputs[0]].shape
        for j, c in enumerate(node.inputs):
            k = self.g.constants.get(c)
            other = node.inputs[1 - j]
            if k is None or k.is_lazy or len(k.type.shape) < 2 or k.type.size > MAX_FOLDED_ELEMENTS or \
                    self.g.types[other].shape != out:
                continue
            v = k.value()
            axes = [ax for ax in range(v.ndim - 1) if v.shape[ax] > 1 and
                    np.array_equal(v, np.broadcast_to(v.take([0], axis=ax), v.shape))]
            if axes:
                small = v[tuple(slice(0, 1) if ax in axes else slice(None) for ax in range(v.ndim))]
                name = self.g.fresh_name(f"{c}_row")
                self.g.constants[name] = Constant.of(name, np.ascontiguousarray(small))
                self.g.types[name] = self.g.constants[name].type
                node.inputs = [name if i == j else x for i, x in enumerate(node.inputs)]

    def _alias(self, old: str, new: str) -> bool:
        """Make `old` another name for `new`. A graph output keeps its name: the producer of `new` is renamed."""
        if old not in self.outputs:
            self.subst[old] = new
            return True
        c = self.g.constants.get(new)
        if c is not None:  # the output is this constant under its public name (sharing data or lazy init)
            self.g.constants[old] = Constant(old, c.type, data=c.data, init=c.init)
            self.g.types[old] = c.type
            return True
        p = self.made.get(new)
        if p is None or new in self.outputs or new in self.g.inputs:
            return False  # an input passed straight through, or two outputs with one value: keep the node
        p.outputs = [old if o == new else o for o in p.outputs]
        for n in self.kept:
            n.inputs = [old if i == new else i for i in n.inputs]
        self.subst = {k: (old if v == new else v) for k, v in self.subst.items()}
        self.subst[new] = old
        self.made[old] = p
        self.g.types[old] = self.g.types[new]
        return True

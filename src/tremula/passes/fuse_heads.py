"""Multi-head attention in the form the planner reads: each operand a head view of a projection, the output merged back.

The planner reads an Attention operand straight from its projection when it is Transpose(0, 2, 1, 3) of Reshape
[B, S, H, d] of that projection (or of a last-axis Split part of it), and writes the output the same way back
(plan/head_views.py), so the head split and merge move no data of their own. The zoo builds that form;
exporters do not. torch's MultiheadAttention (SigLIP's pooling head) is written out sequence-first as

    Transpose(x) -> one Linear for k and v -> Reshape, Transpose, Reshape, Gather(0 | 1) -> Reshape [S, B*H, d]
    -> Transpose -> a 3-D attention over B*H heads -> Transpose, Reshape [B, E] -> out-projection -> Reshape, Transpose

which plans as a dozen re-layouts. This pass finds, for every Attention, the chain of data movement that makes each
operand and the one its output goes through, composes each chain into one strided View (passes/views.py: no array
the size of the tensor, at any batch), and where it equals the head view's (the elements, not the ops, decide),
rewrites the chain into that form:

- a Linear reading a row permutation of its input (the sequence-first Transpose) reads the input itself, the
  permutation moving to its output, where it joins the chain;
- operands reading column parts of one projection read them through one Split;
- an attention over B*H heads of one sample becomes one over H heads of B samples (a constant query reshaped);
- the output chain becomes Transpose + Reshape, and a Linear after it whose output is only reordered by whole rows
  (batch-first MultiheadAttention transposes back after its out-projection) gets the reordering on its input.

Attentions already in the form are left as they are. A constant query takes the attention's scale into its values
(the scale is then 1), as an exporter folds it into the query it computes at export time.
"""

from __future__ import annotations

import numpy as np

from tremula.ir.graph import Constant, Graph, Node
from tremula.ir.interp import infer_types
from tremula.ir.ops import infer, transpose_perm
from tremula.passes.fold import fold_constants
from tremula.passes.pattern import new_node
from tremula.passes.views import View, carry, coalesce

HEAD_PERM = (0, 2, 1, 3)  # [B, S, H, d] <-> [B, H, S, d]
# Ops that only move elements (each output element is one input element): the chains a View can follow.
MOVES = {"Reshape", "Transpose", "Gather", "Slice", "Split", "Identity"}
# Of those, the ones that keep every element (an output chain must not drop any).
BIJECTIONS = {"Reshape", "Transpose", "Identity"}


def fuse_heads(graph: Graph) -> Graph:
    g = fold_constants(graph)  # a 3-D attention's query reshaped to 4-D is a constant again
    for attn in [n for n in g.nodes if n.op == "Attention"]:
        _Heads(g, attn).run()
    return infer_types(g)  # the replaced chains are left to dead-code elimination


class _Heads:
    """The rewrite of one Attention node of graph `g` (in place)."""

    def __init__(self, g: Graph, attn: Node):
        self.g, self.attn = g, attn
        self.producers = g.producers()
        self.consumers = g.consumers()
        self.before: list[Node] = []  # new nodes, placed before the Attention
        self.after: list[Node] = []  # new nodes, placed right after it
        self.dead: set[int] = set()  # ids of nodes the rewrite replaces

    # ------------------------------------------------------------------------------------------------ driver
    def run(self) -> None:
        a = self.attn
        q, k, v = a.inputs[:3]
        mask = a.inputs[3] if len(a.inputs) > 3 and a.inputs[3] else None
        b, h = self.g.types[q].shape[:2]
        views = {}
        for x in (q, k, v):
            if x in self.g.constants:
                continue
            found = self._operand(x)
            if found is None:
                return self._fold_scale()
            views[x] = found
        shapes = {(bb, hh) for (_, _, bb, hh, *_) in views.values()}
        if len(shapes) != 1 or (shapes != {(b, h)} and mask is not None) or not self._commutable(views):
            return self._fold_scale()
        (big_b, big_h), = shapes
        out = self._output(big_b, big_h)
        if all(v[-1] for v in views.values()) and out is not None and out[-1]:
            return self._fold_scale()  # already the planner's form
        self._rewrite(views, big_b, big_h, out)
        self._fold_scale()

    def _commutable(self, views: dict) -> bool:
        """A Linear moved onto its input's source must leave nothing reading it or its chains but this attention
        (else it would run twice)."""
        lins = [lin for (_, lin, *_) in views.values() if lin is not None]
        if not lins:
            return True
        chained = {id(n) for (*_, chain, _f) in views.values() for n in chain} | {id(self.attn)}
        values = [o for n in lins for o in n.outputs] + \
            [o for (_, lin, *_, chain, _f) in views.values() if lin is not None for n in chain for o in n.outputs]
        return all(v not in self.g.outputs and all(id(c) in chained for c in self.consumers.get(v, []))
                   for v in values)

    def _fold_scale(self) -> None:
        """A constant query takes the scale: Attention(q, k, v, s) = Attention(q * s, k, v, 1). The query may be the
        rewrite's Reshape of a constant; the product is folded by the next constant folding."""
        a, g = self.attn, self.g
        q, scale = a.inputs[0], float(a.attrs.get("scale", 1.0))
        reshape = next((n for n in self.before if q in n.outputs), None)
        reader = a
        if reshape is not None and reshape.op == "Reshape" and reshape.inputs[0] in g.constants:
            q, reader = reshape.inputs[0], reshape
        if q not in g.constants or scale == 1.0 or not g.types[q].dtype.startswith("float"):
            return
        s = g.fresh_name(f"{q}_scale")
        g.constants[s] = Constant.of(s, np.asarray(scale, g.types[q].dtype))
        g.types[s] = g.constants[s].type
        mul = self._node("Mul", [q, s], f"{a.name}.q_scaled")
        g.nodes.insert(g.nodes.index(reader), mul)
        reader.inputs[0] = mul.outputs[0]
        a.attrs["scale"] = 1.0

    # ------------------------------------------------------------------------------------------------ operands
    def _chain_back(self, x: str) -> tuple[str, list[Node]]:
        """(source, movement nodes from it to x in order): walk producers while they only move elements."""
        chain: list[Node] = []
        v = x
        while True:
            p = self.producers.get(v)
            if p is None or p.op not in MOVES or p.inputs[0] in self.g.constants or \
                    any(i not in self.g.constants for i in p.inputs[1:] if i):
                return v, chain
            chain.insert(0, p)
            v = p.inputs[0]

    def _operand(self, x: str):
        """(source value, its commuted Linear or None, B, H, column offset, the chain from the source (or from the
        Linear), already in form) if operand x [b, h, s, d] is a head view of a source value [.., C] with B*s rows:
        x[bb, hh, r, j] = source[bb*s + r, offset + hh*d + j] (b*h = B*H)."""
        g = self.g
        src, chain = self._chain_back(x)
        shape = g.types[x].shape
        hv = _head_view(carry(View.of(g.types[src].shape), g, chain, x), g.types[src].shape, shape)
        if hv is not None:
            return (src, None, *hv, chain, self._in_form(chain, hv, shape))
        lin = self.producers.get(src)
        if lin is None or lin.op != "Linear" or any(i not in g.constants for i in lin.inputs[1:] if i):
            return None
        y, pre = self._chain_back(lin.inputs[0])
        n = g.types[src].shape[-1]
        rows = _rows_only(carry(View.of(g.types[y].shape), g, pre, lin.inputs[0]), g.types[y].size, n) if pre else None
        if rows is None:
            return None
        hv = _head_view(carry(rows, g, chain, x), g.types[y].shape[:-1] + (n,), shape)
        return None if hv is None else (y, lin, *hv, chain, False)

    def _in_form(self, chain: list[Node], hv, shape) -> bool:
        """True if the chain already is [Split of the last axis,] Reshape [B, s, H, d], Transpose(HEAD_PERM)."""
        big_b, big_h, _ = hv
        if (big_b, big_h) != shape[:2] or len(chain) < 2:
            return False
        *first, rs, tr = chain
        if [n.op for n in first] not in ([], ["Split"]) or rs.op != "Reshape" or tr.op != "Transpose":
            return False
        return tuple(tr.attrs.get("perm", ())) == HEAD_PERM

    # ------------------------------------------------------------------------------------------------ output
    def _chain_forward(self, v: str) -> tuple[str, list[Node]]:
        """(end, the single-reader chain of bijective moves from v to it)."""
        chain: list[Node] = []
        while v not in self.g.outputs:
            users = self.consumers.get(v, [])
            if len(users) != 1 or users[0].op not in BIJECTIONS or len(users[0].outputs) != 1:
                break
            chain.append(users[0])
            v = users[0].outputs[0]
        return v, chain

    def _output(self, big_b: int, big_h: int):
        """(value Z, its chain, (Linear, its chain, end) to pull a row permutation through or None, already in form)
        if the attention output's chain of bijective moves ends in Z = the heads merged (Z viewed [B*s, H*dv]), or in
        Z read only by a Linear whose output is only reordered by whole rows into `end`, such that those rows of Z
        are the heads merged (torch's batch-first MultiheadAttention: sequence-first inside, transposed back after its
        out-projection)."""
        g, y = self.g, self.attn.outputs[0]
        z, chain = self._chain_forward(y)
        if not chain:
            return None
        b, h, sq, dv = g.types[y].shape
        got = carry(View.of((b, h, sq, dv)), g, chain, z)  # [b, h] -> [B, H] keeps the flat order
        if got is None or g.types[z].shape[-1] != big_h * dv:
            return None

        def merged(v: View | None, shape) -> bool:
            want = View.of((big_b, big_h, sq, dv)).transpose(HEAD_PERM).reshape(shape)
            return v is not None and want is not None and v.same(want)

        pull = self._pull(z)
        if pull is not None:
            lin, lchain, end = pull
            if merged(_replay(got, g, lchain, big_h * dv), g.types[end].shape[:-1] + (big_h * dv,)):
                return z, chain, pull, False
        if not merged(got, g.types[z].shape):
            return None
        in_form = (b, h) == (big_b, big_h) and [n.op for n in chain] == ["Transpose", "Reshape"] and \
            tuple(chain[0].attrs.get("perm", ())) == HEAD_PERM
        return z, chain, None, in_form

    def _pull(self, z: str):
        """(Linear, the chain after it, its end) if z's only reader is a Linear whose output only goes through
        single-reader moves that reorder whole rows (the last axis kept) into `end`; else None."""
        users = self.consumers.get(z, [])
        if len(users) != 1 or users[0].op != "Linear" or users[0].inputs[0] != z or z in self.g.outputs:
            return None
        lin = users[0]
        w = lin.outputs[0]
        end, chain = self._chain_forward(w)
        if not chain:
            return None
        t = self.g.types[w]
        rows = _rows_only(carry(View.of(t.shape), self.g, chain, end), t.size, t.shape[-1])
        return None if rows is None else (lin, chain, end)

    # ------------------------------------------------------------------------------------------------ rewrite
    def _node(self, op: str, inputs: list[str], name: str, outputs: list[str] | None = None, **attrs) -> Node:
        return new_node(self.g, op, inputs, outputs, name, **attrs)

    def _source(self, src: str, lin: Node | None, made: dict[str, str]) -> str:
        """The value the head views read: src itself, or the commuted Linear made on it (once)."""
        if lin is None:
            return src
        if lin.name not in made:
            new = self._node("Linear", [src, *lin.inputs[1:]], lin.name, **dict(lin.attrs))
            self.before.append(new)
            made[lin.name] = new.outputs[0]
        return made[lin.name]

    def _rewrite(self, views: dict, big_b: int, big_h: int, out) -> None:
        g, a = self.g, self.attn
        made: dict[str, str] = {}
        spans: dict[str, set[tuple[int, int]]] = {}  # source -> (offset, width) of the parts read
        for x, (src, lin, _b, _h, off, _c, _f) in views.items():
            spans.setdefault(self._source(src, lin, made), set()).add((off, big_h * g.types[x].shape[-1]))
        parts: dict[tuple[str, int], str] = {}
        for s, used in spans.items():
            width = g.types[s].shape[-1]
            cuts = sorted({0, width} | {o for o, _ in used} | {o + w for o, w in used})
            if cuts == [0, width]:
                parts[(s, 0)] = s
                continue
            split = self._node("Split", [s], f"{a.name}.split", axis=len(g.types[s].shape) - 1,
                               sizes=[int(c1 - c0) for c0, c1 in zip(cuts[:-1], cuts[1:])])
            self.before.append(split)
            parts.update({(s, c): o for c, o in zip(cuts[:-1], split.outputs)})
        b, h = g.types[a.inputs[0]].shape[:2]
        unmerge = (b, h) != (big_b, big_h)
        inputs = []
        for x in a.inputs:
            if x in views:
                src, lin, _b, _h, off, _c, _f = views[x]
                seq, d = g.types[x].shape[-2:]
                rs = self._node("Reshape", [parts[(self._source(src, lin, made), off)]], f"{x}.heads",
                                shape=(big_b, seq, big_h, d))
                tr = self._node("Transpose", rs.outputs, f"{x}.heads", perm=HEAD_PERM)
                self.before += [rs, tr]
                inputs.append(tr.outputs[0])
            elif x and unmerge and x in g.constants:  # the constant query, per sample and head
                rs = self._node("Reshape", [x], f"{x}.heads", shape=(big_b, big_h, *g.types[x].shape[2:]))
                self.before.append(rs)
                inputs.append(rs.outputs[0])
            else:
                inputs.append(x)
        a.inputs = inputs
        if unmerge:  # B samples of H heads; a Reshape gives the old [b, h] output to a chain left as it is
            old = a.outputs[0]
            y = g.fresh_name(f"{old}.heads")
            g.types[y] = infer("Attention", [g.types[i] for i in a.inputs if i], a.attrs)[0]
            a.outputs = [y]
            if out is None:
                self.after.append(self._node("Reshape", [y], f"{a.name}.merged", outputs=[old],
                                             shape=g.types[old].shape))
        if out is not None:
            self._rewrite_output(out)
        at = g.nodes.index(a)
        g.nodes[at:at + 1] = [*self.before, a, *self.after]
        g.nodes = [n for n in g.nodes if id(n) not in self.dead]

    def _rewrite_output(self, out) -> None:
        """The attention output as Transpose(HEAD_PERM) + Reshape to Z, or to the shape of the value the pulled
        Linear's output was reordered into (the Linear then writes that value itself)."""
        g, a = self.g, self.attn
        z, chain, pull, _ = out
        self.dead |= {id(n) for n in chain}
        tr = self._node("Transpose", [a.outputs[0]], f"{a.name}.merge", perm=HEAD_PERM)
        if pull is None:
            self.after += [tr, self._node("Reshape", tr.outputs, f"{a.name}.merge", outputs=[z],
                                          shape=g.types[z].shape)]
            return
        lin, lchain, end = pull
        rs = self._node("Reshape", tr.outputs, f"{a.name}.merge", shape=g.types[end].shape[:-1] + g.types[z].shape[-1:])
        self.after += [tr, rs]
        lin.inputs[0] = rs.outputs[0]
        lin.outputs = [end]
        self.dead |= {id(n) for n in lchain}


def _head_view(got: View | None, src_shape: tuple[int, ...], shape: tuple[int, ...]):
    """(B, H, column offset) if `got` (operand [b, h, s, d] as a View of a [.., C] source) is a head view of the
    source: operand[bb, hh, r, j] = source[bb*s + r, offset + hh*d + j] with b*h = B*H, else None."""
    b, h, s, d = shape
    c = src_shape[-1]
    rows = int(np.prod(src_shape[:-1], dtype=np.int64))
    if got is None or rows % s or (b * h) % (rows // s):
        return None
    big_b = rows // s
    big_h = b * h // big_b
    off = got.offset
    if off + big_h * d > c:
        return None
    want = View.of((rows, c)).slice(1, off, big_h * d)
    want = want and want.reshape((big_b, s, big_h, d))
    want = want and want.transpose(HEAD_PERM).reshape(shape)
    return (big_b, big_h, off) if want is not None and got.same(want) else None


def _replay(view: View | None, graph: Graph, chain: list[Node], k: int) -> View | None:
    """`view` carried through a chain of moves that keep the last axis whole, each with its last dim made k (the
    chain after a Linear, replayed on the Linear's input)."""
    for n in chain:
        if view is None:
            return None
        if n.op == "Reshape":
            view = view.reshape(graph.types[n.outputs[0]].shape[:-1] + (k,))
        elif n.op == "Transpose":
            view = view.transpose(transpose_perm(n.attrs, len(view.shape)))
    return view


def _rows_only(u: View | None, total: int, n: int) -> View | None:
    """For u, a View of a Linear's input that only reorders the whole rows of a source [.., K] of `total` elements:
    the View of the Linear's output (last dim n) in the output of the same Linear on the source. None if u moves
    anything but whole rows, or leaves rows out (the Linear on the source would compute rows nobody reads)."""
    if u is None or u.offset:
        return None
    last = coalesce(u.dims[-1])
    k = u.shape[-1]
    if last != ((k, 1),) and k != 1:
        return None
    rows = [m for d in u.dims[:-1] for m in d]
    if any(stride % k for _, stride in rows):
        return None
    # a bijection on rows: the strides, sorted, are each the product of the sizes of the modes inside them
    reach = 1
    for size, stride in sorted((m for m in rows if m[0] != 1), key=lambda m: m[1]):
        if stride != reach * k:
            return None
        reach *= size
    if reach * k != total:
        return None
    return View(0, tuple(tuple((size, stride // k * n) for size, stride in d) for d in u.dims[:-1]) + (((n, 1),),))

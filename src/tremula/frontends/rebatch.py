"""Re-batch a Graph imported at a fixed batch: rewrite the batch dim of every value where each op provably allows it.

Exporters bake the batch into the graph (input dims, Reshape targets, an expanded CLS token, the offsets of a mask
gather). Every value is tracked as batch-free or as carrying the batch on one axis, `mult` rows per sample
(sample-major: sample b owns indices [b*mult, (b+1)*mult) of that axis). Each op has a rule that either proves the
samples stay independent through it, rewriting its attributes for the new batch, or refuses with the reason. A
constant aligned with the batch is accepted only when every sample's slice of it is the same (or, for gather
indices, the same up to each sample's offset), so the rewritten graph computes, for each sample, exactly what the
exported graph computed for one. Anything not proven is refused: a wrong number is worse than no number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tremula.errors import TremulaError
from tremula.ir.graph import Constant, Graph, Node, TensorType, model_batch
from tremula.ir.interp import infer_types
from tremula.ir.ops import OPS, transpose_perm

_ELEMENTWISE = {name for name, d in OPS.items() if d.elementwise}  # (ir/ops.py rows)


class CannotRebatch(TremulaError):
    """An op of the graph ties its values to the exported batch (a reduction over it, a per-sample constant...)."""


class FixedBatch(TremulaError):
    """A model file fixes its batch and cannot be rebatched to the one asked (the frontends' one-line answer)."""


@dataclass(frozen=True)
class Batched:
    """Where a value carries the batch: dim `axis` is batch x `mult`, sample-major."""

    axis: int
    mult: int = 1


# At batch 1 a Reshape can often put the batch on several axes (any dim of size 1 next to it): each choice is a
# correct reading of the data, but a later op may accept only one (torch's MultiheadAttention reshapes its output to
# [tgt_len=1, batch, E], which looks like [batch, 1, E]). The rebatcher then backtracks over the choices made
# upstream of the op that refused, latest first, at most this many times.
MAX_ATTEMPTS = 256
# The only constant that grows with the new batch is a rebatched gather's indices (one row per sample); past this
# many elements (as much as import folding makes) the rebatch is refused rather than allocated.
MAX_NEW_ELEMENTS = 1 << 24


def rebatch(graph: Graph, batch: int) -> Graph:
    """The graph at `batch` samples, or CannotRebatch naming the first op that does not allow it."""
    b0 = model_batch(graph)
    if b0 is None or any(not graph.types[i].shape for i in graph.inputs):
        raise CannotRebatch("the inputs do not share one leading (batch) dim")
    if batch == b0:
        return graph
    made = {o: k for k, n in enumerate(graph.nodes) for o in n.outputs}
    parents = [{made[i] for i in n.inputs if i in made} for n in graph.nodes]
    choices: dict[int, int] = {}  # node index of an ambiguous Reshape -> which of its readings to take
    first: CannotRebatch | None = None
    for _ in range(MAX_ATTEMPTS):
        r = _Rebatcher(graph, b0, batch, choices)
        try:
            return r.run()
        except CannotRebatch as e:
            first = first or e
            if r.failed_at is None:
                break
            up, todo = set(), [r.failed_at]
            while todo:  # the nodes the refusing op depends on
                k = todo.pop()
                if k not in up:
                    up.add(k)
                    todo.extend(parents[k])
            for k, n in reversed([d for d in r.decisions if d[0] in up]):
                if choices.get(k, 0) + 1 < n:
                    choices[k] = choices.get(k, 0) + 1
                    break
                choices.pop(k, None)  # exhausted: back to its first reading, and try an earlier choice
            else:
                break
    assert first is not None
    raise first


def _prod(dims) -> int:
    return int(np.prod(dims, dtype=np.int64)) if len(dims) else 1


class _Rebatcher:
    def __init__(self, graph: Graph, b0: int, b: int, choices: dict[int, int]):
        self.g, self.b0, self.b, self.choices = graph, b0, b, choices
        self.decisions: list[tuple[int, int]] = []  # (node index, readings) of each ambiguous Reshape met
        self.failed_at: int | None = None  # the node index that refused
        self.index = -1
        self.at: dict[str, Batched | None] = {i: Batched(0) for i in graph.inputs}
        self.nodes: list[Node] = []
        self.constants: dict[str, Constant] = dict(graph.constants)
        self.producer = graph.producers()
        self.promoted: dict[tuple[str, int, int], str] = {}
        self.names = set(graph.types)
        self.node: Node | None = None

    # ------------------------------------------------------------------------------------------------ driver

    def run(self) -> Graph:
        for index, node in enumerate(self.g.nodes):
            self.index, self.node = index, node
            states = [self.at.get(i) if i else None for i in node.inputs]
            if all(s is None for s in states):  # computed from constants alone: the same for every sample
                self._emit(node.op, list(node.inputs), list(node.outputs), dict(node.attrs), node.name)
                self.at.update({o: None for o in node.outputs})
                continue
            inputs, attrs, out = self._rule(node, states)
            self._emit(node.op, inputs, list(node.outputs), attrs, node.name)
            self.at.update({o: out for o in node.outputs})
        self.node = None
        types = {i: self._scaled(i, Batched(0)) for i in self.g.inputs}
        used = {i for n in self.nodes for i in n.inputs} | set(self.g.outputs)
        consts = {k: c for k, c in self.constants.items() if k in used}
        types.update({k: c.type for k, c in consts.items()})
        out = Graph(self.g.name, list(self.g.inputs), list(self.g.outputs), self.nodes, consts, types)
        try:
            out = infer_types(out)
        except TremulaError as e:
            raise CannotRebatch(f"the rewritten graph does not type-check ({e})") from None
        # Self-check of the rules: every value of the original has its shape with only the batch dim scaled.
        for name, s in self.at.items():
            want = self._scaled(name, s) if s is not None else self.g.types[name]
            if name in out.types and out.types[name] != want:
                raise CannotRebatch(f"{name} would be {out.types[name]}, expected {want}")
        return out

    def _refuse(self, why: str) -> CannotRebatch:
        n = self.node
        self.failed_at = self.index if n is not None else None
        where = f"{n.op} {n.name or n.outputs[0]!r}" if n is not None else "the graph"
        return CannotRebatch(f"{where} {why}")

    def _fresh(self, base: str) -> str:
        name, k = base, 0
        while name in self.names:
            k += 1
            name = f"{base}#{k}"
        self.names.add(name)
        return name

    def _emit(self, op: str, inputs: list[str], outputs: list[str], attrs: dict, name: str) -> None:
        self.nodes.append(Node(op, inputs, outputs, attrs, name))

    def _t(self, name: str) -> TensorType:
        return self.g.types[name]

    def _rank(self, name: str) -> int:
        return len(self.g.types[name].shape)

    def _scaled(self, name: str, s: Batched) -> TensorType:
        t = self.g.types[name]
        shape = list(t.shape)
        shape[s.axis] = self.b * s.mult
        return TensorType(tuple(shape), t.dtype)

    # ------------------------------------------------------------------------------------------------ promotion

    def _promote(self, name: str, axis: int, mult: int) -> str:
        """A batch-free value aligned with the batch (dim `axis` = batch x mult): the same for every sample, so
        its first sample's slice repeated `batch` times. Refused when the samples' slices differ."""
        key = (name, axis, mult)
        if key in self.promoted:
            return self.promoted[key]
        t = self._t(name)
        if t.shape[axis] != self.b0 * mult:
            raise self._refuse(f"broadcasts {name!r} ({t}) against the batch (dim {axis} is not 1 or the batch)")
        shape = list(t.shape)
        shape[axis] = self.b * mult
        c = self.constants.get(name)
        if c is not None:
            first = name
            if self.b0 > 1:  # one sample's slice; the others must equal it
                data = c.value()
                groups = data.reshape(t.shape[:axis] + (self.b0, mult) + t.shape[axis + 1:])
                head = groups.take([0], axis=axis)
                nan = bool(np.issubdtype(groups.dtype, np.floating))
                if not np.array_equal(groups, np.broadcast_to(head, groups.shape), equal_nan=nan):
                    raise self._refuse(f"reads constant {name!r} ({t}) whose samples differ: it was computed for "
                                       f"the exported batch of {self.b0}")
                first = self._fresh(f"{name}/sample0")
                one = np.ascontiguousarray(head.reshape(t.shape[:axis] + (mult,) + t.shape[axis + 1:]))
                self.constants[first] = Constant.of(first, one)
            out = self._repeat(first, t.shape[:axis], mult, t.shape[axis + 1:], name)
        else:
            p = self.producer.get(name)
            x = p.inputs[0] if p is not None and p.op == "Expand" else None
            jx = axis - (len(t.shape) - self._rank(x)) if x is not None else -1
            if x is None or self.at.get(x) is not None or mult != 1 or (jx >= 0 and self._t(x).shape[jx] != 1):
                raise self._refuse(f"needs {name!r} ({t}) for every sample, and it is not a constant or a broadcast")
            out = self._fresh(f"{name}/rebatched")
            self._emit("Expand", [x], [out], {"shape": tuple(shape)}, out)
        self.promoted[key] = out
        return out

    def _repeat(self, first: str, pre: tuple, mult: int, post: tuple, hint: str) -> str:
        """`first` ([pre, mult, post]) repeated once per sample along the batch axis: [pre, batch*mult, post]."""
        out = self._fresh(f"{hint}/rebatched")
        if mult == 1:
            self._emit("Expand", [first], [out], {"shape": pre + (self.b,) + post}, out)
            return out
        r1, r2 = self._fresh(f"{hint}/rows"), self._fresh(f"{hint}/tiled")
        self._emit("Reshape", [first], [r1], {"shape": pre + (1, mult) + post}, r1)
        self._emit("Expand", [r1], [r2], {"shape": pre + (self.b, mult) + post}, r2)
        self._emit("Reshape", [r2], [out], {"shape": pre + (self.b * mult,) + post}, out)
        return out

    # ------------------------------------------------------------------------------------------------ op rules

    def _broadcast(self, names: list[str], states: list, rank: int) -> tuple[Batched, list[str]]:
        """Operands broadcast to `rank` dims: every batched one on the same output axis, batch-free ones of size 1
        there (or promoted when they match the batch)."""
        found: Batched | None = None
        for i, s in zip(names, states):
            if s is None:
                continue
            b = Batched(s.axis + rank - self._rank(i), s.mult)
            if found is not None and b != found:
                raise self._refuse("carries the batch on different axes of its operands")
            found = b
        assert found is not None
        out = []
        for i, s in zip(names, states):
            j = found.axis - (rank - self._rank(i)) if i else -1
            if not i or s is not None or j < 0 or self._t(i).shape[j] == 1:
                out.append(i)
            else:
                out.append(self._promote(i, j, found.mult))
        return found, out

    def _rule(self, node: Node, states: list) -> tuple[list[str], dict, Batched]:
        op, a, ins = node.op, dict(node.attrs), list(node.inputs)
        s0 = states[0]
        rank0 = self._rank(ins[0])
        if op in _ELEMENTWISE:
            found, new = self._broadcast(ins, states, len(self._t(node.outputs[0]).shape))
            return new, a, found
        if op in ("Softmax", "CumSum", "LayerNorm", "Trilu", "Split", "Transpose", "Slice", "Reshape", "Expand",
                  "Patchify", "Conv", "Linear", "ReduceMean", "ReduceSum", "ReduceMax") and (
                s0 is None or any(s is not None for s in states[1:])):
            raise self._refuse("reads the batch through a weight-like operand")
        if op in ("Softmax", "CumSum"):
            axis = a.get("axis", -1) % rank0
            if axis == s0.axis:
                raise self._refuse("runs along the batch axis")
            return ins, a, s0
        if op == "LayerNorm":
            if s0.axis == rank0 - 1:
                raise self._refuse("normalises over the batch axis")
            return ins, a, s0
        if op == "Trilu":
            if s0.axis >= rank0 - 2:
                raise self._refuse("takes a triangle over the batch axis")
            return ins, a, s0
        if op in ("ReduceMean", "ReduceSum", "ReduceMax"):
            if a.get("axes") is None:
                raise self._refuse("reduces over every axis, the batch included")
            axes = {ax % rank0 for ax in a["axes"]}
            if s0.axis in axes:
                raise self._refuse("reduces over the batch axis")
            keep = a.get("keepdims", 1)
            return ins, a, Batched(s0.axis if keep else s0.axis - sum(ax < s0.axis for ax in axes), s0.mult)
        if op == "Split":
            if a["axis"] % rank0 == s0.axis:
                raise self._refuse("splits the batch axis")
            return ins, a, s0
        if op == "Transpose":
            perm = list(transpose_perm(a, rank0))
            return ins, a, Batched(perm.index(s0.axis), s0.mult)
        if op == "Slice":
            return self._slice(ins, a, s0)
        if op == "Reshape":
            return self._reshape(ins, a, s0)
        if op == "Expand":
            shape = list(a["shape"])
            rank = max(len(shape), rank0)
            ax = s0.axis + rank - rank0
            k = ax - (rank - len(shape))  # the same axis in the (right-aligned) target shape
            if k >= 0:
                if shape[k] not in (1, self.b0 * s0.mult):
                    raise self._refuse("expands the batch axis")
                shape[k] = 1  # broadcasting keeps the input's (batch) dim
            return ins, {**a, "shape": tuple(shape)}, Batched(ax, s0.mult)
        if op in ("Patchify", "Conv"):
            if s0.axis != 0:
                raise self._refuse("has the batch off its image axis 0")
            return ins, a, s0
        if op == "Linear":
            if s0.axis == rank0 - 1:
                raise self._refuse("contracts over the batch axis")
            return ins, a, s0
        if op == "MatMul":
            return self._matmul(ins, a, states)
        if op == "Attention":
            return self._attention(ins, a, states)
        if op == "Concat":  # every part must have the batch dim: batch-free parts are repeated per sample
            found = next(s for s in states if s is not None)
            if any(s is not None and s != found for s in states):
                raise self._refuse("carries the batch on different axes of its operands")
            if a["axis"] % rank0 == found.axis:
                raise self._refuse("concatenates along the batch axis")
            return [i if s is not None else self._promote(i, found.axis, found.mult)
                    for i, s in zip(ins, states)], a, found
        if op == "Gather":
            return self._gather(ins, a, states)
        raise self._refuse("has no rule to change its batch")

    def _slice(self, ins: list[str], a: dict, s: Batched) -> tuple[list[str], dict, Batched]:
        shape = self._t(ins[0]).shape
        steps = list(a.get("steps") or [1] * len(a["axes"]))
        keep = []
        for k, ax in enumerate(a["axes"]):
            ax %= len(shape)
            if ax != s.axis:
                keep.append(k)
                continue
            dim = shape[ax]
            start = int(a["starts"][k]) + (dim if int(a["starts"][k]) < 0 else 0)
            end = int(a["ends"][k]) + (dim if int(a["ends"][k]) < 0 else 0)
            if steps[k] != 1 or start > 0 or end < dim:  # only the whole batch axis passes through unchanged
                raise self._refuse("slices the batch axis")
        attrs = {**a, **{key: [list(a[key])[k] for k in keep] for key in ("starts", "ends", "axes")},
                 "steps": [steps[k] for k in keep]}
        return ins, attrs, s

    def _reshape(self, ins: list[str], a: dict, s: Batched) -> tuple[list[str], dict, Batched]:
        """Row-major reshape keeps samples apart when each (outer index, sample) chunk of the input lands on one
        (outer index, sample) chunk of the output: same outer size before the batch axis, same elements per chunk."""
        src = self._t(ins[0]).shape
        dst = tuple(a["shape"])
        pre = _prod(src[:s.axis])
        chunk = s.mult * _prod(src[s.axis + 1:])
        readings = []
        for k in range(len(dst)):
            if _prod(dst[:k]) > pre:
                break
            if _prod(dst[:k]) != pre or dst[k] % self.b0:
                continue
            mult = dst[k] // self.b0
            if mult * _prod(dst[k + 1:]) == chunk:
                readings.append(Batched(k, mult))
        if not readings:
            raise self._refuse(f"mixes samples: {list(src)} -> {list(dst)} does not keep each sample's values "
                               "together")
        readings.sort(key=lambda r: (r.mult != 1, r.axis))  # the batch as a dim of its own first
        if len(readings) > 1:
            self.decisions.append((self.index, len(readings)))
        out = readings[min(self.choices.get(self.index, 0), len(readings) - 1)]
        shape = list(dst)
        shape[out.axis] = self.b * out.mult
        return ins, {**a, "shape": tuple(shape)}, out

    def _matmul(self, ins: list[str], a: dict, states: list) -> tuple[list[str], dict, Batched]:
        x, w = ins
        sx, sw = states
        rx, rw = self._rank(x), self._rank(w)
        rank = max(rx, rw)
        if (sx is not None and rx < 2) or (sw is not None and rw < 2):
            raise self._refuse("carries the batch on a vector operand")
        lead = None  # (output axis, mult) when the batch is on a broadcast (leading) axis
        out = None
        if sx is not None:
            if sx.axis == rx - 1:
                raise self._refuse("contracts over the batch axis")
            if sx.axis == rx - 2:
                out = Batched(rank - 2, sx.mult)
            else:
                lead = Batched(sx.axis + rank - rx, sx.mult)
        if sw is not None:
            if sw.axis == rw - 2:
                raise self._refuse("contracts over the batch axis")
            if sw.axis == rw - 1:
                if out is not None or lead is not None:
                    raise self._refuse("multiplies two operands that both carry the batch")
                out = Batched(rank - 1, sw.mult)
            else:
                b = Batched(sw.axis + rank - rw, sw.mult)
                if out is not None or (lead is not None and lead != b):
                    raise self._refuse("carries the batch on different axes of its operands")
                lead = b
        if lead is None:
            return ins, a, out  # type: ignore[return-value]
        new = list(ins)
        for k, (i, s) in enumerate(zip(ins, states)):
            j = lead.axis - (rank - self._rank(i))
            if s is None and j >= 0 and self._t(i).shape[j] != 1:
                new[k] = self._promote(i, j, lead.mult)
        return new, a, lead

    def _attention(self, ins: list[str], a: dict, states: list) -> tuple[list[str], dict, Batched]:
        q, k, v = states[:3]
        rank = self._rank(ins[0])
        if q is None or q != k or q != v or q.axis >= rank - 2:
            raise self._refuse("does not carry the batch on the same leading axis of q, k and v")
        new = list(ins)
        if len(ins) > 3 and ins[3]:  # the mask broadcasts against the scores [..., Sq, Sk]
            mask, sm = ins[3], states[3]
            j = q.axis - (rank - self._rank(mask))
            if sm is not None and sm != Batched(j, q.mult):
                raise self._refuse("carries the batch of its mask on another axis")
            if sm is None and j >= 0 and self._t(mask).shape[j] != 1:
                new[3] = self._promote(mask, j, q.mult)
        return new, a, q

    def _gather(self, ins: list[str], a: dict, states: list) -> tuple[list[str], dict, Batched]:
        data, idx = ins
        sd, si = states
        axis = a.get("axis", 0) % self._rank(data)
        ri = self._rank(idx)
        if sd is not None and si is not None:
            raise self._refuse("gathers batched data with batched indices")
        if si is not None:  # an embedding lookup: each sample's ids pick rows of a shared table
            return ins, a, Batched(axis + si.axis, si.mult)
        if sd.axis != axis:
            return ins, a, Batched(sd.axis if sd.axis < axis else sd.axis - 1 + ri, sd.mult)
        # Gathering along the batch axis with constant indices: exporters flatten a per-sample gather (HF's mask
        # building) into indices b*mult + r. Accepted when one axis of the indices runs over the samples and every
        # sample's r is the same; the indices for the new batch are then r + b*mult for each b.
        c = self.constants.get(idx)
        if c is None:
            raise self._refuse("gathers along the batch axis with indices computed at run time")
        m, n = sd.mult, self.b0 * sd.mult
        vals = np.asarray(c.value()).astype(np.int64)
        vals = np.where(vals < 0, vals + n, vals)
        for k, d in enumerate(vals.shape):
            if d != self.b0:
                continue
            sample = np.arange(self.b0).reshape((1,) * k + (self.b0,) + (1,) * (ri - k - 1))
            rest = vals - sample * m
            if np.all((rest >= 0) & (rest < m)) and np.all(rest == rest.take([0], axis=k)):
                if vals.size // self.b0 * self.b > MAX_NEW_ELEMENTS:
                    raise self._refuse(f"would need {vals.size // self.b0 * self.b:,} gather indices at batch "
                                       f"{self.b}, more than tremula makes for a rebatched graph")
                new_sample = np.arange(self.b).reshape((1,) * k + (self.b,) + (1,) * (ri - k - 1))
                shape = list(vals.shape)
                shape[k] = self.b
                new_vals = (np.broadcast_to(rest.take([0], axis=k), shape) + new_sample * m).astype(c.type.dtype)
                name = self._fresh(f"{idx}/rebatched")
                self.constants[name] = Constant.of(name, np.ascontiguousarray(new_vals))
                return [data, name], a, Batched(axis + k, 1)
        raise self._refuse("gathers along the batch axis with indices that are not one sample's pattern repeated")

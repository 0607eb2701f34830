"""Strided views: what a chain of Reshapes, Transposes, Gathers and Slices does to a tensor, as offsets and strides.

A View says where each element of a value sits in a source value: element (i0, i1, ..) is at flat source position
offset + the sum over its dimensions' modes (size, stride) of digit * stride, a dimension's index split into digits over
its modes outermost first. Carrying a View through a chain of moves costs a few tuples whatever the tensor's size, so a
pass can compare two chains exactly at any batch without an index array the size of the tensor (gigabytes at a large
batch). A move a View cannot express (a Reshape splitting a mode by a size that does not divide it, a Gather of many
indices) gives None, and the caller leaves the chain alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from tremula.ir.graph import Graph, Node
from tremula.ir.ops import _slices, transpose_perm  # (_slices: the same slice semantics as the op itself)

Mode = tuple[int, int]  # (size, stride)


def coalesce(modes: tuple[Mode, ...] | list[Mode]) -> tuple[Mode, ...]:
    """The same map with size-1 modes dropped and neighbours that step as one mode merged (unique for a given map)."""
    out: list[Mode] = []
    for size, stride in modes:
        if size == 1:
            continue
        if out and out[-1][1] == size * stride:  # the outer mode steps over exactly this one's extent
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return tuple(out)


@dataclass(frozen=True)
class View:
    offset: int
    dims: tuple[tuple[Mode, ...], ...]

    @staticmethod
    def of(shape: tuple[int, ...]) -> View:
        """The value itself: row-major strides."""
        dims, stride = [], 1
        for n in reversed(shape):
            dims.insert(0, ((n, stride),))
            stride *= n
        return View(0, tuple(dims))

    @property
    def shape(self) -> tuple[int, ...]:
        out = []
        for modes in self.dims:
            n = 1
            for size, _ in modes:
                n *= size
            out.append(n)
        return tuple(out)

    def flat(self) -> tuple[int, tuple[Mode, ...]]:
        """(offset, coalesced modes of all dimensions in order): equal for two Views iff they map alike."""
        return self.offset, coalesce([m for modes in self.dims for m in modes])

    def same(self, other: View) -> bool:
        return self.shape == other.shape and self.flat() == other.flat()

    # ------------------------------------------------------------------------------------------------ moves
    def reshape(self, shape: tuple[int, ...]) -> View | None:
        modes = [m for d in self.dims for m in d if m[0] != 1]
        dims: list[tuple[Mode, ...]] = []
        for n in shape:
            got: list[Mode] = []
            rem = n
            while rem > 1:
                if not modes:
                    return None
                size, stride = modes[0]
                if rem % size == 0:
                    got.append(modes.pop(0))
                    rem //= size
                elif size % rem == 0:  # split the mode: its outer part here, the inner part for the next dims
                    got.append((rem, stride * (size // rem)))
                    modes[0] = (size // rem, stride)
                    rem = 1
                else:
                    return None
            dims.append(tuple(got))
        return None if modes else View(self.offset, tuple(dims))

    def transpose(self, perm: tuple[int, ...]) -> View:
        return View(self.offset, tuple(self.dims[p] for p in perm))

    def take(self, axis: int, index: int) -> View:
        """Element `index` of dimension `axis` (the axis dropped)."""
        modes = self.dims[axis]
        offset = self.offset
        for size, stride in reversed(modes):
            offset += (index % size) * stride
            index //= size
        return View(offset, self.dims[:axis] + self.dims[axis + 1:])

    def slice(self, axis: int, start: int, length: int, step: int = 1) -> View | None:
        modes = coalesce(self.dims[axis])
        if length == self.shape[axis] and step == 1:
            return self
        if len(modes) != 1:  # a range inside a dimension of several modes is not one stride
            return None
        size, stride = modes[0]
        dims = list(self.dims)
        dims[axis] = ((length, stride * step),)
        return View(self.offset + start * stride, tuple(dims))

    def apply(self, graph: Graph, node: Node, output: str) -> View | None:
        """This View (of node's data input) carried through `node` to its output `output`, or None."""
        t = graph.types[node.inputs[0]]
        rank = len(t.shape)
        if node.op == "Identity":
            return self
        if node.op == "Reshape":
            return self.reshape(graph.types[output].shape)
        if node.op == "Transpose":
            return self.transpose(transpose_perm(node.attrs, rank))
        if node.op == "Gather":
            idx = graph.constants.get(node.inputs[1])
            if idx is None or idx.type.shape != ():
                return None
            axis = node.attrs.get("axis", 0) % rank
            i = int(idx.value())
            return self.take(axis, i + t.shape[axis] if i < 0 else i)
        if node.op == "Slice":
            v: View | None = self
            for axis, s in enumerate(_slices(t.shape, node.attrs)):
                start, stop, step = s.indices(t.shape[axis])
                length = len(range(start, stop, step))
                v = v.slice(axis, start, length, step) if v is not None and (step > 0 or length <= 1) else None
            return v
        if node.op == "Split":
            axis = node.attrs["axis"] % rank
            at = node.outputs.index(output)
            sizes = node.attrs["sizes"]
            return self.slice(axis, sum(sizes[:at]), sizes[at])
        return None


def carry(view: View | None, graph: Graph, chain: list[Node], end: str) -> View | None:
    """A View of the chain's first input carried through each node of the chain to value `end`."""
    for i, n in enumerate(chain):
        if view is None:
            return None
        view = view.apply(graph, n, chain[i + 1].inputs[0] if i + 1 < len(chain) else end)
    return view

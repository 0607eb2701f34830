"""The IR: a Graph of static-shaped values, topologically ordered nodes and (possibly lazy) constants."""

from __future__ import annotations

import threading
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tremula.errors import TremulaError
from tremula.numerics.fp8 import FP8_DTYPES  # (importing ml_dtypes lets NumPy read their names)

# Element types the IR knows, by NumPy name. An FP8 tensor (QUARTER: one code byte an element) has its format's
# ml_dtypes name; its power-of-two scale is an attribute or an int8 metadata tensor beside it (numerics/fp8.py).
DTYPES = ("float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool", *FP8_DTYPES)


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise TremulaError(f"unsupported element type {self.dtype!r} (known: {', '.join(DTYPES)})")
        if any((not isinstance(d, (int, np.integer))) or d < 0 for d in self.shape):
            raise TremulaError(f"shape {self.shape} is not static and non-negative")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class LazyInit:
    """How to make a constant's values when they are first needed: seeded, so planning never allocates weights.

    kind: "normal" (mean + std * N(0,1)), "uniform" (low=mean-std, high=mean+std), "zeros", "ones", "fill" (mean).
    """

    kind: str
    seed: int = 0
    mean: float = 0.0
    std: float = 1.0

    def make(self, ttype: TensorType) -> np.ndarray:
        """The values, shared read-only with every other constant of the same init and type while any holds them
        (or a `sharing_weights` block is open): a model built twice (FP8 calibration builds it at four samples, then
        the check at its batch) draws its seeded weights once (SigLIP so400m: 10 s and 1.7 GB a build)."""
        key = (self, ttype.shape, ttype.dtype)
        x = _MADE.get(key)
        if x is None:
            with _making(key):  # (a second thread asking for them meanwhile waits for these, made once)
                x = _MADE.get(key)
                if x is None:
                    x = self._make(ttype)
                    x.flags.writeable = False  # (shared: an in-place change would change every graph's weights)
                    _MADE[key] = x
        if _HELD:
            _HELD[0].append(x)
        return x

    def _make(self, ttype: TensorType) -> np.ndarray:
        if self.kind == "zeros":
            return np.zeros(ttype.shape, ttype.dtype)
        if self.kind == "ones":
            return np.ones(ttype.shape, ttype.dtype)
        if self.kind == "fill":
            return np.full(ttype.shape, self.mean, ttype.dtype)
        rng = np.random.default_rng(self.seed)
        if self.kind == "normal":  # in place: the same float32 operations as x * std + mean, without temporaries
            x = rng.standard_normal(ttype.shape, dtype=np.float32)
            x *= np.float32(self.std)
            x += np.float32(self.mean)
        elif self.kind == "uniform":
            x = rng.uniform(self.mean - self.std, self.mean + self.std, ttype.shape).astype(np.float32)
        elif self.kind == "randint":
            x = rng.integers(int(self.mean), int(self.std), ttype.shape)
        else:
            raise TremulaError(f"unknown lazy initialiser {self.kind!r}")
        return x.astype(ttype.dtype, copy=False)


_MADE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (init, shape, dtype) -> values, see LazyInit.make
_HELD: list[list[np.ndarray]] = []  # the seeded values made inside the open sharing_weights blocks (outermost first)
_LOCKS: dict[tuple, threading.Lock] = {}  # key of _MADE -> the lock its maker holds, while one does
_LOCKS_LOCK = threading.Lock()


@contextmanager
def _making(key: tuple) -> Iterator[None]:
    """Held while the values of `key` are made: the FP8 calibration makes the weights it reads next on a second
    thread (passes/precision.calibration_scales) while its interpreter may ask for them."""
    with _LOCKS_LOCK:
        lock = _LOCKS.setdefault(key, threading.Lock())
    with lock:
        yield
    with _LOCKS_LOCK:
        _LOCKS.pop(key, None)


@contextmanager
def sharing_weights() -> Iterator[None]:
    """Inside the block, seeded weights stay made after the graph that made them is dropped, so a graph built later
    in the block reuses them (check_model: calibration's graph, then the compiled one); released when the outermost
    block closes."""
    _HELD.append([])
    try:
        yield
    finally:
        _HELD.pop()


def make_values(constants: Iterable[Constant], threads: int) -> None:
    """Make every lazy constant's values now, on `threads` threads (seeded: the same bits on any thread; NumPy's
    generators and the compiled kernels let go of the interpreter lock while they fill an array): SigLIP so400m's
    428 M seeded values take 8.4 s on one core."""
    lazy = [c for c in constants if c.is_lazy]
    if threads <= 1 or len(lazy) < 2:
        for c in lazy:
            c.value()
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="tremula-values") as pool:
        for _ in pool.map(Constant.value, lazy):
            pass


@dataclass(frozen=True, eq=False)
class DerivedInit:
    """A constant made from another constant's values when first needed (e.g. FP8 weight codes made from the float
    weight at load time, as a runtime quantises weights when it loads them): planning never materialises either."""

    source: Constant
    fn: Callable[[np.ndarray], np.ndarray]
    what: str  # for messages and reports, e.g. "fp8 codes F143"

    def make(self, ttype: TensorType) -> np.ndarray:
        out = np.asarray(self.fn(self.source.value()))
        if tuple(out.shape) != ttype.shape:
            raise TremulaError(f"{self.what} of {self.source.name!r}: made {list(out.shape)}, expected {ttype}")
        return out.astype(ttype.dtype, copy=False)


@dataclass(frozen=True, eq=False)
class ConcatInit:
    """A constant made by joining other constants along `axis` when first needed (a fused projection's weights from
    its parts': passes/fuse_qkv.py), so planning stays lazy."""

    sources: tuple[Constant, ...]
    axis: int
    what: str

    def make(self, ttype: TensorType) -> np.ndarray:
        return self.join([s.value() for s in self.sources], ttype)

    def join(self, parts: list[np.ndarray], ttype: TensorType) -> np.ndarray:
        out = np.concatenate(parts, axis=self.axis)
        if tuple(out.shape) != ttype.shape:
            raise TremulaError(f"{self.what}: made {list(out.shape)}, expected {ttype}")
        return out.astype(ttype.dtype, copy=False)


@dataclass(frozen=True, eq=False)
class FoldInit:
    """A constant computed from other constants by one op when first needed: constant folding over lazy weights
    (passes/fold.py), so a zoo model folds what the same model with a checkpoint's weights folds, without allocating
    either while planning."""

    sources: tuple[Constant, ...]
    fn: Callable[[list[np.ndarray]], np.ndarray]  # the op on the sources' values (one of its outputs)
    what: str

    def make(self, ttype: TensorType) -> np.ndarray:
        return self.compute([s.value() for s in self.sources], ttype)

    def compute(self, values: list[np.ndarray], ttype: TensorType) -> np.ndarray:
        out = np.asarray(self.fn(values))
        if tuple(out.shape) != ttype.shape:
            raise TremulaError(f"{self.what}: made {list(out.shape)}, expected {ttype}")
        return out.astype(ttype.dtype, copy=False)


def name_seed(base_seed: int, name: str) -> int:
    """A seed for one named tensor, stable across runs and Python versions (hash() is salted; crc32 is not)."""
    return (base_seed * 1_000_003 + zlib.crc32(name.encode())) & 0xFFFFFFFF


@dataclass
class Constant:
    """A tensor known at compile time: either concrete data or a LazyInit that makes it on demand."""

    name: str
    type: TensorType
    data: np.ndarray | None = None
    init: LazyInit | DerivedInit | ConcatInit | FoldInit | None = None

    def __post_init__(self) -> None:
        if (self.data is None) == (self.init is None):
            raise TremulaError(f"constant {self.name!r} needs exactly one of data or init")
        if self.data is not None:
            if tuple(self.data.shape) != self.type.shape or str(self.data.dtype) != self.type.dtype:
                raise TremulaError(
                    f"constant {self.name!r}: data {self.data.dtype}{list(self.data.shape)} does not match {self.type}"
                )

    @property
    def is_lazy(self) -> bool:
        return self.data is None

    def value(self) -> np.ndarray:
        """The values, made (and cached) if lazy. Two threads may ask at once: the data is set before the init is
        dropped, so one that finds no init finds the data."""
        data = self.data
        if data is None:
            init = self.init
            if init is None:
                return self.data  # type: ignore[return-value]  (made by another thread meanwhile)
            data = init.make(self.type)
            self.data = data
            self.init = None
        return data

    @staticmethod
    def of(name: str, array: np.ndarray) -> Constant:
        array = np.asarray(array)
        return Constant(name, TensorType(tuple(array.shape), str(array.dtype)), data=array)


@dataclass
class Node:
    op: str
    inputs: list[str]  # "" marks an omitted optional input
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""


@dataclass
class Graph:
    """A model as the rest of the pipeline sees it.

    `types` holds the TensorType of every value: graph inputs, constants and node outputs.
    Nodes are in topological order; every input of a node is a graph input, a constant or an earlier node's output.
    """

    name: str
    inputs: list[str]
    outputs: list[str]
    nodes: list[Node]
    constants: dict[str, Constant]
    types: dict[str, TensorType]

    def copy(self) -> Graph:
        return Graph(
            self.name,
            list(self.inputs),
            list(self.outputs),
            [Node(n.op, list(n.inputs), list(n.outputs), dict(n.attrs), n.name) for n in self.nodes],  # (not replace:
            # a third of the time on a base model's thousands of nodes, copied at every batch a search plans)
            dict(self.constants),
            dict(self.types),
        )

    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs}

    def consumers(self) -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i:
                    out.setdefault(i, []).append(n)
        return out

    def param_count(self) -> int:
        """Float constants of rank >= 1: the weights (helper scalars such as a mask's fill value are not parameters)."""
        return sum(c.type.size for c in self.constants.values() if c.type.dtype.startswith("float") and c.type.shape)

    def param_bytes(self) -> int:
        return sum(c.type.nbytes for c in self.constants.values())

    def fresh_name(self, base: str) -> str:
        """A value name not used yet in this graph."""
        if base not in self.types:
            return base
        i = 1
        while f"{base}_{i}" in self.types:
            i += 1
        return f"{base}_{i}"


def model_batch(graph: Graph) -> int | None:
    """The batch a graph really has: the first dim all its inputs share (None when they disagree or have none).

    Frontends put the batch first on every input (a fixed-batch ONNX file at its own batch or rebatched), so this is
    what reports must state, not the batch that was asked for."""
    firsts = {graph.types[i].shape[0] for i in graph.inputs if graph.types[i].shape}
    return firsts.pop() if len(firsts) == 1 else None

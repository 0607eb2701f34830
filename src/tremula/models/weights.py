"""Weight sources: where a model builder's tensors come from — lazy seeded (zoo) or a checkpoint's arrays (HF)."""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from tremula.errors import TremulaError
from tremula.ir.builder import GraphBuilder

ToIR = Callable[[np.ndarray], np.ndarray]


class WeightSource(Protocol):
    def get(self, b: GraphBuilder, name: str, shape: tuple[int, ...], *, init: str = "normal",
            hf_name: str | None = None, hf_shape: tuple[int, ...] | None = None, to_ir: ToIR | None = None) -> str:
        """A constant `name` of IR shape `shape` in builder `b`.

        `hf_name`/`hf_shape` say which checkpoint tensor holds it (default: `name`, `shape`) and `to_ir` how to turn
        that tensor into the IR layout (e.g. transpose nn.Linear's [out,in] to [in,out]); `init` is the HF-style
        initialiser a lazy source uses instead ("normal" std 0.02, "zeros", "ones").
        """
        ...


class LazyWeights:
    """Seeded random weights that exist only when asked for, so planning a 400M-parameter model allocates nothing."""

    def __init__(self, std: float = 0.02):
        self.std = std

    def get(self, b, name, shape, *, init="normal", hf_name=None, hf_shape=None, to_ir=None) -> str:
        return b.param(name, tuple(shape), kind=init, std=self.std)


class CheckpointWeights:
    """Concrete arrays read from a checkpoint; layouts are converted once here, at load."""

    def __init__(self, fetch: Callable[[str], np.ndarray | None], where: str):
        self.fetch = fetch  # HF name → array, or None when absent
        self.where = where  # the folder, for error messages
        self.used: set[str] = set()  # HF names read into the graph, so a frontend can tell what it left out

    def has(self, hf_name: str) -> bool:
        return self.fetch(hf_name) is not None

    def get(self, b, name, shape, *, init="normal", hf_name=None, hf_shape=None, to_ir=None) -> str:
        hf_name = hf_name or name
        hf_shape = tuple(hf_shape or shape)
        arr = self.fetch(hf_name)
        if arr is None:
            raise TremulaError(f"tensor {hf_name!r} is missing from the checkpoint in {self.where}")
        self.used.add(hf_name)
        if tuple(arr.shape) != hf_shape:
            raise TremulaError(
                f"tensor {hf_name!r} in {self.where} has shape {list(arr.shape)}, config.json implies {list(hf_shape)}"
            )
        if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":  # ml_dtypes' bfloat16 has kind "V"
            raise TremulaError(f"tensor {hf_name!r} in {self.where} is {arr.dtype}, expected floating point")
        # The Graph is float32; the precision pass lowers it later, from the exact values.
        arr = arr.astype(np.float32)
        if to_ir is not None:
            arr = to_ir(arr)
        arr = np.ascontiguousarray(arr)
        assert arr.shape == tuple(shape), (name, arr.shape, shape)
        return b.const(name, arr)

"""Reference matmuls whose values do not depend on how many threads compute them (an `override` for ir/interp.run).

OpenBLAS's sgemm rounds differently with the shape of a call and with the number of threads it runs on. Measured on
this project's 2-core VM (OpenBLAS 0.3.31, Haswell kernels): 3.5 % of the elements of a float32 [2916, 1152] @
[1152, 4304] product differ between one thread and two, and so do a product's rows and the same rows multiplied
alone. The FP8 calibration's threads used to change with the load (compiler._calibration_beside raised them when the
planner beside it waited), so SigLIP so400m's layer-4 fc2 input calibrated to scale -6 on one run and -5 on another,
and the same compile gave two Programs (7,374,177 and 7,374,201 cycles at fp8 batch 1).

Here a Linear or MatMul whose right operand is a matrix runs its own rule on blocks of ROWS rows of the left operand,
each block one BLAS call on one thread (the caller holds BLAS to one thread: passes/precision.calibration_scales),
and the blocks are spread over a pool of threads (NumPy releases the interpreter lock inside BLAS). An Attention runs
its rule on each sample (the first axis) apart: NumPy's stacked matmul calls BLAS once per matrix, so a sample's
values are the ones it has in the whole batch. The values depend on ROWS only; the number of threads sets the speed.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tremula.ir.graph import Node
from tremula.ir.ops import RefRule, rule

ROWS = 512  # rows of the left operand per BLAS call (so400m's 729 tokens a sample: under two blocks each)
OPS = ("Linear", "MatMul", "Attention")


class BlockedMatmuls:
    """override(node) for ir.interp.run: Linear and MatMul by row blocks, Attention by samples, on threads() threads
    (read at each node, so a caller may give the calibration more threads once the planner beside it waits)."""

    def __init__(self, threads: Callable[[], int]):
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0

    def __call__(self, node: Node) -> RefRule | None:
        if node.op not in OPS:
            return None
        ref = rule(node.op).ref
        if node.op == "Attention":
            return lambda args, attrs: self._by_sample(ref, args, attrs)

        def blocked(args: list[np.ndarray], attrs) -> list[np.ndarray]:
            x, w = args[0], args[1]
            if w.ndim != 2 or x.ndim < 2:
                return ref(args, attrs)
            rows = x.reshape(-1, x.shape[-1])
            if _float32(args):
                return [self._into(rows, w, args[2] if len(args) > 2 else None).reshape(*x.shape[:-1], w.shape[1])]
            blocks = [rows[i: i + ROWS] for i in range(0, len(rows), ROWS)]
            one = lambda b: ref([b, *args[1:]], attrs)[0]  # noqa: E731 (the op's rule on one block)
            outs = list(self._map(one, blocks))
            return [np.concatenate(outs).reshape(*x.shape[:-1], outs[0].shape[-1])]

        return blocked

    def _into(self, rows: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """The float32 rule (ops._linear_ref: one BLAS product, then the bias added in place) on each block of rows,
        written into its rows of one result: the same calls on the same blocks, without a copy of every block into
        the result after (SigLIP so400m's calibration on one core: its Linears 23.8 -> 22.2 s)."""
        out = np.empty((len(rows), w.shape[1]), np.float32)

        def one(i: int) -> None:
            o = out[i: i + ROWS]
            np.matmul(rows[i: i + ROWS], w, out=o)
            if bias is not None:
                np.add(o, bias, out=o)

        for _ in self._map(one, range(0, len(rows), ROWS)):
            pass
        return out

    def _by_sample(self, ref: RefRule, args: list[np.ndarray], attrs) -> list[np.ndarray]:
        q = args[0]
        mask = args[3] if len(args) > 3 else None
        split_mask = mask is not None and mask.ndim == q.ndim and mask.shape[0] == q.shape[0]
        if q.ndim < 3 or q.shape[0] == 1 or not (mask is None or split_mask or mask.ndim < q.ndim or
                                                 mask.shape[0] == 1):
            return ref(args, attrs)

        def one(i: int) -> np.ndarray:
            part = [a[i: i + 1] for a in args[:3]] + ([mask[i: i + 1] if split_mask else mask] if len(args) > 3
                                                       else [])
            return ref(part, attrs)[0]

        return [np.concatenate(list(self._map(one, range(q.shape[0]))))]

    def _map(self, fn, blocks):
        n = max(1, int(self.threads()))
        if n == 1 or len(blocks) == 1:
            return map(fn, blocks)
        if self._pool is None or self._size != n:
            self.close()
            self._pool, self._size = ThreadPoolExecutor(n, thread_name_prefix="tremula-blas"), n
        return self._pool.map(fn, blocks)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool, self._size = None, 0


def _float32(args: list[np.ndarray]) -> bool:
    """Whether a Linear or MatMul's rule is the plain float32 product (and bias): float32 operands (half partials are
    a half operand's), a bias absent or float32 of the output's width."""
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else None
    return x.dtype == np.float32 and w.dtype == np.float32 and (bias is None or (bias.dtype == np.float32 and
                                                                                  bias.shape == (w.shape[1],)))

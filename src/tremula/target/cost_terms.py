"""Cost terms the planner and the codelets need, written on top of `target.cost` (the one cost model) and the Chip.

`target.cost` prices the popops vector ops the chip files list; an element-wise op those tables do not have is priced
as the nearest listed instruction sequence, which its row in ir/ops.py gives (`sequence_cycles`).
"""

from __future__ import annotations

import numpy as np

from tremula.numerics.fp8 import is_fp8
from tremula.target import cost

# Counts reach these functions from layouts, whose sizes are often NumPy integers (a layout's rows, cuts' diffs); the
# cost model takes Python ints only (it refuses anything else, to catch a float or bool passed by mistake), so every
# count is converted here, where the planner meets the cost model (siglip-tiny on a 2-tile chip stopped on one).


def _d(dtype: str) -> str:
    """Integer and bool element-wise work is priced at the 32-bit (float) vector rate: the vector unit is 32-bit."""
    return dtype if dtype in ("float16", "float32") else "float32"


def matmul_cycles(chip, m: int, k: int, n: int, dtype: str, partials: str = "float", accumulate: bool = False,
                  weights: bool = False) -> int:
    """One tile's [m,k] x [k,n] on the AMP. fp16 inputs accumulate in float32 (the half->float path, 8 conv units) or,
    with half partials, on the half->half path (16 conv units: twice the MACs per cycle, numerics/amp.py); FP8
    operands run on the quarter->half path (codelets/fp8.py), the only FP8 path the C600 has. accumulate: a later K
    round adding into the partials; weights: w is a Linear's stored weights, not an activation
    (cost.amp_matmul_cycles)."""
    m, k, n = int(m), int(k), int(n)
    if is_fp8(dtype):
        return int(cost.amp_matmul_cycles(chip, m, k, n, "fp8", "float16", accumulate, weights))
    acc = "float16" if partials == "half" and dtype == "float16" else "float32"
    return int(cost.amp_matmul_cycles(chip, m, k, n, _d(dtype), acc, accumulate, weights))


def vector_cycles(chip, kind: str, n: int, dtype: str) -> int:
    n = int(n)
    if n == 0:
        return 0
    dtype = _d(dtype)
    if kind == "copy":
        return copy_cycles(chip, n * (2 if "16" in dtype else 4))
    if kind == "gelu":
        return int(cost.gelu_cycles(chip, n, dtype))
    return int(cost.vector_cycles(chip, kind, n, dtype))


def sequence_cycles(chip, seq: tuple[tuple[str, int], ...], n: int, dtype: str) -> int:
    """An element-wise op's cost: its row's instructions (ir/ops.py `cost`: (vector op, passes)) over n elements."""
    return sum(int(k) * vector_cycles(chip, op, n, dtype) for op, k in seq)


def softmax_cycles(chip, rows: int, cols: int, dtype: str) -> int:
    return int(cost.softmax_cycles(chip, int(rows), int(cols), _d(dtype)))


def exp_shifted_cycles(chip, rows: int, cols: int, dtype: str) -> int:
    return int(cost.exp_shifted_cycles(chip, int(rows), int(cols), _d(dtype)))


def layernorm_cycles(chip, rows: int, cols: int, dtype: str) -> int:
    return int(cost.layernorm_cycles(chip, int(rows), int(cols), _d(dtype)))


def layernorm_moments_cycles(chip, rows: int, width: int, dtype: str) -> int:
    return int(cost.layernorm_moments_cycles(chip, int(rows), int(width), _d(dtype)))


def layernorm_apply_cycles(chip, rows: int, width: int, parts: int, dtype: str) -> int:
    return int(cost.layernorm_apply_cycles(chip, int(rows), int(width), int(parts), _d(dtype)))


def reduce_cycles(chip, rows: int, cols: int, dtype: str) -> int:
    return int(cost.reduce_cycles(chip, int(rows), int(cols), _d(dtype)))


def copy_cycles(chip, nbytes: int) -> int:
    return int(cost.copy_cycles(chip, int(nbytes)))


def exchange_cycles(chip, max_sent: int, max_recv: int) -> int:
    return int(cost.exchange_cycles(chip, int(max_sent), int(max_recv)))


def sync_cycles(chip) -> int:
    return int(cost.sync_cycles(chip))


# A shared layer's call (program.Call), before its template's code runs, on each tile: the patch vertex rewrites the
# call's vertex fields (a 78-word patch took 936 cycles on six workers on a C600, ipu-stack-facts §2.2 [M]: 12 cycles
# a word, its fixed part included), and tiles that send from weights set their weight base (SETZI + INCOMING_BASE +
# OUTGOING_BASE: 27 cycles, §1.4 [M]). Measured on IPU21; used for every chip (the instructions are the same).
PATCH_CYCLES_PER_WORD = 936 // 78
BASE_SET_CYCLES = 27


def call_cycles(words: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Cycles per tile a call spends before its template's code: `words` fields rewritten, `base` set or not."""
    return PATCH_CYCLES_PER_WORD * np.asarray(words, np.int64) + BASE_SET_CYCLES * np.asarray(base, np.int64)

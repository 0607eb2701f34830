"""The one cost model: cycles of compute, copies, exchange, sync and host transfers, as pure functions of a Chip.

The planner and the timing backend both call these functions (DESIGN.md, "Contract — one cost model"). Every
constant comes from the Chip, i.e. from a chip data file whose values cite ../shared/reference/ipu-hardware.md.
Cycles are tile clock cycles and always integers.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache

from tremula.errors import TremulaError
from tremula.target.chip import AmpPair, Chip, normalize_dtype


def _count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TremulaError(f"cost model: {name} must be a non-negative integer, got {value!r}")
    return value


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- AMP matmul ---------------------------------------------------------------------------------------------------


def _amp_worker_cycles(pair: AmpPair, rows: int, zeroing: bool) -> int:
    """Worker cycles of one ConvPartial1x1 worker call over `rows` output rows (0 rows: the worker is not started)."""
    if rows == 0:
        return 0
    if rows == 1:
        w = pair.worker_cycles_1_row
    elif rows == 2:
        w = pair.worker_cycles_2_rows
    else:
        w = pair.worker_base_cycles + (rows - 3) * pair.core_loop_worker_cycles
    w += pair.zero_worker_cycles_per_row * rows if zeroing else pair.worker_delta_cycles_without_zeroing
    return w - pair.retention_worker_savings_cycles


def _amp_inner_cycles(chip: Chip, pair: AmpPair, m: int, zeroing: bool) -> int:
    """Tile cycles of one pass: the slowest worker x workers, or the fastest worker x workers + its tag cost.

    Rows split as evenly as possible: some workers get ceil(m/workers) rows, the rest floor(m/workers). Which of the
    two is slower is not fixed (poplibs' 2-row path costs more than its 3-row one), so both are priced. With
    m < workers some workers get no rows and count as 0 cycles, as in poplibs.
    """
    workers = chip.workers_per_tile
    per_worker = {_amp_worker_cycles(pair, _cdiv(m, workers), zeroing), _amp_worker_cycles(pair, m // workers, zeroing)}
    return max(workers * max(per_worker), workers * min(per_worker) + chip.amp_worker_tag_cycles)


# cached: the planner prices the same tile shapes for many candidates (a pure function of ints and a frozen chip)
@lru_cache(maxsize=1 << 16)
def amp_matmul_cycles(chip: Chip, m: int, k: int, n: int, in_dtype: str, acc_dtype: str,
                      accumulate: bool = False, weights: bool = False) -> int:
    """Cycles of one tile's AMP vertex computing [m,k] x [k,n] with `in_dtype` inputs accumulating in `acc_dtype`.

    Structure of poplibs' ConvPartial1x1 supervisor estimator (lib/poplin/PerformanceEstimation.hpp; ref §3), with the
    matmul as a 1x1 convolution: m = field rows, k = input channels, n = output channels.
      in_groups  = ceil(k / weights_per_conv_unit)   (padded input-channel groups, one AMP weight load each)
      out_groups = ceil(n / conv_units)              (one conv unit per output channel)
      a pass (one in_group x out_group) = pass_cycles + weight load + inner
        weight load = conv_units x weights_per_conv_unit x bytes(in_dtype) / amp.coeff_load_bytes_per_cycle
        inner       = max(workers x w(ceil(m/workers)), workers x w(floor(m/workers)) + amp.worker_tag_cycles)
        w(rows)     = worker base cycles (rows >= 3) + (rows - 3) x core_loop_worker_cycles, the poplibs 1/2-row values
                      otherwise; the first input group's pass also zeroes the accumulators (per-row cost), later ones
                      differ by worker_delta_cycles_without_zeroing; minus the state-retention saving.
      total = supervisor_cycles + out_group_cycles x out_groups + in_group_cycles x (in_groups - 1)
              + workers x (retention_worker_savings + retention_supervisor_per_input_group x (in_groups - 1))
              + out_groups x [pass(zeroing) + (in_groups - 1) x pass(no zeroing)]
    accumulate: the vertex adds into partials an earlier vertex left (a later K round, plan/strategies.py): no pass
    zeroes the accumulators, so the first is priced as the later ones (poplibs' non-zeroing partials).
    Known simplifications: poplibs' worklist splitting of very long row ranges and conv groups are not modelled; the
    0-row worker cost is taken as 0 (poplibs: ~20 cycles when a worker is started with nothing to do).

    weights: the coefficients (w) are weights the compiler stores, so they can be kept in a kernel's own layout from
    load time on. A chip whose pair has a measured kernel for them (AmpPair.weights_kernel) is priced by it instead:
      fixed + in_groups x out_groups x (row_cycles x m + group_cycles)
    (the C600's: a hand-written interleaved-weight kernel timed on the card, ipu-stack-facts section 2.1, the same
    for a later K round). Activations as coefficients (attention's products, a MatMul of two activations) are not
    in that layout: the estimate above prices them.
    """
    for name, v in (("m", m), ("k", k), ("n", n)):
        _count(name, v)
    if m == 0 or k == 0 or n == 0:
        return 0
    pair = chip.amp_pair(in_dtype, acc_dtype)
    in_groups = _cdiv(k, pair.weights_per_conv_unit)
    out_groups = _cdiv(n, pair.conv_units)
    if weights and pair.weights_kernel is not None:
        fixed, per_row, per_group = pair.weights_kernel
        return fixed + in_groups * out_groups * (per_row * m + per_group)
    in_bytes = {"fp32": 4, "fp16": 2, "fp8": 1}[pair.in_dtype]
    weight_load = _cdiv(pair.conv_units * pair.weights_per_conv_unit * in_bytes, chip.amp_coeff_load_bytes_per_cycle)
    first_pass = pair.pass_cycles + weight_load + _amp_inner_cycles(chip, pair, m, zeroing=not accumulate)
    later_pass = pair.pass_cycles + weight_load + _amp_inner_cycles(chip, pair, m, zeroing=False)
    retention = chip.workers_per_tile * (
        pair.retention_worker_savings_cycles + pair.retention_supervisor_cycles_per_input_group * (in_groups - 1)
    )
    return (
        pair.supervisor_cycles
        + pair.out_group_cycles * out_groups
        + pair.in_group_cycles * (in_groups - 1)
        + retention
        + out_groups * (first_pass + (in_groups - 1) * later_pass)
    )


def amp_peak_cycles(chip: Chip, m: int, k: int, n: int, in_dtype: str, acc_dtype: str) -> float:
    """The ideal cycles of the same matmul at the AMP's MAC/cycle/tile (for utilisation figures)."""
    return m * k * n / chip.amp_pair(in_dtype, acc_dtype).macs_per_cycle_per_tile


# ---- vector (element-wise) and reductions -------------------------------------------------------------------------


def _vector_dtype(dtype: str) -> str:
    # FP8 element-wise work goes through half (ref §5: casts go through half; no FP8 arithmetic on the vector unit).
    d = normalize_dtype(dtype)
    return "fp16" if d == "fp8" else d


def vector_cycles(chip: Chip, op_kind: str, n_elems: int, dtype: str) -> int:
    """Cycles of one element-wise vertex over n_elems elements on one tile (0 elements: no vertex, 0 cycles).

    popops BinaryOp1D / unary supervisor estimate (ref §3, popopsCycleEstimators):
      supervisor + workers x (worker overhead[dtype] + ceil(ceil(n / workers) / elems_per_loop) x cycles_per_loop)
    with the per-op (cycles per loop, elements per loop) from the chip's vector.ops table.
    """
    _count("n_elems", n_elems)
    if n_elems == 0:
        return 0
    op = chip.vector_op(op_kind)
    d = _vector_dtype(dtype)
    if d == "fp16":
        overhead, cpl, epl = chip.vector_fp16_worker_cycles, op.fp16_cycles_per_loop, op.fp16_elems_per_loop
    else:
        overhead, cpl, epl = chip.vector_fp32_worker_cycles, op.fp32_cycles_per_loop, op.fp32_elems_per_loop
    workers = chip.workers_per_tile
    loops = _cdiv(_cdiv(n_elems, workers), epl)
    return chip.vector_supervisor_cycles + workers * (overhead + loops * cpl)


def reduce_cycles(chip: Chip, n_outputs: int, reduce_len: int, dtype: str) -> int:
    """Cycles of one reduce vertex producing n_outputs values, each reducing reduce_len contiguous elements.

    popops single-input reduce estimate (ref §3):
      (worker_cycles + (cycles_per_loop x partials + per_output_cycles) x ceil(n_outputs / workers)) x workers
      + supervisor_cycles,  partials = ceil(reduce_len / accumulator width[dtype])  (4 floats or 8 halves).
    Sum, max and min cost the same here (each is one vector instruction per accumulator vector).
    """
    _count("n_outputs", n_outputs)
    _count("reduce_len", reduce_len)
    if n_outputs == 0 or reduce_len == 0:
        return 0
    d = _vector_dtype(dtype)
    width = chip.reduce_fp16_accumulator_elems if d == "fp16" else chip.reduce_fp32_accumulator_elems
    partials = _cdiv(reduce_len, width)
    workers = chip.workers_per_tile
    per_worker = (chip.reduce_cycles_per_loop * partials + chip.reduce_per_output_cycles) * _cdiv(n_outputs, workers)
    return (chip.reduce_worker_cycles + per_worker) * workers + chip.reduce_supervisor_cycles


# Composite row ops: sums of the vertices a straightforward lowering runs, one vertex per step (an upper bound on a
# fused codelet, which would pay the supervisor and worker overheads once).


def softmax_cycles(chip: Chip, rows: int, row_len: int, dtype: str) -> int:
    """Softmax over the last axis of `rows` rows: max, subtract, exp, sum, reciprocal per row, scale."""
    n = _count("rows", rows) * _count("row_len", row_len)
    if n == 0:
        return 0
    return (exp_shifted_cycles(chip, rows, row_len, dtype)
            + vector_cycles(chip, "divide", rows, "fp32")  # 1 / sum, once per row
            + vector_cycles(chip, "mul", n, dtype))


def exp_shifted_cycles(chip: Chip, rows: int, row_len: int, dtype: str) -> int:
    """A softmax without its normalisation: each row's max, exp(x - max) and the row sum. What a block of keys of a
    split attention computes; the blocks' combine divides by the total sum."""
    n = _count("rows", rows) * _count("row_len", row_len)
    if n == 0:
        return 0
    return (
        reduce_cycles(chip, rows, row_len, dtype)  # row max
        + vector_cycles(chip, "sub", n, dtype)
        + vector_cycles(chip, "exp", n, dtype)
        + reduce_cycles(chip, rows, row_len, "fp32")  # row sums accumulate in float
    )


def layernorm_moments_cycles(chip: Chip, rows: int, width: int, dtype: str) -> int:
    """LayerNorm over column blocks, step 1 on one block: each row's mean and sum of squared deviations."""
    n = _count("rows", rows) * _count("width", width)
    if n == 0:
        return 0
    return (reduce_cycles(chip, rows, width, "fp32") + vector_cycles(chip, "sub", n, dtype)
            + vector_cycles(chip, "mul", n, dtype) + reduce_cycles(chip, rows, width, "fp32"))


def layernorm_apply_cycles(chip: Chip, rows: int, width: int, parts: int, dtype: str) -> int:
    """LayerNorm over column blocks, step 2 on one block: combine the parts' moments per row (Chan et al.: weighted
    mean, then each part's M2 plus its count x squared mean offset, ~6 float ops per part and row), rsqrt, normalise
    and the affine on the block's columns."""
    n = _count("rows", rows) * _count("width", width)
    if n == 0:
        return 0
    return (vector_cycles(chip, "mul", 6 * rows * parts, "fp32") + vector_cycles(chip, "sub", n, dtype)
            + _layernorm_scale_cycles(chip, rows, n, dtype))


def _layernorm_scale_cycles(chip: Chip, rows: int, n: int, dtype: str) -> int:
    """The end of a LayerNorm over n elements in `rows` rows: rsqrt(var + eps) per row, normalise, gamma, beta."""
    return (vector_cycles(chip, "add", rows, "fp32") + vector_cycles(chip, "rsqrt", rows, "fp32")
            + vector_cycles(chip, "mul", n, dtype) + vector_cycles(chip, "mul", n, dtype)
            + vector_cycles(chip, "add", n, dtype))


def layernorm_cycles(chip: Chip, rows: int, row_len: int, dtype: str) -> int:
    """LayerNorm over the last axis: mean, centre, square, variance, rsqrt(var + eps) per row, normalise, affine."""
    n = _count("rows", rows) * _count("row_len", row_len)
    if n == 0:
        return 0
    # mean, centre, square, variance (the moments of the whole row), then the scale
    return layernorm_moments_cycles(chip, rows, row_len, dtype) + _layernorm_scale_cycles(chip, rows, n, dtype)


def gelu_cycles(chip: Chip, n_elems: int, dtype: str) -> int:
    """GELU of n_elems elements on one tile. Half precision on a chip with a measured kernel ([vector.gelu_fp16]):
    fixed + cycles per block x ceil(n / block elements). Otherwise the tanh form from its vector ops,
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) = 5 multiplies, 2 adds, 1 tanh: an inference that on a C600 came
    out faster than the kernels measured there (2,208 elements: 7,408 cycles against 8,778 for the f16v4mix kernel
    the C600's table holds and 12,060 for the plain one)."""
    _count("n_elems", n_elems)
    if n_elems == 0:
        return 0
    if chip.gelu_fp16 is not None and _vector_dtype(dtype) == "fp16":
        fixed, per_block, block = chip.gelu_fp16
        return fixed + per_block * _cdiv(n_elems, block)
    return (
        5 * vector_cycles(chip, "mul", n_elems, dtype)
        + 2 * vector_cycles(chip, "add", n_elems, dtype)
        + vector_cycles(chip, "tanh", n_elems, dtype)
    )


# ---- memory, exchange, sync, host ---------------------------------------------------------------------------------


def copy_cycles(chip: Chip, nbytes: int) -> int:
    """On-tile copy of nbytes at the local load bandwidth: ceil(nbytes / local_load_bytes_per_cycle) (ref §1)."""
    return _cdiv(_count("nbytes", nbytes), chip.local_load_bytes_per_cycle)


def exchange_cycles(chip: Chip, max_bytes_sent_by_a_tile: int, max_bytes_received_by_a_tile: int) -> int:
    """One exchange phase: fixed cost + the busiest tile's bytes at the per-tile send / receive rate (ref §4).

    exchange_fixed_cycles + ceil(max(sent / send B/cycle, received / receive B/cycle)); an exchange that moves no
    bytes is not run and costs 0. poplibs' planner uses the streaming term alone; the fixed ~100 cycles are from
    its other planners (ref §4).
    """
    sent = _count("max_bytes_sent_by_a_tile", max_bytes_sent_by_a_tile)
    recv = _count("max_bytes_received_by_a_tile", max_bytes_received_by_a_tile)
    if sent == 0 and recv == 0:
        return 0
    stream = max(
        _cdiv(sent, chip.exchange_send_bytes_per_cycle_per_tile),
        _cdiv(recv, chip.exchange_recv_bytes_per_cycle_per_tile),
    )
    return chip.exchange_fixed_cycles + stream


def sync_cycles(chip: Chip) -> int:
    """One all-tile BSP sync barrier (ref §4: 118 cycles calibrated on Mk2)."""
    return chip.sync_cycles


def host_transfer_cycles(chip: Chip, nbytes: int) -> int:
    """Tile cycles to stream nbytes between host and chip at the host link bandwidth: ceil(nbytes x clock / B/s).

    host_bytes_per_second is one direction of the link (the chip files' source, ref §1), which is all one stream
    uses. The ceiling is taken exactly (as fractions of the two floats): in floats, a transfer of a whole number of
    cycles could round up by one, and host cycles are pinned by tests as bytes x clock / bandwidth.
    """
    _count("nbytes", nbytes)
    return math.ceil(Fraction(nbytes) * Fraction(chip.clock_hz) / Fraction(chip.host_bytes_per_second))


def cycles_to_seconds(chip: Chip, cycles: int | float) -> float:
    return cycles / chip.clock_hz

"""The AMP microbenchmark: modelled FP16 [N,16]x[16,16] matmul throughput on every tile vs the published measurement."""

from __future__ import annotations

from tremula.errors import TremulaError
from tremula.numerics.fp8 import FP8_DTYPES
from tremula.target.chip import Chip
from tremula.target.cost import amp_matmul_cycles

# Measured on a Bow IPU, every one of 1472 tiles running one FP16 [N,16]x[16,16] AMP vertex with FP16 accumulation, no
# exchange, cycle-counter overhead subtracted: N -> TFLOP/s. ipu-hardware.md §3 [M] (tessellate-ipu peak-FLOPS
# notebook). These are measurements to compare against, not model constants.
MEASURED_AMP_TFLOPS: dict[str, dict[int, float]] = {
    "bow": {16: 55.5, 128: 211.1, 2048: 334.9},
}
MEASURED_AMP_SOURCE = "ipu-hardware.md §3 [M]: tessellate-ipu IPU Peak Flops notebook (Bow, all 1472 tiles)"

K = N_OUT = 16  # the benchmark's fixed inner and output dimensions


def amp_point(chip: Chip, n: int) -> dict:
    """One N: the vertex's cycles (cost.amp_matmul_cycles), the chip-wide TFLOP/s and its share of the FP16 peak."""
    cycles = amp_matmul_cycles(chip, n, K, N_OUT, "fp16", "fp16")
    flops = 2.0 * n * K * N_OUT * chip.tiles
    tflops = flops * chip.clock_hz / cycles / 1e12 if cycles else 0.0
    return {"n": n, "cycles": cycles, "model_tflops": tflops,
            "model_pct_peak": 100.0 * tflops * 1e12 / chip.peak_flops("fp16")}


def amp_microbench(chip: Chip, ns: list[int]) -> list[dict]:
    """For each N: modelled cycles, TFLOP/s and % of the FP16 peak, and where ipu-hardware.md §3 has a measurement for
    this chip: measured TFLOP/s and % of peak and the model's error in % ((model - measured) / measured)."""
    measured = MEASURED_AMP_TFLOPS.get(chip.name, {})
    rows = []
    for n in ns:
        row = amp_point(chip, int(n))
        m = measured.get(int(n))
        row["measured_tflops"] = m
        row["measured_pct_peak"] = None if m is None else 100.0 * m * 1e12 / chip.peak_flops("fp16")
        row["error_pct"] = None if m is None else 100.0 * (row["model_tflops"] - m) / m
        row["source"] = MEASURED_AMP_SOURCE if m is not None else ""
        rows.append(row)
    return rows


# ---- one tile's matmul vertex ---------------------------------------------------------------------------------------

# Per-kernel cycles measured on a real C600 by a stack that writes its own GEMM kernels (not poplibs' vertices):
# (chip, dtype, R, K, C) -> (cycles, source). ../shared/reference/ipu-stack-facts.md §2.1; FP8 there accumulates in
# FP16 (the half partials path). The C600's chip file prices a Linear's weights with the interleaved-weight kernel's
# formula fitted there (AmpPair.weights_kernel); the packed-output variant's points are other kernels, beside it to
# show how far they are.
_FACTS = "ipu-stack-facts §2.1 [M]"
MEASURED_MATMUL_CYCLES: dict[tuple[str, str, int, int, int], tuple[int, str]] = {
    ("c600", "fp16", 184, 288, 48): (48_654, f"{_FACTS} interleaved-weight F16 GEMM (kernel/cost.rs 0729e12)"),
    ("c600", "fp16", 182, 288, 48): (48_180, f"{_FACTS} interleaved-weight F16 GEMM (kernel/cost.rs 0729e12)"),
    ("c600", "fp16", 184, 288, 32): (32_538, f"{_FACTS} interleaved-weight F16 GEMM (kernel/cost.rs 0729e12)"),
    ("c600", "fp16", 146, 576, 32): (53_718, f"{_FACTS} interleaved-weight F16 GEMM (kernel/cost.rs 0729e12)"),
    ("c600", "fp16", 120, 80, 272): (55_344, f"{_FACTS} interleaved-weight F16 GEMM (kernel/cost.rs 0729e12)"),
    ("c600", "fp16", 48, 240, 64): (33_102, f"{_FACTS} packed-output F16, interleaved (standard weights: 35,022)"),
    ("c600", "fp16", 96, 64, 64): (12_108, f"{_FACTS} packed-output F16"),
    ("c600", "fp16", 128, 64, 64): (19_944, f"{_FACTS} packed-output F16 (19,944-20,088)"),
    ("c600", "fp16", 81, 80, 80): (12_402, f"{_FACTS} SigLIP QK FP16 (GEMM_UTILIZATION 5f29bea)"),
    ("c600", "fp8", 244, 128, 64): (18_576, f"{_FACTS} SigLIP QKV projection FP8 (GEMM_UTILIZATION 5f29bea)"),
    ("c600", "fp8", 82, 192, 160): (29_508, f"{_FACTS} SigLIP MLP up FP8 (GEMM_UTILIZATION 5f29bea)"),
    ("c600", "fp8", 122, 160, 128): (26_232, f"{_FACTS} SigLIP MLP down FP8 (GEMM_UTILIZATION 5f29bea)"),
    ("c600", "fp8", 146, 96, 48): (7_122, f"{_FACTS} SigLIP attention output FP8 (GEMM_UTILIZATION 5f29bea)"),
    ("c600", "fp8", 57, 128, 80): (8_124, f"{_FACTS} SigLIP PV FP8 (GEMM_UTILIZATION 5f29bea)"),
}

# The accumulation each input type gets in a Program by default (compile_model's partials="half"; --partials float
# keeps float32 for fp16): fp16 on the half -> half path, FP8 on the C600's quarter -> half path, the only FP8 path it
# has.
PLANNER_PARTIALS = {"fp16": "half", "fp8": "half"}
_ACC = {"half": "float16", "float": "float32"}


def matmul_point(chip: Chip, rows: int, k: int, cols: int, dtype: str, partials: str | None = None) -> dict:
    """One tile's [rows,k] x [k,cols] matmul vertex of a Linear (w its stored weights): cycles from the codelet cycle
    function the planner prices it with (codelets/matmul.py, codelets/fp8.py), MACs, MACs/cycle, % of the dtype's
    AMP peak per tile, and a measured point beside it where ipu-stack-facts §2.1 has one for this chip and shape.

    `partials` other than the default accumulation for `dtype` (--partials float for fp16) is priced by
    cost.amp_matmul_cycles on the chip's AMP path for it, when the chip has one (path says so); a path the chip lacks
    raises TremulaError in one line.
    """
    from tremula.codelets import codelet

    if dtype not in PLANNER_PARTIALS:
        raise TremulaError(f"--dtype must be fp16 or fp8 (got {dtype!r})")
    for name, v in (("--rows", rows), ("--k", k), ("--cols", cols)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise TremulaError(f"{name} must be a positive integer (got {v!r})")
    partials = partials or PLANNER_PARTIALS[dtype]
    if partials not in _ACC:
        raise TremulaError(f"--partials must be half or float (got {partials!r})")
    try:
        chip.amp_pair(dtype, _ACC[partials])
    except TremulaError as e:  # not a path to invent: say which paths the chip has
        raise TremulaError(f"--partials {partials} is not a path the cost model has for {dtype}: {e}") from None
    shapes = [(rows, k), (k, cols), (rows, cols)]
    if partials != PLANNER_PARTIALS[dtype]:
        cycles = amp_matmul_cycles(chip, rows, k, cols, dtype, _ACC[partials], weights=True)
        path = f"cost.amp_matmul_cycles {dtype}->{_ACC[partials]} (not the planner's default)"
    elif dtype == "fp8":  # no bias; formats and scale do not change the cycles
        cycles = codelet("matmul_fp8").cycles(chip, (0, 0, 0, 0, 0), shapes, [FP8_DTYPES[0], FP8_DTYPES[0], "float16"])
        path = "matmul_fp8 codelet (planner)"
    else:  # no bias, half partials rounded after every group of input channels
        group = chip.amp_pair("fp16", "float16").weights_per_conv_unit
        cycles = codelet("matmul").cycles(chip, (0, group), shapes, ["float16", "float16", "float16"])
        path = "matmul codelet, half partials (planner)"
    macs = rows * k * cols
    peak_macs = chip.peak_flops(dtype) / (2.0 * chip.tiles * chip.clock_hz)  # per tile per cycle
    per_cycle = macs / cycles if cycles else 0.0
    m = MEASURED_MATMUL_CYCLES.get((chip.name, dtype, rows, k, cols))
    return {"rows": rows, "k": k, "cols": cols, "dtype": dtype, "partials": partials, "path": path,
            "cycles": int(cycles), "macs": macs, "macs_per_cycle": per_cycle, "peak_macs_per_cycle": peak_macs,
            "pct_amp_peak": 100.0 * per_cycle / peak_macs,
            "measured_cycles": None if m is None else m[0],
            "error_pct": None if m is None else 100.0 * (cycles - m[0]) / m[0],
            "source": "" if m is None else m[1]}

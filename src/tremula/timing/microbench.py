"""The AMP microbenchmark: modelled FP16 [N,16]x[16,16] matmul throughput on every tile vs the published measurement."""

from __future__ import annotations

from tremula.chip import Chip
from tremula.cost import amp_matmul_cycles

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

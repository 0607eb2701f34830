"""How far the headline figures move when a group of the cost model's constants is off by half or double.

Each variant is the C600 with one group of its constants scaled (a Chip made with dataclasses.replace, so the planner
plans for it and the Program is priced by it, as a chip file with those values would be), and every workload is
compiled again:

- vector: the element-wise and reduce vertices (poplibs' cycle estimators, ipu-hardware.md §3 [C]: supervisor and
  worker overheads and cycles per loop; at half, twice the elements per loop). The measured GeLU kernel and the AMP
  are left as they are. ipu-stack-facts.md §2.2 [M] timed other kernels of this kind on a C600 at 1.0-3.0x these
  estimates (adds 3.0x, a sum of partials 1.4-2.7x, a softmax 1.56x, a LayerNorm row 1.02x; its statistics 0.62x):
  `tremula calibrate` prints each.
- exchange: bytes per cycle a tile sends and receives (half: twice the time) and an exchange's fixed cycles.
- sync: the cycles of a sync.

Rates are samples/s with the host I/O, as `benchmarks/poprt_comparison.py` prints them; the last columns say which
done-when bars of issue #14 (PopRT's measured ViT-B and BERT-base rates, 300 img/s for SigLIP so400m fp8 b8) the
variant still clears.

    python benchmarks/sensitivity.py [--groups vector,exchange,sync]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import first_compile

first_compile.cache_off()

from tremula.compiler import compile_model
from tremula.target.chip import load_chip

# (model, dtype, batch, the bar it must clear: PopRT's measured rate, or issue #14's target)
WORKLOADS = (("vit-base-patch16-224", "fp16", 8, 2600.0), ("vit-base-patch16-224", "fp16", 32, 3109.0),
             ("bert-base-uncased", "fp16", 16, 4817.0), ("bert-base-uncased", "fp16", 128, 5672.0),
             ("siglip-so400m-patch14-384", "fp8", 8, 300.0))


def _half(x: int) -> int:
    return max(1, round(x / 2))


def scaled(chip, group: str, f: float):
    """`chip` with the constants of `group` scaled by f (0.5 or 2): the time they stand for halves or doubles."""
    up = f > 1
    if group == "vector":
        cyc = (lambda x: 2 * x) if up else _half
        ops = tuple(dataclasses.replace(op, fp16_cycles_per_loop=op.fp16_cycles_per_loop * (2 if up else 1),
                                        fp32_cycles_per_loop=op.fp32_cycles_per_loop * (2 if up else 1),
                                        fp16_elems_per_loop=op.fp16_elems_per_loop * (1 if up else 2),
                                        fp32_elems_per_loop=op.fp32_elems_per_loop * (1 if up else 2))
                    for op in chip.vector_ops)
        return dataclasses.replace(
            chip, vector_ops=ops, vector_supervisor_cycles=cyc(chip.vector_supervisor_cycles),
            vector_fp16_worker_cycles=cyc(chip.vector_fp16_worker_cycles),
            vector_fp32_worker_cycles=cyc(chip.vector_fp32_worker_cycles),
            reduce_supervisor_cycles=cyc(chip.reduce_supervisor_cycles),
            reduce_worker_cycles=cyc(chip.reduce_worker_cycles),
            reduce_per_output_cycles=cyc(chip.reduce_per_output_cycles),
            reduce_cycles_per_loop=chip.reduce_cycles_per_loop * (2 if up else 1),
            reduce_fp16_accumulator_elems=chip.reduce_fp16_accumulator_elems * (1 if up else 2),
            reduce_fp32_accumulator_elems=chip.reduce_fp32_accumulator_elems * (1 if up else 2))
    if group == "exchange":
        rate = (lambda x: _half(x)) if up else (lambda x: 2 * x)
        return dataclasses.replace(
            chip, exchange_send_bytes_per_cycle_per_tile=rate(chip.exchange_send_bytes_per_cycle_per_tile),
            exchange_recv_bytes_per_cycle_per_tile=rate(chip.exchange_recv_bytes_per_cycle_per_tile),
            exchange_fixed_cycles=2 * chip.exchange_fixed_cycles if up else _half(chip.exchange_fixed_cycles))
    if group == "sync":
        return dataclasses.replace(chip, sync_cycles=2 * chip.sync_cycles if up else _half(chip.sync_cycles))
    raise SystemExit(f"unknown group {group!r} (vector, exchange, sync)")


def rate(chip, model: str, dtype: str, batch: int) -> tuple[float, bool]:
    """(samples/s with the host I/O, fits) of the compile."""
    res = compile_model(model, chip, batch, dtype, require_fit=False)
    return batch * chip.clock_hz / res.throughput_cycles, res.fits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default="vector,exchange,sync")
    args = ap.parse_args()
    base = load_chip("c600")
    variants = [("as modelled", base)] + [(f"{g} x{f:g}", scaled(base, g, f)) for g in args.groups.split(",")
                                           for f in (0.5, 2.0)]
    names = [f"{m.split('-')[0]} {d} b{b}" for m, d, b, _ in WORKLOADS]
    print(f"{'C600 variant':18s}" + "".join(f"{n:>22s}" for n in names) + "   bars cleared")
    for label, chip in variants:
        t = time.perf_counter()
        cells, cleared = [], 0
        for model, dtype, batch, bar in WORKLOADS:
            r, fits = rate(chip, model, dtype, batch)
            cleared += fits and r >= bar
            cells.append(f"{r:,.1f}{'' if fits else ' (no fit)'}")
        print(f"{label:18s}" + "".join(f"{c:>22s}" for c in cells)
              + f"   {cleared} of {len(WORKLOADS)} ({time.perf_counter() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

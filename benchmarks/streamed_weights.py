"""Weights streamed from host memory on one chip (issue #15, plan/stream.py), beside the same model resident.

Each row compiles a model for one chip with a --weights mode and prints: how many repeated layers stream and the bytes
the host link carries for them on every forward, the device cycles, the host cycles (inputs, streamed weights,
outputs: in series with the device, as tremula sets no tiles aside for I/O), the share of the time the host link
takes, samples/s and MFU, and the compile's wall time and peak host memory (ru_maxrss of this process so far). The
C600's host bandwidth is inferred (chips/c600.toml: 16 PCIe Gen4 lanes), so the last two columns re-price the same
Program with half and double that bandwidth.

Usage: python benchmarks/streamed_weights.py [--runs MODEL:DTYPE:BATCH:WEIGHTS,...] [--chip c600]
"""

from __future__ import annotations

import argparse
import resource
import time

import first_compile

first_compile.cache_off()

from tremula.compiler import compile_model
from tremula.frontends import load_model
from tremula.model_info import describe
from tremula.pipeline import canonical
from tremula.target.chip import load_chip
from tremula.target.cost import host_transfer_cycles

DEFAULT_RUNS = ",".join([
    "siglip-so400m-patch14-384:fp8:8:resident",
    "siglip-so400m-patch14-384:fp16:1:auto",
    "siglip-so400m-patch14-384:fp16:4:auto",
    "siglip-so400m-patch14-384:fp16:8:auto",
    "siglip-so400m-patch14-384:fp16:8:streamed",
    "siglip-so400m-patch14-384:fp16:12:auto",
    "siglip-so400m-patch14-384:fp16:16:auto",
])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--chip", default="c600")
    args = ap.parse_args()
    chip = load_chip(args.chip)
    print(f"{'model':27} {'dtype':>5} {'batch':>5} {'weights':>8} {'streamed':>8} {'MB/fwd':>7} {'device cyc':>11} "
          f"{'host cyc':>11} {'host %':>6} {'samples/s':>9} {'MFU %':>5} {'fullest %':>9} {'compile s':>9} "
          f"{'RSS GB':>6} {'host /2':>8} {'host x2':>8}", flush=True)
    flops: dict[str, float] = {}  # model -> FLOPs per sample
    for run in args.runs.split(","):
        model, dtype, batch, weights = run.split(":")
        if model not in flops:
            flops[model] = describe(canonical(load_model(model, batch=1))).flops
        t0 = time.perf_counter()
        try:
            res = compile_model(model, chip, int(batch), dtype, weights=weights)
        except Exception as e:  # a row that does not fit says so and the table goes on
            print(f"{model:27} {dtype:>5} {batch:>5} {weights:>8}  {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        seconds = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        total = res.throughput_cycles
        rate = res.batch * chip.clock_hz / total
        streamed = sum(res.streamed_layers.values())
        rescaled = []
        for f in (0.5, 2.0):  # the same bytes over a host link f times as fast
            c = res.cycles + sum(host_transfer_cycles(chip, round(b / f)) for b in (res.host_in_bytes,
                                                                                   res.host_out_bytes))
            rescaled.append(res.batch * chip.clock_hz / c)
        print(f"{model:27} {dtype:>5} {res.batch:5d} {weights:>8} {streamed:8d} {res.streamed_bytes / 1e6:7.1f} "
              f"{res.cycles:11,d} {res.host_cycles:11,d} {100 * res.host_cycles / total:6.1f} {rate:9,.1f} "
              f"{100 * rate * flops[model] / chip.peak_flops(res.dtype):5.1f} "
              f"{100 * res.peak_tile_bytes / chip.sram_bytes_per_tile:9.1f} "
              f"{seconds:9.1f} {rss:6.1f} {rescaled[0]:8,.1f} {rescaled[1]:8,.1f}", flush=True)


if __name__ == "__main__":
    main()

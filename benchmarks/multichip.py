"""Models bigger than one chip: pipelines over several C600s (issue #15), beside SigLIP so400m fp8 on one C600.

Each row compiles a model for a system (multichip.compile_system: the fewest pipeline stages that fit, or --stages)
and prints the pipeline: stages x replicas, the fullest tile of each stage, the period (slowest stage + the links'
exchange + a sync), throughput in steady state, latency of one batch, MFU over every chip of the system, and the
compile's wall time and peak host memory (ru_maxrss of this process so far). The IPU-Link bandwidth between
neighbouring cards is inferred (src/tremula/systems/*.toml), so the last two columns re-price the same stages with
half and double that bandwidth.

Usage: python benchmarks/multichip.py [--runs MODEL:SYSTEM:DTYPE:BATCH[:STAGES],...]
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import time

import first_compile

first_compile.cache_off()

from tremula.multichip import compile_system
from tremula.target.system import load_system

DEFAULT_RUNS = ",".join([
    "siglip-so400m-patch14-384:1xc600:fp8:8",
    "siglip-so400m-patch14-384:2xc600:fp16:4:2",
    "siglip-so400m-patch14-384:4xc600:fp16:8:4",
    "vit-huge-patch14-224:2xc600:fp16:8:2",
    "gpt2-large:4xc600:fp16:8:4",
])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    args = ap.parse_args()
    print(f"{'model':27} {'system':8} {'dtype':>5} {'batch':>5} {'stages':>6} {'fullest tile % per stage':>26} "
          f"{'period cyc':>11} {'samples/s':>9} {'latency ms':>10} {'MFU %':>5} {'compile s':>9} {'RSS GB':>6} "
          f"{'link /2':>8} {'link x2':>8}", flush=True)
    for run in args.runs.split(","):
        model, system_name, dtype, batch, *stages = run.split(":")
        system = load_system(system_name)
        t0 = time.perf_counter()
        try:
            res = compile_system(model, system, int(batch), dtype, stages=int(stages[0]) if stages else None)
        except Exception as e:  # a row that does not fit says so and the table goes on
            print(f"{model:27} {system_name:8} {dtype:>5} {batch:>5}  {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        seconds = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        sram = system.chip.sram_bytes_per_tile
        fullest = "/".join(f"{100 * r.peak_tile_bytes / sram:.0f}" for r in res.stages)
        scaled = [res.on(dataclasses.replace(system, link_bytes_per_second=system.link_bytes_per_second * f))
                  for f in (0.5, 2.0)]
        print(f"{model:27} {system_name:8} {dtype:>5} {res.batch:5d} {len(res.stages):3d}x{res.replicas:<2d} "
              f"{fullest:>26} {res.period_cycles:11,d} {res.throughput:9,.1f} "
              f"{1e3 * res.latency_cycles / system.chip.clock_hz:10.2f} {100 * res.mfu:5.1f} {seconds:9.1f} "
              f"{rss:6.1f} {scaled[0].throughput:8,.1f} {scaled[1].throughput:8,.1f}", flush=True)


if __name__ == "__main__":
    main()

"""The seed workload: SigLIP so400m-patch14-384 on one C600, FP8 (and FP16 for contrast), at several batches, next to
what the vendor stack managed (ipu-hardware.md section 7: batch 1, ~100 img/s, ~10 min compiling; batch > 1 failed
with "insufficient tile memory"). Planner and cost model only (no simulation); prints each row as it finishes.

Usage: python benchmarks/siglip_fp8.py [--batches 1,8,16] [--dtypes fp8,fp16] [--model siglip-so400m-patch14-384]
"""

from __future__ import annotations

import argparse
import resource
import time

import first_compile

first_compile.cache_off()

from tremula.compiler import compile_model
from tremula.errors import NoFit
from tremula.frontends import load_model
from tremula.model_info import describe
from tremula.target.chip import load_chip

VENDOR = "PopRT (measured)   1   fp8   ~100 img/s; batch > 1 failed after ~10 min: insufficient tile memory"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="siglip-so400m-patch14-384")
    ap.add_argument("--chip", default="c600")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--dtypes", default="fp8,fp16")
    args = ap.parse_args()
    chip = load_chip(args.chip)
    flops = describe(load_model(args.model, batch=1)).flops  # per image
    print(f"{args.model} on {chip.name}: {flops / 1e9:.1f} GFLOP per image")
    print(f"{'':18} {'batch':>5} {'dtype':>5} {'img/s':>8} {'MFU':>6} {'cycles/fwd':>12} {'fullest tile':>13} "
          f"{'compile s':>9} {'max RSS GB':>10}")
    print(VENDOR, flush=True)
    for dtype in args.dtypes.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            t0 = time.perf_counter()
            try:
                r = compile_model(args.model, chip, b, dtype)
            except NoFit as e:
                note = f"does not fit: tile {e.tile} needs {e.peak:,} of {e.sram:,} B"
                print(f"{'tremula (model)':18} {b:5d} {dtype:>5} {note}", flush=True)
                continue
            secs = r.throughput_cycles / chip.clock_hz  # the forward plus host I/O, as `compile` reports
            thr = r.batch / secs
            mfu = thr * flops / chip.peak_flops(r.dtype)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            print(f"{'tremula (model)':18} {b:5d} {dtype:>5} {thr:8.1f} {100 * mfu:5.1f}% {r.cycles:12,d} "
                  f"{100 * r.peak_tile_bytes / chip.sram_bytes_per_tile:12.1f}% {time.perf_counter() - t0:9.1f} "
                  f"{rss:10.1f}", flush=True)


if __name__ == "__main__":
    main()

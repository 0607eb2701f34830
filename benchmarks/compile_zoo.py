"""Compile the zoo models on c600 and mk2 with --batch auto and print: planned batch, estimated cycles per forward,
throughput and compile time. Planner only (no simulation). Usage: python benchmarks/compile_zoo.py [--dtype fp16]
[--chips c600,mk2] [--models a,b] [--max-batch 64]"""

from __future__ import annotations

import argparse
import time

import first_compile

first_compile.cache_off()

from tremula.compiler import DoesNotFit, compile_model
from tremula.errors import NoFit
from tremula.frontends.zoo import ZOO
from tremula.target.chip import load_chip

DEFAULT_MODELS = ["vit-base-patch16-224", "bert-base-uncased", "all-minilm-l6-v2", "siglip-so400m-patch14-384",
                  "vit-tiny", "bert-tiny", "gpt2-tiny", "siglip-tiny", "clip-tiny", "minilm-tiny"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--chips", default="c600,mk2")
    ap.add_argument("--models", default=",".join(m for m in DEFAULT_MODELS if m in ZOO))
    ap.add_argument("--max-batch", type=int, default=64, help="upper end of the batch search")
    args = ap.parse_args()
    print(f"{'model':28} {'chip':6} {'dtype':5} {'batch':>5} {'cycles/fwd':>12} {'samples/s':>10} "
          f"{'peak tile B':>12} {'compile s':>9}")
    for chip_name in args.chips.split(","):
        chip = load_chip(chip_name)
        for model in args.models.split(","):
            t0 = time.perf_counter()
            try:
                from tremula.batch_search import find_max_batch
                from tremula.frontends import load_model

                b = find_max_batch(lambda n, m=model: load_model(m, batch=n), chip, args.dtype, limit=args.max_batch)
                if b == 0:
                    raise DoesNotFit(-1, -1, {}, 0, chip.sram_bytes_per_tile, 1, 0)
                res = compile_model(model, chip, b, args.dtype)
                dt = time.perf_counter() - t0
                thr = res.batch * chip.clock_hz / res.throughput_cycles  # host I/O charged, as `compile` does
                print(f"{model:28} {chip_name:6} {args.dtype:5} {res.batch:5d} {res.cycles:12,d} {thr:10.1f} "
                      f"{res.peak_tile_bytes:12,d} {dt:9.1f}", flush=True)
            except NoFit:
                dt = time.perf_counter() - t0
                print(f"{model:28} {chip_name:6} {args.dtype:5} {'-':>5} {'does not fit at batch 1':>36} "
                      f"{'':12} {dt:9.1f}", flush=True)


if __name__ == "__main__":
    main()

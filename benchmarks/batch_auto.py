"""How long `--batch auto` takes (issue #14: SigLIP so400m fp8 in <= 60 s, BERT-base fp16 b128 in <= 30 s on two
cores) and what it answers. Each model is compiled in a process of its own, so its peak host memory is its own;
"(beside)" is the peak of the process it forks (the FP8 calibration runs beside the search there; both are alive
at once, so the two together bound the host memory). Prints one row per model as it finishes.

Usage: python benchmarks/batch_auto.py [--models siglip-so400m-patch14-384:fp8,bert-base-uncased:fp16] [--chip c600]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time

import first_compile

first_compile.cache_off()


def _one(spec: str, chip: str, out) -> None:
    from tremula.compiler import compile_model

    model, dtype = spec.split(":")
    t0 = time.perf_counter()
    r = compile_model(model, chip, "auto", dtype)
    rates = r.auto["rates"]
    out.put((time.perf_counter() - t0, r.batch, r.auto["largest"], rates[r.batch], len(rates),
             resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
             resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="siglip-so400m-patch14-384:fp8,bert-base-uncased:fp16")
    ap.add_argument("--chip", default="c600")
    args = ap.parse_args()
    print(f"{'model':28} {'dtype':>5} {'seconds':>8} {'batch':>6} {'largest':>8} {'samples/s':>10} "
          f"{'fits planned':>12} {'max RSS GB':>10} {'(beside)':>8}", flush=True)
    ctx = mp.get_context("spawn")  # a fresh interpreter per model: its own import time and peak memory
    for spec in args.models.split(","):
        q = ctx.Queue()
        p = ctx.Process(target=_one, args=(spec, args.chip, q))
        p.start()
        secs, batch, largest, rate, planned, rss, beside = q.get()
        p.join()
        model, dtype = spec.split(":")
        print(f"{model:28} {dtype:>5} {secs:8.1f} {batch:6d} {largest:8d} {rate:10,.1f} {planned:12d} {rss:10.2f} "
              f"{beside:8.2f}", flush=True)


if __name__ == "__main__":
    main()

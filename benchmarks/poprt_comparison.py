"""Modelled throughput, MFU and compile time next to PopRT's measured results on a C600 (ipu-hardware.md §7).

Usage: python benchmarks/poprt_comparison.py [--chip c600] [--only vit|bert]

Prints a plain-text table. The measured numbers are PopRT's published benchmark results as recorded in
../shared/reference/ipu-hardware.md §7 (graphcore/PopRT benchmarks/ViT/README.md and benchmarks/bert/README.md).
A configuration whose plan does not fit is printed as such, with the largest batch that does fit (and, unless
--no-largest, tremula's modelled throughput at that batch) instead of a number.
The measured MFU uses the same graph FLOP count as the modelled one, so the two are comparable.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import first_compile

first_compile.cache_off()

from tremula.compiler import compile_model
from tremula.errors import NoFit
from tremula.frontends import load_model
from tremula.model_info import describe
from tremula.pipeline import canonical
from tremula.report.profile import build_profile
from tremula.target.chip import load_chip


@dataclass(frozen=True)
class Measured:
    """One row of ipu-hardware.md §7: PopRT on a C600, FP16."""

    key: str
    model: str  # tremula zoo name
    seq_len: int | None
    batch: int
    throughput: float  # samples/s, measured
    compile_s: float  # measured compile time
    source: str


MEASURED = (
    Measured("vit", "vit-base-patch16-224", None, 8, 2600.0, 53.0, "PopRT benchmarks/ViT/README.md (ref §7)"),
    Measured("vit", "vit-base-patch16-224", None, 32, 3109.0, 89.0, "PopRT benchmarks/ViT/README.md (ref §7)"),
    Measured("bert", "bert-base-uncased", 128, 16, 4817.0, 27.6, "PopRT benchmarks/bert/README.md (ref §7)"),
    Measured("bert", "bert-base-uncased", 128, 128, 5672.0, 85.8, "PopRT benchmarks/bert/README.md (ref §7)"),
)
DTYPE = "fp16"


def _flops_per_sample(m: Measured) -> int:
    """FLOPs of one sample's forward pass on the canonical graph (the count the profiles use)."""
    g = canonical(load_model(m.model, batch=1, seq_len=m.seq_len))
    return describe(g).flops


def _modelled(m: Measured, chip, batch: int, cache: dict) -> tuple[str, str, str, str]:
    """(throughput, MFU, compile s, latency) of the model at `batch` as tremula models it; raises NoFit."""
    key = (m.model, m.seq_len, batch)
    if key not in cache:
        res = compile_model(m.model, chip, batch=batch, dtype=DTYPE, seq_len=m.seq_len)
        s = build_profile(res, chip, model=m.model, keep_tile_cycles=False).summary
        cache[key] = (f"{s.throughput:,.0f}", f"{100 * s.mfu:.1f}%", f"{res.seconds:.1f}",
                      f"{s.latency_s * 1e3:.2f} ms/batch")
    return cache[key]


def _row(m: Measured, chip, at_largest: bool, cache: dict) -> list[str]:
    name = m.model + (f" seq {m.seq_len}" if m.seq_len else "")
    measured_mfu = m.throughput * _flops_per_sample(m) / chip.peak_flops(DTYPE)
    head = [name, str(m.batch), f"{m.throughput:,.0f}", f"{100 * measured_mfu:.1f}%", f"{m.compile_s:.1f}"]
    t0 = time.perf_counter()
    try:  # by name, so that a plan that does not fit can report the largest batch that does
        thr, mfu, secs, lat = _modelled(m, chip, m.batch, cache)
    except NoFit as e:
        secs = f"{time.perf_counter() - t0:.1f}*"
        note = f"largest batch that fits: {e.max_batch}"
        if at_largest and e.max_batch:
            t, f, _, _ = _modelled(m, chip, e.max_batch, cache)
            note += f" -> {t}/s, MFU {f}"
        return head + ["does not fit", "-", secs, "-", f"{note}; tile {e.tile} needs {e.peak:,} of {e.sram:,} B"]
    ratio = float(thr.replace(",", "")) / m.throughput
    return head + [thr, mfu, secs, f"{ratio:.2f}", lat]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chip", default="c600")
    ap.add_argument("--only", choices=("vit", "bert"), default=None)
    ap.add_argument("--no-largest", action="store_true", help="do not model the largest batch that fits")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="skip PopRT configurations above this batch (planning batch 32+ needs over 13 GB today)")
    args = ap.parse_args(argv)
    chip = load_chip(args.chip)
    head = ["model", "batch", "PopRT /s", "PopRT MFU", "PopRT compile s", "tremula /s", "tremula MFU",
            "tremula compile s", "model/measured", "note"]
    rows: list[list[str]] = []
    cache: dict = {}
    for m in MEASURED:
        if (args.only and m.key != args.only) or (args.max_batch and m.batch > args.max_batch):
            continue
        rows.append(_row(m, chip, not args.no_largest, cache))
        print("  done: " + " | ".join(rows[-1]), file=sys.stderr, flush=True)  # partial results survive a crash
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    print(f"PopRT measured (ipu-hardware.md §7, C600, {DTYPE}) vs tremula modelled on chip {chip.name} "
          f"(peak {chip.peak_flops(DTYPE) / 1e12:.1f} TFLOP/s)")
    for r in [head] + rows:
        print("  ".join(c.ljust(w) if i in (0, 9) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    print("MFU = FLOPs per sample (canonical graph) x samples/s / chip peak. * = time to find that the plan does not "
          "fit, including the search for the largest batch that does.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

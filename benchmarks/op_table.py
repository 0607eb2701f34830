"""Where a plan's cycles go, op by op, against the ideal: each op of a layer summed over the identical layers, beside
the cycles its FLOPs take at the chip's peak for the program's dtype (ideal = FLOPs / peak; "x ideal" = modelled /
ideal). The modelled cycles are the compile's own (target/step_cost.py through report/profile.py), so the table is
what `tremula compile --report` attributes, grouped by the op's place in its layer (repeated layers found by structure,
ir/layers.py) instead of by node. As in the profile, a step's exchange is charged to the op whose compute set opens
the step: the operand gather of a matmul that follows a Gelu shows as the Gelu's exchange. The peak is the program
dtype's for every op (fp8: the FP8 peak, also for attention, which runs in half: twice its half-peak ideal).

Usage: python benchmarks/op_table.py MODEL [--chip c600] [--dtype fp16] [--batch 8] [--top 20]
"""

from __future__ import annotations

import argparse

from tremula.compiler import compile_model
from tremula.ir.layers import layer_roles
from tremula.report.profile import build_profile
from tremula.target.chip import load_chip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--chip", default="c600")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--top", type=int, default=20, help="rows to print (the costliest), the rest summed in one")
    args = ap.parse_args()
    chip = load_chip(args.chip)
    res = compile_model(args.model, chip, args.batch, args.dtype)
    prof = build_profile(res, chip, keep_tile_cycles=False)
    role = layer_roles(res.graph)
    rows: dict[str, dict] = {}
    for o in prof.ops:
        r = rows.setdefault(role.get(o.node, o.node), {"op": o.op, "n": 0, "compute": 0, "exchange": 0, "sync": 0,
                                                         "ideal": 0.0})
        r["n"] += 1
        r["compute"] += o.compute
        r["exchange"] += o.exchange
        r["sync"] += o.sync
        r["ideal"] += o.utilisation * o.cycles  # FLOPs at the peak, in cycles
    total = sum(r["compute"] + r["exchange"] + r["sync"] for r in rows.values())
    ideal = sum(r["ideal"] for r in rows.values())
    s = prof.summary
    print(f"{args.model} on {args.chip}, batch {s.batch}, {s.dtype}: {s.cycles:,} cycles per forward (compute "
          f"{s.compute_cycles:,}, exchange {s.exchange_cycles:,}, sync {s.sync_cycles:,}), {s.throughput:,.1f} "
          f"samples/s with host I/O, MFU {100 * s.mfu:.1f} %; the ops' FLOPs at the peak take {ideal:,.0f} cycles")
    print(f"{'op (first layer of its run)':58} {'op':12} {'n':>3} {'cycles':>11} {'%':>5} {'compute':>11} "
          f"{'exchange':>10} {'sync':>8} {'ideal':>11} {'x ideal':>7}")
    order = sorted(rows.items(), key=lambda kv: -(kv[1]["compute"] + kv[1]["exchange"] + kv[1]["sync"]))
    shown, rest = order[: args.top], order[args.top:]
    if rest:
        agg = {"op": "", "n": sum(r["n"] for _, r in rest), **{k: sum(r[k] for _, r in rest)
                                                               for k in ("compute", "exchange", "sync", "ideal")}}
        shown.append((f"({len(rest)} more)", agg))
    for name, r in shown:
        cyc = r["compute"] + r["exchange"] + r["sync"]
        ratio = f"{cyc / r['ideal']:7.1f}" if r["ideal"] > 0 else f"{'-':>7}"
        print(f"{name[:58]:58} {r['op'][:12]:12} {r['n']:>3} {cyc:>11,} {100 * cyc / total:5.1f} {r['compute']:>11,} "
              f"{r['exchange']:>10,} {r['sync']:>8,} {r['ideal']:>11,.0f} {ratio}")


if __name__ == "__main__":
    main()

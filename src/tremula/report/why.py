"""Bottleneck analysis in words: for the costliest ops, what bounds them (compute, exchange, sync, imbalance, ...).

Thresholds below are reporting choices (when to call a share "dominant"), not hardware constants; every number quoted
in a sentence comes from the Profile, i.e. from the cost model applied to the Program.
"""

from __future__ import annotations

from dataclasses import dataclass

# A phase "dominates" an op when it takes at least this share of the op's cycles.
DOMINANT_SHARE = 0.5
SYNC_SHARE = 0.4
# max/mean compute cycles over the tiles used above which the op is called imbalanced.
IMBALANCE = 1.5
# Below this share of the chip's tiles an op is said to use few tiles.
LOW_TILE_SHARE = 0.25
# Modelled AMP efficiency (ideal MAC cycles / modelled cycles on the busiest tile) below which vertex overhead wins.
LOW_AMP_EFFICIENCY = 0.5
TOP_OPS = 5


@dataclass(frozen=True)
class Finding:
    node: str
    kind: str  # compute | vector | exchange | sync | imbalance | vertex_overhead | low_tile_usage
    sentence: str


def _pct(x: float) -> str:
    return f"{100.0 * x:.0f}%"


def classify(op, steps, chip, tiles: int) -> Finding:
    """What bounds one op (an OpRow), from its steps (StepRows) and the chip."""
    cyc = op.cycles
    own = [steps[i] for i in op.steps]
    head = f"{op.node} ({op.op}, {cyc:,} cycles)"
    if cyc == 0:
        return Finding(op.node, "compute", f"{head}: costs nothing.")
    if op.sync / cyc >= SYNC_SHARE and len(own) > 1:
        return Finding(op.node, "sync", f"{head} is sync-bound: {len(own)} steps x {chip.sync_cycles} cycles of "
                       f"barrier = {op.sync:,} cycles ({_pct(op.sync / cyc)}); fewer, larger steps would help.")
    if op.exchange / cyc >= DOMINANT_SHARE:
        s = max(own, key=lambda r: r.exchange)
        fixed = chip.exchange_fixed_cycles
        # A scheduled step reports its timetable against the timetable's own bound; otherwise the cost model's bound.
        cost = (f"its timetable takes {s.exchange:,} cycles against a lower bound of {s.exchange_lower_bound:,} "
                f"({s.exchange_ratio:.2f}x)" if s.exchange_makespan is not None else
                f"{max(s.exchange - fixed, 0):,} cycles of streaming + {fixed} fixed")
        return Finding(op.node, "exchange", f"{head} is exchange-bound: {op.exchange:,} cycles "
                       f"({_pct(op.exchange / cyc)}) in {sum(1 for r in own if r.exchange)} exchanges move "
                       f"{op.exchange_bytes:,} bytes; in the largest "
                       f"(step {s.index}) the busiest tile sends {s.max_tile_sent:,} and receives "
                       f"{s.max_tile_received:,} bytes at {chip.exchange_send_bytes_per_cycle_per_tile}/"
                       f"{chip.exchange_recv_bytes_per_cycle_per_tile} B/cycle: {cost}.")
    c = max(own, key=lambda r: r.compute)
    share = f"compute {op.compute:,} cycles ({_pct(op.compute / cyc)})"
    if c.balance >= IMBALANCE and c.tiles_used > 1:
        return Finding(op.node, "imbalance", f"{head} is imbalanced: {share}; in step {c.index} the busiest tile "
                       f"{c.busiest_tile} runs {c.compute:,} cycles against a mean of {c.mean_tile_cycles:,.0f} over "
                       f"{c.tiles_used} tiles (max/mean {c.balance:.2f}).")
    vec = c.compute - c.amp_cycles  # busiest tile's cycles outside AMP products (vector work, overheads)
    eff = c.amp_ideal_cycles / c.amp_cycles if c.amp_cycles else 0.0
    amp_words = (f"its AMP products take {c.amp_cycles:,} of the busiest tile's {c.compute:,} cycles at a modelled "
                 f"AMP efficiency of {_pct(eff)} ({c.amp_ideal_cycles:,.0f} ideal MAC cycles)")
    if c.amp_cycles and vec / c.compute >= DOMINANT_SHARE:
        return Finding(op.node, "vector", f"{head} is bound by vector work: {share}; {_pct(vec / c.compute)} of the "
                       f"busiest tile's {c.compute:,} cycles are vector work (softmax, scaling, bias) and "
                       f"{amp_words}.")
    if c.amp_cycles and eff < LOW_AMP_EFFICIENCY:
        return Finding(op.node, "vertex_overhead", f"{head} is bound by vertex overhead: {share}; {amp_words}: "
                       f"blocks are small, so per-vertex fixed cycles dominate.")
    if c.tiles_used < LOW_TILE_SHARE * tiles:
        return Finding(op.node, "low_tile_usage", f"{head} uses few tiles: {share} on {c.tiles_used} of {tiles} tiles "
                       f"({_pct(c.tiles_used / tiles)}) in step {c.index}.")
    if c.amp_cycles:
        return Finding(op.node, "compute", f"{head} is bound by AMP compute: {share} on {c.tiles_used} "
                       f"tiles; {amp_words}; utilisation {_pct(op.utilisation)} of chip peak.")
    return Finding(op.node, "vector", f"{head} is vector-compute-bound: {share} on {c.tiles_used} tiles "
                   f"(busiest tile {c.compute:,} cycles, max/mean {c.balance:.2f}).")


def _signature(op, kind: str) -> tuple:
    # Repeated layers: same op, same compute, FLOPs and bound (their exchanges may differ a little with placement).
    return (op.op, op.compute, op.flops, op.tiles_used, kind)


def findings(profile, chip, top: int = TOP_OPS) -> list[Finding]:
    """Findings for the `top` costliest ops, counting ops with the same cost and bound (repeated layers) once."""
    out: list[Finding] = []
    seen: dict[tuple, int] = {}
    for o in profile.ops:
        if o.cycles == 0:
            break
        f = classify(o, profile.steps, chip, profile.summary.tiles)
        sig = _signature(o, f.kind)
        if sig in seen:
            seen[sig] += 1
        elif len(out) < top:  # past `top`, still count repeats of the ones already listed
            seen[sig] = 1
            out.append(f)
    counts = list(seen.values())
    return [Finding(f.node, f.kind, f.sentence if n == 1 else f"{f.sentence} (Same in {n - 1} more like it.)")
            for f, n in zip(out, counts)]


def explain(profile, chip, top: int = TOP_OPS) -> list[str]:
    """A headline sentence for the whole program, then one sentence per costly op."""
    s = profile.summary
    if s.cycles == 0:
        return ["The program has no steps."]
    host_cycles = s.host_in_cycles + s.host_out_cycles  # MFU charges them too (latency is in + device + out)
    host = f", plus {host_cycles:,} of host I/O" if host_cycles else ""
    head = (f"{s.cycles:,} cycles per batch of {s.batch}: compute {_pct(s.compute_cycles / s.cycles)}, exchange "
            f"{_pct(s.exchange_cycles / s.cycles)}, sync {_pct(s.sync_cycles / s.cycles)} over {s.steps} steps"
            f"{host}; MFU {100 * s.mfu:.2f}% of {s.peak_flops / 1e12:.1f} TFLOP/s.")
    lines = [head]
    if host_cycles > s.cycles:  # e.g. weights streamed from host memory (plan/stream.py) at a small batch
        lines.append(f"The host link takes {_pct(host_cycles / (host_cycles + s.cycles))} of the time: the run is "
                     "bound by it, not by the chip.")
    return lines + [f.sentence for f in findings(profile, chip, top)]

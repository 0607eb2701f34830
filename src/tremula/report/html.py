"""One self-contained HTML report of a Profile: inline CSS, plots as base64 PNGs (matplotlib Agg), no scripts/URLs."""

from __future__ import annotations

import base64
import html as _html
import io
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tremula.report.profile import CATEGORIES
from tremula.timing.program_schedule import timetable_line

COLORS = {"weights": "#4c72b0", "activations": "#dd8452", "buffers": "#55a868", "code": "#c44e52",
          "vertex_state": "#8172b3", "exchange_code": "#937860", "compute": "#4c72b0", "sync": "#c44e52",
          "exchange": "#55a868"}
TOP_OPS_PLOTTED = 20
DPI = 96
# Draw the SRAM limit only when the plotted peak reaches this share of it (otherwise the data is a sliver).
SRAM_LINE_MIN_SHARE = 0.25

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1200px;color:#222;
 padding:0 1em;line-height:1.4}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.25em;border-bottom:1px solid #ddd;padding-bottom:.2em;
 margin-top:1.8em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}th,td{padding:.2em .6em;border-bottom:1px solid #eee;
 text-align:right;white-space:nowrap}th{background:#f4f4f4;position:sticky;top:0}td.l,th.l{text-align:left}
table.kv td{white-space:normal}table.kv td:first-child{text-align:left;color:#555;white-space:nowrap}
details{margin:.1em 0}summary{cursor:pointer}.bad{color:#b00;font-weight:bold}.ok{color:#070;font-weight:bold}
img.plot{max-width:100%;height:auto;display:block;margin:.5em 0;border:1px solid #eee}
.scroll{max-height:30em;overflow:auto;border:1px solid #eee}ul.why li{margin:.3em 0}
.muted{color:#777;font-size:.85em}
"""


def _e(x) -> str:
    return _html.escape(str(x))


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n}"


def _si(n: float, unit: str = "") -> str:
    for div, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:,.2f} {p}{unit}"
    return f"{n:,.2f} {unit}".rstrip()


def _png(fig: Figure) -> str:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _img(b64: str, alt: str) -> str:
    return f'<img class="plot" alt="{_e(alt)}" src="data:image/png;base64,{b64}">'


# ------------------------------------------------------------------------------------------------ plots


def _sram_line(ax, sram: int, peak: float) -> None:
    """The SRAM limit as a line when it is on the plot's scale; else a note, so small programs stay readable."""
    if peak >= SRAM_LINE_MIN_SHARE * sram:
        ax.axhline(sram / 1024, color="k", ls="--", lw=1, label="SRAM per tile")
    else:
        ax.text(0.01, 0.97, f"SRAM per tile: {sram / 1024:,.0f} KiB (peak uses {100 * peak / sram:.1f}%)",
                transform=ax.transAxes, va="top", fontsize=8)


def plot_tile_memory(profile) -> str:
    mem = profile.tile_memory
    x = np.arange(profile.summary.tiles)
    fig = Figure(figsize=(11, 3.6))
    ax = fig.add_subplot()
    ys = [np.asarray(mem[c], np.float64) / 1024 for c in CATEGORIES]
    ax.stackplot(x, ys, labels=list(CATEGORIES), colors=[COLORS[c] for c in CATEGORIES], step="mid",
                 linewidth=0)
    _sram_line(ax, profile.summary.sram_bytes_per_tile, float(np.sum(ys, axis=0).max()) * 1024)
    ax.set_xlim(0, max(1, len(x) - 1))
    ax.set_xlabel("tile")
    ax.set_ylabel("KiB")
    ax.set_title("Memory per tile by category (live data at each tile's peak + reserved)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, ncol=7, frameon=False)
    return _png(fig)


def plot_cycles_by_op(profile) -> str:
    ops = profile.ops[:TOP_OPS_PLOTTED][::-1]
    fig = Figure(figsize=(11, 0.28 * len(ops) + 1.2))
    ax = fig.add_subplot()
    y = np.arange(len(ops))
    left = np.zeros(len(ops))
    for phase in ("compute", "sync", "exchange"):
        v = np.array([getattr(o, phase) for o in ops], np.float64)
        ax.barh(y, v, left=left, color=COLORS[phase], label=phase)
        left += v
    ax.set_yticks(y, [f"{o.node} ({o.op})" for o in ops], fontsize=7)
    ax.set_xlabel("cycles")
    ax.set_title(f"Cycles by op (costliest {len(ops)})")
    ax.legend(loc="lower right", fontsize=8)
    return _png(fig)


def plot_liveness(profile) -> str:
    st = profile.steps
    x = np.arange(len(st))
    fig = Figure(figsize=(11, 3.2))
    ax = fig.add_subplot()
    ax.plot(x, [r.live_peak_tile_bytes / 1024 for r in st], color=COLORS["activations"], marker=".",
            label="fullest tile (data + reserved)")
    _sram_line(ax, profile.summary.sram_bytes_per_tile, max((r.live_peak_tile_bytes for r in st), default=0))
    ax.set_xlabel("step")
    ax.set_ylabel("KiB on the fullest tile")
    ax2 = ax.twinx()
    ax2.plot(x, [r.live_total_bytes / 2**20 for r in st], color=COLORS["weights"], lw=1, label="all tiles (data)")
    ax2.set_ylabel("MiB over all tiles")
    ax.set_title("Live bytes per step")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, ncol=3, frameon=False)
    return _png(fig)


def plot_bsp(profile, tile_groups: int = 16) -> str:
    """Steps as compute / sync / exchange bars over time, and the busiest tile of each tile group per step."""
    from tremula.report.trace import tile_group_bounds

    s = profile.summary
    bounds = tile_group_bounds(s.tiles, tile_groups)
    fig = Figure(figsize=(11, 1.2 + 0.22 * (len(bounds) + 3)))
    ax = fig.add_subplot()
    rows = {"compute": [], "sync": [], "exchange": []}
    groups = [[] for _ in bounds]
    for r in profile.steps:
        rows["compute"].append((r.start, r.compute))
        rows["sync"].append((r.start + r.compute, r.sync))
        rows["exchange"].append((r.start + r.compute + r.sync, r.exchange))
        if profile.tile_compute is not None and r.compute:
            cyc = np.asarray(profile.tile_compute[r.index])
            for gi, (lo, hi) in enumerate(bounds):
                busy = int(cyc[lo:hi].max())
                if busy:
                    groups[gi].append((r.start, busy))
    labels = []
    for i, phase in enumerate(("compute", "sync", "exchange")):
        # Edges in the bar's own colour keep short phases (a 118-cycle sync in a long program) visible.
        ax.broken_barh([b for b in rows[phase] if b[1]], (i - 0.4, 0.8), facecolors=COLORS[phase],
                       edgecolor=COLORS[phase], linewidth=0.4)
        labels.append(phase)
    for gi, (lo, hi) in enumerate(bounds):
        ax.broken_barh(groups[gi], (3 + gi - 0.4, 0.8), facecolors="#7a9cc6", edgecolor="white", linewidth=0.3)
        labels.append(f"tiles {lo}-{hi - 1}")
    ax.set_yticks(np.arange(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(1, s.cycles))
    ax.set_xlabel("cycle")
    ax.set_title("BSP trace: every step is compute (busiest tile), then sync, then exchange")
    return _png(fig)


# ------------------------------------------------------------------------------------------------ tables


def _summary_table(profile) -> str:
    s = profile.summary
    fit = '<span class="ok">yes</span>' if s.fits else '<span class="bad">NO</span>'
    rows = [
        ("chip", f"{s.chip} ({s.tiles} tiles x {_bytes(s.sram_bytes_per_tile)}, {s.clock_hz / 1e9:.3g} GHz)"),
        ("model", s.model), ("batch", s.batch), ("dtype", s.dtype), ("fits", fit),
        ("latency per batch", f"{s.latency_s * 1e3:,.4f} ms (host in {s.host_in_cycles:,} + device {s.cycles:,} + "
                              f"host out {s.host_out_cycles:,} cycles)"),
        ("host I/O", f"{s.host_in_cycles + s.host_out_cycles:,} cycles (in {s.host_in_cycles:,}, out "
                     f"{s.host_out_cycles:,}), not overlapped with device work"),
        ("throughput", f"{s.throughput:,.1f} samples/s (batch / latency: host I/O in series)"),
        ("model FLOPs per batch", _si(s.model_flops, "FLOP")),
        ("MFU", f"{100 * s.mfu:.3f}% of {_si(s.peak_flops, 'FLOP/s')}"),
        ("cycles: compute / exchange / sync",
         f"{s.compute_cycles:,} / {s.exchange_cycles:,} / {s.sync_cycles:,} over {s.steps} steps (exchange: "
         + ("scheduled timetables" if s.timetables else "cost model bound") + ")"),
        ("fullest tile", f"tile {s.fullest_tile}: {_bytes(s.peak_tile_bytes)} of {_bytes(s.sram_bytes_per_tile)} ("
                         + ", ".join(f"{k} {_bytes(v)}" for k, v in s.fullest_tile_bytes.items() if v) + ")"),
        ("compile time", f"{s.compile_seconds:.2f} s"),
    ]
    if s.timetables:
        rows[-1:-1] = [("exchange timetables", timetable_line(s.timetables)),
                       ("cycles with scheduled exchanges",
                        f"{s.cycles:,} (vs {s.priced_cycles:,} with the cost model's bounds)")]
    return '<table class="kv">' + "".join(f"<tr><td>{_e(k)}</td><td class=l>{v if k == 'fits' else _e(v)}</td></tr>"
                                         for k, v in rows) + "</table>"


def _op_cells(o) -> str:
    return (f"<td>{o.cycles:,}</td><td>{o.pct:.1f}%</td><td>{o.compute:,}</td><td>{o.sync:,}</td>"
            f"<td>{o.exchange:,}</td><td>{_si(o.flops)}</td><td>{100 * o.utilisation:.3f}%</td>")


def _ops_table(profile) -> str:
    head = ("<tr><th class=l>op / node</th><th>cycles</th><th>% total</th><th>compute</th><th>sync</th>"
            "<th>exchange</th><th>FLOPs</th><th>utilisation</th><th>tiles</th><th>exchange bytes</th>"
            "<th>weights</th><th>activations</th><th>steps</th></tr>")
    parts = []
    for t in profile.op_types:
        parts.append(f"<details><summary><b>{_e(t.op)}</b> x{t.count}: {t.cycles:,} cycles ({t.pct:.1f}%), "
                     f"{_si(t.flops, 'FLOP')}, utilisation {100 * t.utilisation:.3f}%, "
                     f"exchange {_bytes(t.exchange_bytes)}</summary><table>{head}")
        for o in t.nodes:
            steps = ",".join(str(i) for i in o.steps[:8]) + ("..." if len(o.steps) > 8 else "")
            parts.append(f"<tr><td class=l>{_e(o.node)}</td>{_op_cells(o)}<td>{o.tiles_used}</td>"
                         f"<td>{o.exchange_bytes:,}</td><td>{o.weight_bytes:,}</td><td>{o.activation_bytes:,}</td>"
                         f"<td class=l>{steps}</td></tr>")
        parts.append("</table></details>")
    return "".join(parts)


def _timetable_cells(r) -> str:
    """Lower bound, makespan / bound and the cost model's price of a step's exchange ('-' where none was run)."""
    if r.exchange_makespan is None:
        return f"<td>-</td><td>-</td><td>{r.priced_exchange:,}</td>"
    return f"<td>{r.exchange_lower_bound:,}</td><td>{r.exchange_ratio:.3f}</td><td>{r.priced_exchange:,}</td>"


def _steps_table(profile) -> str:
    timed = profile.summary.timetables is not None
    extra = "<th>lower bound</th><th>makespan / bound</th><th>cost model</th>" if timed else ""
    head = ("<tr><th>#</th><th class=l>label</th><th>compute</th><th>sync</th>"
            f"<th>{'exchange makespan' if timed else 'exchange'}</th>{extra}<th>total</th>"
            "<th>tiles</th><th>vertices</th><th>max/mean tile</th><th>exchange bytes</th>"
            "<th>busiest tile sent/recv</th>"
            "<th>live (fullest tile)</th><th>live (all tiles)</th></tr>")
    body = "".join(
        f"<tr><td>{r.index}</td><td class=l>{_e(r.label)}</td><td>{r.compute:,}</td><td>{r.sync:,}</td>"
        f"<td>{r.exchange:,}</td>{_timetable_cells(r) if timed else ''}<td>{r.total:,}</td><td>{r.tiles_used}</td>"
        f"<td>{r.vertices:,}</td>"
        f"<td>{r.balance:.2f}</td><td>{r.exchange_bytes:,}</td><td>{r.max_tile_sent:,} / {r.max_tile_received:,}</td>"
        f"<td>{_bytes(r.live_peak_tile_bytes)}</td><td>{_bytes(r.live_total_bytes)}</td></tr>"
        for r in profile.steps)
    note = ("Exchange cycles are the scheduled timetables' makespans; lower bound = busiest receive or send port's "
            "bytes / bandwidth + fixed cost; cost model = the planner's price (busiest tile's bytes / bandwidth + "
            "fixed cost)." if timed else
            "Exchange cycles are the cost model's bound (busiest tile's bytes / bandwidth + fixed cost); "
            "<code>tremula compile --timetable</code> schedules them.")
    return f'<p class="muted">{note}</p><div class="scroll"><table>{head}{body}</table></div>'


def _exchange_code(profile) -> str:
    x = profile.exchange_code
    return "" if x is None else f'<p id="exchange-code">{_e(x.sentence())}</p>'


def render_html(profile) -> str:
    s = profile.summary
    why = "".join(f"<li>{_e(w)}</li>" for w in profile.why)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>tremula report: {_e(s.model)} on {_e(s.chip)}</title>
<style>{CSS}</style></head><body>
<h1>{_e(s.model)} on {_e(s.chip)}, batch {s.batch}, {_e(s.dtype)}</h1>
<p class="muted">Modelled by tremula's cost model from the compiled BSP program (not measured).</p>
<h2 id="summary">Summary</h2>{_summary_table(profile)}
<h2 id="why">Why</h2><ul class="why">{why}</ul>
<h2 id="bsp">BSP trace</h2>{_img(plot_bsp(profile), "BSP trace")}
<h2 id="cycles">Cycles by op</h2>{_img(plot_cycles_by_op(profile), "cycles by op")}
<h2 id="ops">Operations</h2>
<p class="muted">Per op type; open a row for its nodes. Exchange-only steps are charged to the node they feed.</p>
{_ops_table(profile)}
<h2 id="memory">Memory per tile</h2>{_img(plot_tile_memory(profile), "memory per tile")}{_exchange_code(profile)}
<h2 id="liveness">Liveness per step</h2>{_img(plot_liveness(profile), "liveness per step")}
<h2 id="steps">Steps</h2>{_steps_table(profile)}
</body></html>
"""


def write_html(profile, path: str | Path) -> Path:
    """Write the self-contained HTML report of `profile` to `path`; returns the path."""
    path = Path(path)
    path.write_text(render_html(profile), encoding="utf-8")
    return path

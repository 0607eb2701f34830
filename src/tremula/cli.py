"""The `tremula` command line: chips, zoo, inspect, compile, check.

User errors (TremulaError, bad flags) print one line on stderr and exit with status 2; nothing prints a traceback
unless TREMULA_DEBUG=1 is set.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from tremula.errors import TremulaError, TremulaNotice

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Compile and simulate transformer inference on Graphcore IPUs and IPU-like tile machines.",
    pretty_exceptions_enable=False,
)
out = Console(highlight=False)
_default_showwarning = warnings.showwarning
err = Console(stderr=True, highlight=False)


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23 M'; keeps tables readable across the 1e3..1e15 range a model spans."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.4g} {unit}".rstrip()


def human_bytes(n: float) -> str:
    for scale, prefix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}"
    return f"{int(n)} B"


def _load(model: str, batch: int, seq_len: Optional[int], fuse: bool = True):
    from tremula.frontends import load_model

    graph = load_model(model, batch=batch, seq_len=seq_len)
    if fuse:
        from tremula.passes import canonicalize

        graph = canonicalize(graph)
    return graph


@app.command()
def chips(json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """List the built-in chips with their derived peak rates."""
    from tremula.chip import builtin_chip_names, chip_rows, load_chip

    rows = chip_rows([load_chip(n) for n in builtin_chip_names()])
    if json_out:
        out.print_json(json.dumps(rows))
        return
    table = Table(title="Built-in chips (sources in each chip file)")
    for key in rows[0]:
        table.add_column(key, justify="left" if key in ("name", "arch") else "right")
    for r in rows:
        table.add_row(*(str(v) for v in r.values()))
    out.print(table)


@app.command()
def zoo() -> None:
    """List the built-in models (seeded random weights, built offline)."""
    from tremula.frontends.zoo import zoo_rows

    rows = zoo_rows()
    table = Table(title="Built-in models")
    for key in rows[0]:
        table.add_column(key)
    for r in rows:
        table.add_row(*(str(v) for v in r.values()))
    out.print(table)


@app.command("inspect")
def inspect_cmd(
    model: str = typer.Argument(..., help="ONNX file, Hugging Face checkpoint folder, or zoo name."),
    batch: int = typer.Option(1, "--batch", min=1, help="Batch size for dynamic or zoo inputs."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=1, help="Sequence length for text models."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    fuse: bool = typer.Option(True, "--fuse/--no-fuse", help="Run the canonicalising passes first."),
) -> None:
    """Inputs, outputs, parameters, FLOPs per forward and a per-op table."""
    from tremula.model_info import describe

    info = describe(_load(model, batch, seq_len, fuse))
    if json_out:
        out.print_json(json.dumps(info.to_json()))
        return
    out.print(f"[bold]{info.name}[/bold]  batch {batch}")
    for kind, vals in (("input", info.inputs), ("output", info.outputs)):
        for name, t in vals:
            out.print(f"  {kind:6} {name}: {t}")
    out.print(
        f"  params {human(info.params)} ({human_bytes(info.param_bytes)}"
        f"{', lazy' if info.lazy_params else ''})   FLOPs/forward {human(info.flops, 'FLOP')}   nodes {info.nodes}"
    )
    table = Table()
    for col, just in (("op", "left"), ("count", "right"), ("FLOPs", "right"), ("%", "right"), ("params", "right"),
                      ("input shapes", "left"), ("output shapes", "left")):
        table.add_column(col, justify=just)
    for r in info.ops:
        table.add_row(r.op, str(r.count), human(r.flops), f"{r.percent:.1f}", human(r.params),
                      "\n".join(r.in_shapes), "\n".join(r.out_shapes))
    out.print(table)


class _Bar:
    """Adapts the pipeline's progress(label, done, total) callback to one rich progress bar per label."""

    def __init__(self, enabled: bool):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description:>14}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=err, transient=True, disable=not enabled)
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def __call__(self, label: str, done: int, total: int) -> None:
        if label not in self.tasks:
            self.tasks[label] = self.progress.add_task(label, total=total)
        self.progress.update(self.tasks[label], completed=done, total=total)


def _batch_arg(batch: str) -> int | str:
    if batch == "auto":
        return "auto"
    if not batch.isdigit() or int(batch) < 1:
        raise TremulaError(f"--batch must be a positive integer or 'auto' (got {batch!r})")
    return int(batch)


def _summary_rows(res, chip) -> list[tuple[str, str]]:
    seconds = res.cycles / chip.clock_hz
    mem = res.memory_by_category
    rows = [
        ("chip", f"{chip.name} ({chip.tiles} tiles x {human_bytes(chip.sram_bytes_per_tile)})"),
        ("batch / dtype", f"{res.batch} / {res.dtype}"),
        ("fits", "yes" if res.fits else "NO"),
        ("fullest tile", f"tile {res.fullest_tile}: {human_bytes(res.peak_tile_bytes)} of "
                         f"{human_bytes(chip.sram_bytes_per_tile)} "
                         f"({100 * res.peak_tile_bytes / chip.sram_bytes_per_tile:.1f} %) at step {res.peak_step}"),
        ("  by category", ", ".join(f"{k} {human_bytes(v)}" for k, v in mem.items() if v)),
        ("steps", str(res.steps) + (f" ({res.shared_layers} layers run a template layer's code)"
                                    if res.shared_layers else "")),
        ("cycles / forward", f"{res.cycles:,} (compute {res.compute_cycles:,}, exchange {res.exchange_cycles:,}, "
                             f"sync {res.sync_cycles:,})"),
        ("latency", f"{seconds * 1e3:.3f} ms per batch"),
        ("throughput", f"{res.batch / seconds:,.1f} samples/s" if seconds > 0 else "-"),
        ("compile time", f"{res.seconds:.1f} s"),
    ]
    return rows


def _mfu(res, chip, model: str, seq_len) -> float:
    """Model FLOPs utilisation as the profile defines it (FLOPs of the canonical graph at this batch / latency /
    the dtype's peak), without building the profile."""
    from tremula.compiler import canonical
    from tremula.frontends import load_model
    from tremula.model_info import describe

    seconds = res.cycles / chip.clock_hz
    if not seconds:
        return 0.0
    flops = describe(canonical(load_model(model, batch=res.batch, seq_len=seq_len))).flops
    return flops / seconds / chip.peak_flops(res.dtype)


# Parameters that compile and check share (typer reads these default objects; each command gets its own value).
MODEL_ARG = typer.Argument(..., help="ONNX file, Hugging Face checkpoint folder, or zoo name.")
CHIP_OPT = typer.Option("c600", "--chip", help="Built-in chip name or a chip TOML file.")
BATCH_OPT = typer.Option("1", "--batch", help="Batch size, or 'auto' for the largest that fits.")
DTYPE_OPT = typer.Option("fp32", "--dtype", help="fp32, fp16, or fp8 (FP8 matmul operands, FP16 elsewhere).")
CALIB_OPT = typer.Option(None, "--calibration",
                         help="fp8: calibration inputs, an .npz of input name -> array or an .npy for a one-input "
                              "model (default: one seeded sample).")


def _calibration(path: Optional[str]) -> dict | None:
    """The user's calibration inputs: '' names the only input of a one-input model (an .npy file)."""
    if path is None:
        return None
    import numpy as np

    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise TremulaError(f"cannot read calibration inputs {path}: {e}") from None
    return {"": data} if isinstance(data, np.ndarray) else {k: data[k] for k in data.files}
SEQ_OPT = typer.Option(None, "--seq-len", min=1, help="Sequence length for text models.")


@app.command("compile")
def compile_cmd(
    model: str = MODEL_ARG,
    chip: str = CHIP_OPT,
    batch: str = BATCH_OPT,
    dtype: str = DTYPE_OPT,
    seq_len: Optional[int] = SEQ_OPT,
    calibration: Optional[str] = CALIB_OPT,
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Write the Program to this file."),
    report: Optional[str] = typer.Option(None, "--report", help="Write a self-contained HTML profile here."),
    trace: Optional[str] = typer.Option(None, "--trace", help="Write a Chrome Trace Event JSON (Perfetto) here."),
    timetable: bool = typer.Option(False, "--timetable",
                                   help="Schedule every exchange cycle by cycle and compare with its lower bound."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Plan every tensor onto tiles, lower to a BSP program, and report memory and estimated cycles."""
    from tremula.chip import load_chip
    from tremula.compiler import compile_model
    from tremula.program import save_program

    c = load_chip(chip)
    with _Bar(not json_out) as bar:
        res = compile_model(model, c, _batch_arg(batch), dtype, seq_len, progress=bar,
                            calibration=_calibration(calibration))
    if output:
        save_program(res.program, output)
    exchanges = None
    if timetable:
        from tremula.timing.program_schedule import schedule_program

        with _Bar(not json_out) as bar:
            exchanges = schedule_program(res.program, c, progress=bar)
    profile = None
    if report or trace or json_out:
        from tremula.frontends import load_model
        from tremula.report import report_paths

        graph = load_model(model, batch=res.batch, seq_len=seq_len)
        # With timetables the profile charges each exchange its scheduled makespan instead of the planner's bound.
        profile = report_paths(res, graph, c, html=report, trace=trace, model=model, exchanges=exchanges)
    if json_out:
        out.print_json(json.dumps({"model": model, "chip": c.name, "seconds": res.seconds, **res.summary(),
                                   "profile": profile.to_json() if profile else None,
                                   "exchanges": [e.to_json() for e in exchanges or []]}))
        return
    out.print(f"[bold]{model}[/bold] on {c.name}")
    for k, v in _summary_rows(res, c):
        out.print(f"  {k:17} {v}", soft_wrap=True)
    if exchanges:
        from tremula.timing.program_schedule import cycles_with_timetables, summarize, timetable_line

        out.print(f"  timetables        {timetable_line(summarize(exchanges).to_json())}", soft_wrap=True)
        scheduled = cycles_with_timetables(res.cycles, res.exchange_cycles, exchanges)
        out.print(f"  total cycles with scheduled exchanges: {scheduled:,} (vs {res.cycles:,} with bounds)",
                  soft_wrap=True)
        if profile is not None and profile.exchange_code is not None:
            out.print(f"  {profile.exchange_code.sentence()}", soft_wrap=True)
            if profile.exchange_code.peak_tile_bytes > c.sram_bytes_per_tile:  # the plan's estimate was too low
                out.print(f"  [bold]warning[/bold]: with the timetables' exchange code tile "
                          f"{profile.exchange_code.peak_tile} would need {profile.exchange_code.peak_tile_bytes:,} of "
                          f"{c.sram_bytes_per_tile:,} bytes: this plan does not fit", soft_wrap=True)
    mfu = profile.summary.mfu if profile is not None else _mfu(res, c, model, seq_len)
    out.print(f"  MFU               {100 * mfu:.1f} % of the {res.dtype} peak", soft_wrap=True)
    if profile is not None:
        from tremula.report import explain

        for line in explain(profile, c)[:3]:
            out.print(f"  why: {line}", soft_wrap=True)
    for label, path in (("program", output), ("report", report), ("trace", trace)):
        if path:
            out.print(f"  {label} written to {path}")


@app.command("check")
def check_cmd(
    model: str = MODEL_ARG,
    chip: str = CHIP_OPT,
    batch: str = BATCH_OPT,
    dtype: str = DTYPE_OPT,
    seq_len: Optional[int] = SEQ_OPT,
    seed: int = typer.Option(0, "--seed", help="Seed of the generated inputs."),
    calibration: Optional[str] = CALIB_OPT,
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Compile, run the Program in the functional simulator, and compare every output with the reference."""
    from tremula.chip import load_chip
    from tremula.compiler import check_model

    c = load_chip(chip)
    with _Bar(not json_out) as bar:
        res = check_model(model, c, _batch_arg(batch), dtype, seq_len, seed=seed, progress=bar,
                          calibration=_calibration(calibration))
    if json_out:
        out.print_json(json.dumps({"model": model, "chip": c.name, "passed": res.passed,
                                   "outputs": [o.__dict__ for o in res.outputs],
                                   "layers": [x.__dict__ for x in res.layers], **res.compile.summary()}))
    else:
        out.print(f"[bold]{model}[/bold] on {c.name}, batch {res.compile.batch}, {res.compile.dtype} "
                  "(against the float32 reference)")
        for o in res.outputs:
            op = "<=" if o.metric == "max_rel_err" else ">="
            mark = "ok" if o.passed else "FAIL"
            out.print(f"  {o.name:24} cosine {o.cosine:.6f}  max rel err {o.rel_err:.3e}  "
                      f"({o.metric} needs {op} {o.threshold:g})  {mark}", soft_wrap=True)
        if res.layers:
            out.print(f"  layers that lose most ({len(res.layers)} FP8 Linears; each one's own operand rounding):")
            width = max(len(x.node) for x in res.layers[:5])
            for x in res.layers[:5]:
                out.print(f"    {x.node:{width}}  cosine {x.cosine:.6f}  max rel err {x.rel_err:.3e}", soft_wrap=True)
    if not res.passed:
        raise typer.Exit(1)


def _print_rows(rows: list[dict], title: str) -> None:
    table = Table(title=title)
    for key in rows[0]:
        table.add_column(key)
    for r in rows:
        table.add_row(*("-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()))
    out.print(table)


microbench_app = typer.Typer(help="Modelled microbenchmarks next to published measurements.", no_args_is_help=True)
app.add_typer(microbench_app, name="microbench")


@microbench_app.command("amp")
def microbench_amp(
    chip: str = typer.Option("bow", "--chip", help="Built-in chip name or a chip TOML file."),
    n: str = typer.Option("16,32,64,128,256,512,1024,2048", "--n", help="Comma-separated row counts N."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Every tile runs one FP16 [N,16]x[16,16] AMP vertex: modelled TFLOP/s and % of peak vs the measured curve."""
    from tremula.chip import load_chip
    from tremula.timing.microbench import amp_microbench

    try:
        ns = [int(v) for v in n.split(",") if v.strip()]
    except ValueError:
        raise TremulaError(f"--n must be comma-separated integers (got {n!r})") from None
    rows = amp_microbench(load_chip(chip), ns)
    if json_out:
        out.print_json(json.dumps(rows))
    else:
        _print_rows(rows, f"AMP microbenchmark on {chip} (every tile, FP16 [N,16]x[16,16])")


@app.command()
def calibrate(
    models: bool = typer.Option(True, "--models/--no-models",
                                help="Include PopRT's end-to-end results (compiles ViT-B/16 and BERT-base)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """The cost model against every published measurement we have, with the error of each."""
    from tremula.timing.calibrate import calibration_rows

    rows = calibration_rows(include_models=models)
    if json_out:
        out.print_json(json.dumps(rows))
    else:
        _print_rows(rows, "Model vs published measurements (sources in shared reference ipu-hardware.md)")


def _show_notice(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, TremulaNotice):
        err.print(f"tremula: note: {message}", soft_wrap=True, markup=False)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


def main() -> None:
    """Entry point: flag errors are reported by the CLI library (exit 2); user errors become one line on stderr;
    notices (errors.notice) one line each, before the answer they qualify."""
    warnings.showwarning = _show_notice
    try:
        app(prog_name="tremula")  # standalone: handles --help, usage errors and Ctrl-C itself
    except TremulaError as e:
        if os.environ.get("TREMULA_DEBUG"):
            raise
        err.print(f"tremula: error: {e}", soft_wrap=True, markup=False)
        sys.exit(2)
    except Exception as e:  # an internal error: still one line, with how to get the traceback
        if os.environ.get("TREMULA_DEBUG"):
            raise
        err.print(f"tremula: internal error: {type(e).__name__}: {e} (set TREMULA_DEBUG=1 for a traceback)",
                  soft_wrap=True, markup=False)
        sys.exit(3)

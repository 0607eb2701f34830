"""The `tremula` command line: chips, zoo, inspect, compile, check, run.

User errors (TremulaError, bad flags) print one line on stderr and exit with status 2; nothing prints a traceback
unless TREMULA_DEBUG=1 is set.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import unicodedata
import zipfile
import warnings
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tremula.errors import TremulaError, TremulaNotice

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Compile and simulate transformer inference on Graphcore IPUs and IPU-like tile machines.",
    pretty_exceptions_enable=False,
)
PIPED_WIDTH = 10_000  # columns when stdout is a pipe or file: tables keep whole rows (`tremula chips | cat`)


def _console(stderr: bool = False) -> Console:
    """A console that wraps to the terminal's width, but not to rich's 80-column default when not on a terminal
    (a COLUMNS the user sets still wins)."""
    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPED_WIDTH
    return console


out = _console()
_default_showwarning = warnings.showwarning
err = _console(stderr=True)
# Characters that would act on the terminal instead of showing: controls (ESC, CR, C1), format characters (bidi
# overrides), line/paragraph separators, and the surrogates a file name's undecodable bytes become.
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def printable(text: object) -> str:
    """`text` with every character that would act on the terminal shown as its escape (ESC as \\x1b, U+202E as
    \\u202e), so a name from a model file can neither recolour the terminal nor break a line in two."""
    s = str(text)
    if s.isprintable():  # the common case: nothing to escape
        return s
    return "".join(_escape_char(ch) if unicodedata.category(ch) in _HIDDEN else ch for ch in s)


_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(ch: str) -> str:
    if ch in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def safe(text: object) -> str:
    """User-controlled text (model, node, input and chip names, paths) for a line that rich reads as markup: shown
    as written, never as markup ("[bold]") or terminal control."""
    return escape(printable(text))


def _finite(data: Any) -> Any:
    """`data` with every NaN or infinity as null: JSON has no such numbers, and `NaN` would break a reader."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(v) for v in data]
    return data


def _print_json(data: Any) -> None:
    # ensure_ascii: rich re-encodes the JSON; without it C1 controls (U+009B is CSI) would reach the terminal raw.
    out.print_json(json.dumps(_finite(data), allow_nan=False), ensure_ascii=True)


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


def _load(model: str, batch: Optional[int], seq_len: Optional[int], fuse: bool = True):
    from tremula.frontends import load_model

    graph = load_model(model, batch=batch, seq_len=seq_len)
    if fuse:
        from tremula.passes import canonicalize

        graph = canonicalize(graph)
    return graph


@app.command()
def chips(json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """List the built-in chips with their derived peak rates."""
    from tremula.target.chip import builtin_chip_names, chip_rows, load_chip

    rows = chip_rows([load_chip(n) for n in builtin_chip_names()])
    if json_out:
        _print_json(rows)
        return
    table = Table(title="Built-in chips (sources in each chip file)")
    for key in rows[0]:
        table.add_column(key, justify="left" if key in ("name", "arch") else "right")
    for r in rows:
        table.add_row(*(safe(_chip_cell(k, v)) for k, v in r.items()))
    out.print(table)


def _chip_cell(key: str, value: Any) -> str:
    """A chip_rows value as the table shows it: at the precision of its column, '-' where the chip lacks it."""
    from tremula.target.chip import CHIP_ROW_FORMATS

    if value is None:
        return "-"
    return format(value, CHIP_ROW_FORMATS[key]) if key in CHIP_ROW_FORMATS else str(value)


@app.command()
def systems(json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """List the built-in systems of several chips (for --system)."""
    from tremula.target.system import builtin_system_names, load_system

    rows = []
    for n in builtin_system_names():
        s = load_system(n)
        rows.append({"name": s.name, "chip": s.chip.name, "chips": s.chips,
                     "SRAM GB": round(s.chips * s.chip.total_sram_bytes / 1e9, 2),
                     "link GB/s each way": round(s.link_bytes_per_second / 1e9, 3),
                     "streaming memory GB": round(s.streaming_memory_bytes / 1e9, 1), "description": s.description})
    if json_out:
        _print_json(rows)
        return
    table = Table(title="Built-in systems (sources in each system file)")
    for key in rows[0]:
        table.add_column(key, justify="left" if key in ("name", "chip", "description") else "right")
    for r in rows:
        table.add_row(*(safe(v) for v in r.values()))
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
        table.add_row(*(safe(v) for v in r.values()))
    out.print(table)


@app.command("inspect")
def inspect_cmd(
    model: str = typer.Argument(..., help="ONNX file, Hugging Face checkpoint folder, or zoo name."),
    batch: Optional[int] = typer.Option(None, "--batch", min=1,
                                        help="Batch size (default: the model's own, else 1)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=1, help="Sequence length for text models."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    fuse: bool = typer.Option(True, "--fuse/--no-fuse", help="Run the canonicalising passes first."),
) -> None:
    """Inputs, outputs, parameters, FLOPs per forward and a per-op table."""
    from tremula.model_info import describe

    info = describe(_load(model, batch, seq_len, fuse))
    if json_out:
        _print_json(info.to_json())
        return
    out.print(f"[bold]{safe(info.name)}[/bold]  batch {info.batch if info.batch is not None else '-'}")
    for kind, vals in (("input", info.inputs), ("output", info.outputs)):
        for name, t in vals:
            out.print(f"  {kind:6} {safe(name)}: {safe(t)}")
    out.print(
        f"  params {human(info.params)} ({human_bytes(info.param_bytes)}"
        f"{', lazy' if info.lazy_params else ''})   FLOPs/forward {human(info.flops, 'FLOP')}   nodes {info.nodes}"
    )
    table = Table()
    for col, just in (("op", "left"), ("count", "right"), ("FLOPs", "right"), ("%", "right"), ("params", "right"),
                      ("input shapes", "left"), ("output shapes", "left")):
        table.add_column(col, justify=just)
    for r in info.ops:
        table.add_row(safe(r.op), str(r.count), human(r.flops), f"{r.percent:.1f}", human(r.params),
                      "\n".join(map(safe, r.in_shapes)), "\n".join(map(safe, r.out_shapes)))
    out.print(table)


class _Bar:
    """Adapts the pipeline's progress(label, done, total) callback to one rich progress bar per label."""

    def __init__(self, enabled: bool):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description:>14}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=err, transient=True,
                                 disable=not enabled)
        self.tasks: dict[str, int] = {}
        self.started: dict[str, float] = {}

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def __call__(self, label: str, done: int, total: int) -> None:
        if label not in self.tasks:
            self.tasks[label] = self.progress.add_task(label, total=total, rate="")
            self.started[label] = time.perf_counter()
        elapsed = time.perf_counter() - self.started[label]
        rate = f"{done / elapsed:.1f} {'steps' if label == 'simulate' else 'items'}/s" if done and elapsed > 0 else ""
        self.progress.update(self.tasks[label], completed=done, total=total, rate=rate)


def _batch_arg(batch: Optional[str]) -> int | str | None:
    """None (no --batch): the model's own batch, else 1 (compiler.compile_model)."""
    if batch is None or batch == "auto":
        return batch
    if not batch.isdigit() or int(batch) < 1:
        raise TremulaError(f"--batch must be a positive integer or 'auto' (got {batch!r})")
    return int(batch)


def _summary_rows(res, chip) -> list[tuple[str, str]]:
    # Latency and throughput charge the host link in series with the forward (CompileResult.throughput_cycles says
    # why: every tile computes, none is set aside to overlap I/O), as the profile's summary does.
    seconds = res.latency_cycles / chip.clock_hz
    mem = res.memory_by_category
    rows = [
        ("chip", f"{chip.name} ({chip.tiles} tiles x {human_bytes(chip.sram_bytes_per_tile)})"),
        ("batch / dtype", f"{res.batch} / {res.dtype}" + (f", {res.partials} partials" if res.dtype != "float32"
                                                          else "")),
        ("fits", "yes" if res.fits else "NO"),
        ("fullest tile", f"tile {res.fullest_tile}: {human_bytes(res.peak_tile_bytes)} of "
                         f"{human_bytes(chip.sram_bytes_per_tile)} "
                         f"({100 * res.peak_tile_bytes / chip.sram_bytes_per_tile:.1f} %) at step {res.peak_step}"),
        ("  by category", ", ".join(f"{k} {human_bytes(v)}" for k, v in mem.items() if v)
         # The peak is the highest byte in use: below it lie bytes no live buffer holds (padding, fragmentation, and
         # matmul operands kept in separate memory elements, plan/elements.py).
         + (f"; free below the high-water mark {human_bytes(gap)}"
            if (gap := res.peak_tile_bytes - sum(mem.values())) > 0 else "")),
        ("steps", str(res.steps) + (f" ({res.shared_layers} layers run a template layer's code)"
                                    if res.shared_layers else "")),
        ("cycles / forward", f"{res.cycles:,} (compute {res.compute_cycles:,}, exchange {res.exchange_cycles:,}, "
                             f"sync {res.sync_cycles:,})"),
        ("host I/O", f"{res.host_cycles:,} cycles (in {res.host_in_cycles:,} for {human_bytes(res.host_in_bytes)}"
                     + (f", {human_bytes(res.streamed_bytes)} of it weights streamed" if res.streamed_bytes else "")
                     + f", out {res.host_out_cycles:,} for {human_bytes(res.host_out_bytes)}; "
                     f"{chip.host_bytes_per_second / 1e9:.3g} GB/s a direction)"),
        ("latency", f"{seconds * 1e3:.3f} ms per batch (host in + device + host out)"),
        ("throughput", f"{res.batch / seconds:,.1f} samples/s (host I/O not overlapped with device work: no IO "
                       "tiles, PopART's default)" if seconds > 0 else "-"),
        ("compile time", f"{res.seconds:.1f} s"),
    ]
    if res.streamed_layers:  # weights streamed from host memory (plan/stream.py)
        layers = ", ".join(f"{n} layers of {r}" for r, n in res.streamed_layers.items())
        rows.insert([r[0] for r in rows].index("host I/O") + 1, (
            "  weights streamed", f"{layers} from host memory, {human_bytes(res.streamed_bytes)} a forward in "
                                  "exchange phases (two of those layers' weights on the chip at a time)"))
    if res.auto:  # --batch auto: the fastest batch the search planned, beside the largest that fits
        rates, grown = res.auto["rates"], set(res.auto.get("grown", ()))
        full = ", ".join(f"{b}: {r:,.0f}/s" for b, r in rates.items() if b in grown)
        step = ", ".join(f"{b}: {r:,.0f}/s" for b, r in rates.items() if b not in grown)
        listed = f"{full} as compiled" + (f"; ranked by their plans grown one step: {step}" if step else "")
        rows.insert(2, ("batch auto", f"batch {res.batch} is the fastest of those planned that fit ({listed}); the "
                                      f"largest that fits is {res.auto['largest']}"))
    return rows


def _mfu(res, chip, model: str, seq_len) -> float:
    """Model FLOPs utilisation as the profile defines it (FLOPs of the canonical graph at this batch / latency /
    the dtype's peak), without building the profile."""
    from tremula.pipeline import canonical
    from tremula.frontends import load_model
    from tremula.model_info import describe

    seconds = res.latency_cycles / chip.clock_hz  # the time throughput charges, host I/O included
    if not seconds:
        return 0.0
    source = res.source if res.source is not None else load_model(model, batch=res.batch, seq_len=seq_len)
    flops = describe(canonical(source)).flops  # the compile's own graph: the model is not loaded again
    return flops / seconds / chip.peak_flops(res.dtype)


# Parameters that compile and check share (typer reads these default objects; each command gets its own value).
MODEL_ARG = typer.Argument(..., help="ONNX file, Hugging Face checkpoint folder, or zoo name.")
CHIP_OPT = typer.Option("c600", "--chip", help="Built-in chip name or a chip TOML file.")
BATCH_OPT = typer.Option(None, "--batch", help="Batch size, or 'auto' for the fastest of the batches that fit "
                                              "(the search plans up to the largest that fits; default: the "
                                              "model's own, else 1).")
DTYPE_OPT = typer.Option("fp32", "--dtype", help="fp32, fp16, or fp8 (FP8 matmul operands, FP16 elsewhere).")
PARTIALS_OPT = typer.Option("half", "--partials",
                            help="fp16/fp8: what matmuls accumulate in: half (PopRT's choice: twice the fp16 AMP "
                                 "rate, rounded to half every 16 input channels) or float (float32 partials).")
WEIGHTS_OPT = typer.Option("auto", "--weights",
                           help="auto: keep every weight on the chip, or when that does not fit, stream the fewest "
                                "repeated layers' weights from host memory that make it fit; resident: never stream; "
                                "streamed: stream every repeated layer's weights (two layers on the chip at a time).")
CALIB_OPT = typer.Option(None, "--calibration",
                         help="fp8: calibration inputs, an .npz of input name -> array or an .npy for a one-input "
                              "model (default: four seeded samples).")


def _dtype_arg(dtype: str, calibration: Optional[str]) -> str:
    """--dtype in any case (chip names are case-insensitive too); --calibration only where it does something."""
    key = dtype.strip().lower()
    if key not in ("fp32", "fp16", "fp8"):
        raise TremulaError(f"unsupported --dtype {dtype!r}: use fp32, fp16 or fp8")
    if calibration is not None and key != "fp8":
        raise TremulaError(f"--calibration applies to --dtype fp8 only (it sets FP8 activation scales); "
                           f"drop it at {key}")
    return key


def _weights_arg(weights: str) -> str:
    from tremula.pipeline import WEIGHTS

    key = weights.strip().lower()
    if key not in WEIGHTS:
        raise TremulaError(f"unsupported --weights {weights!r}: use {', '.join(WEIGHTS)}")
    return key


def _partials_arg(partials: str) -> str:
    key = partials.strip().lower()
    if key not in ("half", "float"):
        raise TremulaError(f"unsupported --partials {partials!r}: use half or float")
    return key


def _calibration(path: Optional[str]) -> dict | None:
    """The user's calibration inputs, read as data (_arrays_file); the compiler checks them against the model."""
    return _arrays_file(path, "--calibration", "calibration inputs")


def _arrays_file(path: Optional[str], flag: str, what: str) -> dict | None:
    """The user's arrays (calibration inputs, inputs, expected outputs), read as data: '' names the only input (or
    output) of the model (an .npy file).

    Only the file is judged here: a .npy or .npz of plain numeric arrays of at least one dimension, whole, that fits
    in the host's memory; the compiler checks the arrays against the model."""
    if path is None:
        return None
    if not path.strip():
        raise TremulaError(f"{flag} needs a file name (got an empty path)")
    if Path(path).is_dir():
        raise _unreadable(path, "it is a folder; give an .npz or .npy file", what)
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except OSError as e:
        raise _unreadable(path, e.strerror or str(e), what) from None
    if magic == b"\x93NUMPY":
        headers = {"": _npy_header(path, what=what)}
    elif magic[:4] == b"PK\x03\x04" or magic[:4] == b"PK\x05\x06":  # a zip archive (an empty one starts PK\5\6)
        headers = _npz_headers(path, what)
    else:
        raise _unreadable(path, "not a NumPy .npy or .npz file (write them with numpy.save or numpy.savez)", what)
    _check_fits_in_memory(path, headers, what)
    return _load_arrays(path, magic[:2] == b"PK", what)


def _npy_header(path: str, zf: Optional[zipfile.ZipFile] = None, member: str = "",
                what: str = "calibration inputs") -> tuple[tuple[int, ...], Any]:
    """(shape, dtype) of one .npy (the file, or `member` of the .npz open as `zf`), from its header alone, refused
    unless it is a numeric array of at least one dimension whose bytes are all there."""
    from numpy.lib import format as npy

    where = f"{path}" if zf is None else f"{path} (array {member!r})"
    try:
        with (open(path, "rb") if zf is None else zf.open(member)) as f:
            version = npy.read_magic(f)
            read = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}.get(version)
            if read is None:
                raise ValueError(f"unsupported .npy format version {version}")
            shape, _, dtype = read(f)
            available = (os.fstat(f.fileno()).st_size if zf is None else zf.getinfo(member).file_size) - f.tell()
    except Exception as e:  # a stranger's bytes: every failure to parse them is the user's file, not our bug
        raise _unreadable(where, _first_line(e), what) from None
    if dtype.hasobject:
        raise _unreadable(where, "it holds Python objects (pickled data), which tremula never loads; save numbers",
                          what)
    if dtype.kind not in "biuf":
        raise _unreadable(where, f"it holds {dtype} values; {what} are numbers", what)
    if not shape:
        raise _unreadable(where, f"a 0-d array (a single number); {what} have the batch dimension first", what)
    needed = _nbytes(shape, dtype)
    if available < needed:
        raise _unreadable(where, f"truncated: shape {list(shape)} of {dtype} needs {needed:,} bytes, the file "
                                f"holds {max(available, 0):,}", what)
    return tuple(shape), dtype


def _npz_headers(path: str, what: str = "calibration inputs") -> dict[str, tuple[tuple[int, ...], Any]]:
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            if not names:
                raise _unreadable(path, "an empty .npz (no arrays)", what)
            odd = [n for n in names if not n.endswith(".npy")]
            if odd:
                raise _unreadable(path, f"it holds {odd[0]!r}, which is not a .npy array; write them with numpy.savez",
                                  what)
            return {n[: -len(".npy")]: _npy_header(path, zf, n, what) for n in names}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise _unreadable(path, _first_line(e), what) from None


def _check_fits_in_memory(path: str, headers: dict[str, tuple[tuple[int, ...], Any]],
                          what: str = "calibration inputs") -> None:
    """A few compressed bytes can declare gigabytes: refuse what the host could not hold before reading it."""
    needed = sum(_nbytes(shape, dtype) for shape, dtype in headers.values())
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX host: the reading itself will say
        return
    if needed > memory:
        raise _unreadable(path, f"it declares {human_bytes(needed)} of arrays, more than this host's "
                                f"{human_bytes(memory)} of memory", what)


def _load_arrays(path: str, is_npz: bool, what: str = "calibration inputs") -> dict:
    import numpy as np

    try:
        if is_npz:
            with np.load(path, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
        return {"": np.load(path, allow_pickle=False)}
    except Exception as e:  # the headers were fine, the data is not (a bad CRC, a truncated compressed stream)
        raise _unreadable(path, _first_line(e), what) from None


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.prod(shape) * dtype.itemsize  # Python ints: a hostile header cannot overflow the count


def _unreadable(where: str, reason: str, what: str = "calibration inputs") -> TremulaError:
    return TremulaError(f"cannot read {what} {where}: {reason}")


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


SEQ_OPT = typer.Option(None, "--seq-len", min=1, help="Sequence length for text models.")
SYSTEM_OPT = typer.Option(None, "--system",
                          help="Several chips: a built-in system (1xc600, 2xc600, 4xc600, bow2000; `tremula systems`) "
                               "or a system TOML file. The model is cut into the fewest pipeline stages that fit "
                               "(counts that divide the chips first), one chip each; chips left over run replicas. "
                               "Replaces --chip.")
STAGES_OPT = typer.Option(None, "--stages", min=1, help="With --system: exactly this many pipeline stages.")


@app.command("compile")
def compile_cmd(
    model: str = MODEL_ARG,
    chip: str = CHIP_OPT,
    batch: Optional[str] = BATCH_OPT,
    dtype: str = DTYPE_OPT,
    seq_len: Optional[int] = SEQ_OPT,
    calibration: Optional[str] = CALIB_OPT,
    partials: str = PARTIALS_OPT,
    weights: str = WEIGHTS_OPT,
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Write the Program to this file."),
    report: Optional[str] = typer.Option(None, "--report", help="Write a self-contained HTML profile here."),
    trace: Optional[str] = typer.Option(None, "--trace", help="Write a Chrome Trace Event JSON (Perfetto) here."),
    timetable: bool = typer.Option(False, "--timetable",
                                   help="Schedule every exchange cycle by cycle and compare with its lower bound."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    system: Optional[str] = SYSTEM_OPT,
    stages: Optional[int] = STAGES_OPT,
) -> None:
    """Plan every tensor onto tiles, lower to a BSP program, and report memory and estimated cycles."""
    from tremula.target.chip import load_chip
    from tremula.compiler import compile_model
    from tremula.outputs import check_outputs
    from tremula.program import save_program

    dtype, partials, weights = _dtype_arg(dtype, calibration), _partials_arg(partials), _weights_arg(weights)
    if system is not None or stages is not None:
        _refuse_with_system(system, stages, {"--output": output, "--timetable": timetable or None,
                                             "--weights": None if weights == "auto" else weights})
        from tremula.multichip import compile_system
        from tremula.target.system import load_system

        sysm = load_system(system)  # type: ignore[arg-type]
        per_stage = {f"{flag} (stage {k})": _stage_path(path, k) for flag, path in (("--report", report),
                                                                                     ("--trace", trace))
                     if path is not None for k in range(sysm.chips)}
        check_outputs(per_stage, model, None, calibration)
        with _Bar(not json_out) as bar:
            sres = compile_system(model, sysm, _batch_arg(batch), dtype, seq_len, progress=bar, stages=stages,
                                  calibration=_calibration(calibration), partials=partials)
        if report is not None or trace is not None:  # one profile per chip: each stage is a Program of its own
            from tremula.report import report_paths

            for k, r in enumerate(sres.stages):
                report_paths(r, sysm.chip, html=report and _stage_path(report, k), trace=trace and
                             _stage_path(trace, k), model=model)
        _print_system(model, sres, json_out)
        for label, path in (("report", report), ("trace", trace)):
            if path is not None and not json_out:
                files = ", ".join(_stage_path(path, k) for k in range(len(sres.stages)))
                out.print(f"  {label}s written to {safe(files)}", soft_wrap=True)
        return
    c = load_chip(chip)
    # Before any work: an output must not destroy an input, and must be writable now rather than after the compile.
    check_outputs({"--output": output, "--report": report, "--trace": trace}, model, chip, calibration)
    calibration_inputs = _calibration(calibration)
    with _Bar(not json_out) as bar:
        res = compile_model(model, c, _batch_arg(batch), dtype, seq_len, progress=bar, calibration=calibration_inputs,
                            partials=partials, weights=weights)
    if output is not None:  # with what `tremula run` needs to stand alone: the chip's TOML and the weights' hash
        from tremula.provenance import seal

        save_program(seal(res.program, c, res.graph, seq_len), output)
    exchanges = None
    if timetable:
        from tremula.timing.program_schedule import schedule_program

        with _Bar(not json_out) as bar:
            exchanges = schedule_program(res.program, c, progress=bar)
    profile = None
    if report is not None or trace is not None or json_out:
        from tremula.report import report_paths

        # With timetables the profile charges each exchange its scheduled makespan instead of the planner's bound.
        profile = report_paths(res, c, html=report, trace=trace, model=model, exchanges=exchanges)
    if json_out:
        _print_json({"model": model, "chip": c.name, "seconds": res.seconds, **res.summary(),
                     "profile": profile.to_json() if profile else None,
                     "exchanges": [e.to_json() for e in exchanges or []]})
        return
    out.print(f"[bold]{safe(model)}[/bold] on {safe(c.name)}")
    for k, v in _summary_rows(res, c):
        out.print(f"  {k:17} {safe(v)}", soft_wrap=True)
    if exchanges:
        from tremula.timing.program_schedule import cycles_with_timetables, summarize, timetable_line

        out.print(f"  timetables        {timetable_line(summarize(exchanges).to_json())}", soft_wrap=True)
        scheduled = cycles_with_timetables(res.cycles, res.exchange_cycles, exchanges)
        out.print(f"  total cycles with scheduled exchanges: {scheduled:,} (vs {res.cycles:,} with bounds)",
                  soft_wrap=True)
        if profile is not None and profile.exchange_code is not None:
            out.print(f"  {safe(profile.exchange_code.sentence())}", soft_wrap=True)
            if profile.exchange_code.peak_tile_bytes > c.sram_bytes_per_tile:  # the plan's estimate was too low
                out.print(f"  [bold]warning[/bold]: with the timetables' exchange code tile "
                          f"{profile.exchange_code.peak_tile} would need {profile.exchange_code.peak_tile_bytes:,} of "
                          f"{c.sram_bytes_per_tile:,} bytes: this plan does not fit", soft_wrap=True)
    mfu = profile.summary.mfu if profile is not None else _mfu(res, c, model, seq_len)
    out.print(f"  MFU               {100 * mfu:.1f} % of the {res.dtype} peak", soft_wrap=True)
    if profile is not None:
        from tremula.report import explain

        for line in explain(profile, c)[:3]:
            out.print(f"  why: {safe(line)}", soft_wrap=True)
    for label, path in (("program", output), ("report", report), ("trace", trace)):
        if path is not None:
            out.print(f"  {label} written to {safe(path)}", soft_wrap=True)


@app.command("check")
def check_cmd(
    model: str = MODEL_ARG,
    chip: str = CHIP_OPT,
    batch: Optional[str] = BATCH_OPT,
    dtype: str = DTYPE_OPT,
    seq_len: Optional[int] = SEQ_OPT,
    seed: int = typer.Option(0, "--seed", help="Seed of the generated inputs (a non-negative integer)."),
    calibration: Optional[str] = CALIB_OPT,
    partials: str = PARTIALS_OPT,
    weights: str = WEIGHTS_OPT,
    inputs: Optional[str] = typer.Option(None, "--inputs",
                                         help="Check on your inputs instead of seeded ones: an .npz of input name -> "
                                              "array (an .npy for a one-input model); their first dimension is the "
                                              "batch. An ONNX model is also run in onnxruntime on them."),
    expected: Optional[str] = typer.Option(None, "--expected",
                                           help="With --inputs: the outputs you expect, an .npz of output name -> "
                                                "array (some outputs may be left out)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    system: Optional[str] = SYSTEM_OPT,
    stages: Optional[int] = STAGES_OPT,
) -> None:
    """Compile, run the Program in the functional simulator, and compare every output with the reference (and, with
    --inputs, with your expected outputs and onnxruntime)."""
    from tremula.target.chip import load_chip
    from tremula.check import check_model

    if seed < 0:  # numpy's generators take none, and a one-line answer beats an internal error after the compile
        raise TremulaError(f"--seed must be a non-negative integer (got {seed})")
    weights = _weights_arg(weights)
    if system is not None or stages is not None:
        _refuse_with_system(system, stages, {"--inputs": inputs, "--expected": expected,
                                             "--weights": None if weights == "auto" else weights})
        _check_system(model, system, batch, dtype, seq_len, seed, stages, calibration, partials, json_out)
        return
    if expected is not None and inputs is None:
        raise TremulaError("--expected needs --inputs: expected outputs are for the inputs you give")
    dtype, partials = _dtype_arg(dtype, calibration), _partials_arg(partials)
    c = load_chip(chip)
    calibration_inputs = _calibration(calibration)
    # --calibration sets FP8 scales, --inputs are what is checked: both may be given (scales are never fit to them)
    user_inputs = _arrays_file(inputs, "--inputs", "inputs")
    expected_outputs = _arrays_file(expected, "--expected", "expected outputs")
    with _Bar(not json_out) as bar:
        res = check_model(model, c, _batch_arg(batch), dtype, seq_len, seed=seed, progress=bar,
                          calibration=calibration_inputs, inputs=user_inputs, expected=expected_outputs,
                          partials=partials, weights=weights)
    if json_out:
        _print_json({"model": model, "chip": c.name, "passed": res.passed, "inputs": res.inputs,
                     "outputs": [o.__dict__ for o in res.outputs], "simulation_seconds": round(res.sim_seconds, 3),
                     "matched": [o.__dict__ for o in res.matched],
                     "oracles": [{"name": x.name, "note": x.note, "outputs": [o.__dict__ for o in x.outputs],
                                  "not_compared": x.not_compared} for x in res.oracles],
                     "layers": [x.__dict__ for x in res.layers], **res.compile.summary()})
    else:
        source = f"your inputs {inputs}" if inputs is not None else f"seeded inputs (seed {seed})"
        part = f" ({res.compile.partials} partials)" if res.compile.dtype != "float32" else ""
        out.print(f"[bold]{safe(model)}[/bold] on {safe(c.name)}, batch {res.compile.batch}, "
                  f"{res.compile.dtype}{part}, {safe(source)} (against the float32 reference)", soft_wrap=True)
        for o in res.outputs:
            out.print(_accuracy_line(o), soft_wrap=True)
        if res.matched:  # fp16 / fp8: did the simulator run the right Program, whatever its accuracy?
            out.print("  against the precision-matched reference (the planned graph in its own dtypes and sum orders):")
            for o in res.matched:
                out.print(_matched_line(o), soft_wrap=True)
        for oracle in res.oracles:
            note = f"{oracle.note} {expected}" if oracle.name == "expected" else oracle.note
            out.print(f"  against {safe(note)}:" if oracle.outputs else
                      f"  {oracle.name}: not compared: {safe(oracle.note)}", soft_wrap=True)
            for o in oracle.outputs:  # (a shape mismatch has its own "metric": say it as it is)
                out.print(_accuracy_line(o, None if o.metric in ("max_rel_err", "cosine") else f"({safe(o.metric)})"),
                          soft_wrap=True)
            if oracle.outputs and oracle.not_compared:
                out.print(f"    not compared: {safe(', '.join(oracle.not_compared))}", soft_wrap=True)
        if res.layers:
            out.print(f"  layers that lose most ({len(res.layers)} FP8 Linears; each one's own operand rounding):")
            names = [printable(x.node) for x in res.layers[:5]]
            width = max(map(len, names))
            for name, x in zip(names, res.layers[:5]):
                out.print(f"    {escape(name.ljust(width))}  cosine {x.cosine:.6f}  max rel err {x.rel_err:.3e}",
                          soft_wrap=True)
    if not res.passed:
        raise typer.Exit(1)


def _accuracy_line(o, need: str | None = None) -> str:
    """One output against the float32 reference (or another oracle): both measures, what decides, ok or FAIL."""
    op = "<=" if o.metric == "max_rel_err" else ">="
    need = need or f"({o.metric} needs {op} {o.threshold:g})"
    return (f"  {escape(printable(o.name).ljust(24))} cosine {o.cosine:.6f}  max rel err {o.rel_err:.3e}  {need}  "
            f"{'ok' if o.passed else 'FAIL'}")


def _matched_line(o, prefix: str = "") -> str:
    """One output against the precision-matched reference."""
    return (f"  {prefix}{escape(printable(o.name).ljust(24))} max rel err {o.rel_err:.3e}  "
            f"(needs <= {o.threshold:.3g})  {'ok' if o.passed else 'FAIL'}")


def _refuse_with_system(system: Optional[str], stages: Optional[int], given: dict[str, Any]) -> None:
    if system is None:
        raise TremulaError("--stages needs --system (the chips to put the stages on)")
    used = [flag for flag, v in given.items() if v is not None]
    if used:
        raise TremulaError(f"{', '.join(used)} {'is' if len(used) == 1 else 'are'} not supported with --system yet "
                           "(each stage is a Program of its own)")


def _stage_path(path: str, k: int) -> str:
    """report.html -> report.stage0.html: a file per pipeline stage."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.stage{k}{p.suffix}"))


def _system_rows(res) -> list[tuple[str, str]]:
    """The system summary: per stage memory and cycles, then the pipeline's period, latency and throughput."""
    sysm, chip, clock = res.system, res.system.chip, res.system.chip.clock_hz
    rows = [("system", f"{sysm.name}: {sysm.chips} x {chip.name} ({sysm.description})"),
            ("batch / dtype", f"{res.batch} / {res.dtype}" + (f", {res.stages[0].partials} partials"
                                                              if res.dtype != "float32" else "")),
            *([("batch auto", f"batch {res.batch} is the fastest of those planned with these stages ("
                              + ", ".join(f"{b}: {r:,.0f}/s" for b, r in res.auto["rates"].items())
                              + f"); the largest that fits is {res.auto['largest']}")] if res.auto else []),
            ("pipeline", f"{len(res.stages)} stage(s) x {res.replicas} replica(s); cut before node(s) "
                         f"{', '.join(map(str, res.cuts)) or '-'} of {res.nodes}")]
    for k, (r, c) in enumerate(zip(res.stages, res.stage_cycles)):
        rows.append((f"  stage {k}", f"weights {human_bytes(r.graph.param_bytes())}, fullest tile {r.fullest_tile}: "
                                     f"{human_bytes(r.peak_tile_bytes)} "
                                     f"({100 * r.peak_tile_bytes / chip.sram_bytes_per_tile:.1f} %); {c:,} cycles "
                                     f"(compute {r.compute_cycles:,}, exchange {r.exchange_cycles:,}, sync "
                                     f"{r.sync_cycles:,}, host {c - r.cycles:,})"))
    if len(res.stages) > 1:
        rows.append(("links", f"{res.link_cycles:,} cycles a pipeline cycle for "
                              f"{', '.join(human_bytes(b) for b in res.link_bytes)} between neighbours "
                              f"({sysm.link_bytes_per_second / 1e9:.3g} GB/s each way x {sysm.link_efficiency:g}), "
                              f"then a sync of {res.sync_cycles} cycles"))
    rows += [("period", f"{res.period_cycles:,} cycles a pipeline cycle (bound by {res.bound_by})"),
             ("latency", f"{1e3 * res.latency_cycles / clock:.3f} ms per batch through every stage"),
             ("throughput", f"{res.throughput:,.1f} samples/s (steady state, all replicas)"),
             ("MFU", f"{100 * res.mfu:.1f} % of {sysm.chips} chips' {res.dtype} peak"),
             ("compile time", f"{res.seconds:.1f} s")]
    return rows


def _print_system(model: str, res, json_out: bool) -> None:
    if json_out:
        _print_json({"model": model, "seconds": res.seconds, **res.summary()})
        return
    out.print(f"[bold]{safe(model)}[/bold] on {safe(res.system.name)}")
    for k, v in _system_rows(res):
        out.print(f"  {k:17} {safe(v)}", soft_wrap=True)


def _check_system(model, system, batch, dtype, seq_len, seed, stages, calibration, partials, json_out) -> None:
    from tremula.check import check_system

    dtype, partials = _dtype_arg(dtype, calibration), _partials_arg(partials)
    with _Bar(not json_out) as bar:
        res = check_system(model, system, _batch_arg(batch), dtype, seq_len, seed, bar, stages,
                           _calibration(calibration), partials)
    if json_out:
        _print_json({"model": model, "passed": res.passed, "outputs": [o.__dict__ for o in res.outputs],
                     "matched": [{"stage": k, **o.__dict__} for k, o in res.matched],
                     "simulation_seconds": round(res.sim_seconds, 3), **res.compile.summary()})
    else:
        _print_system(model, res.compile, False)
        out.print(f"  against the float32 reference (seeded inputs, seed {seed}):")
        for o in res.outputs:
            out.print(_accuracy_line(o), soft_wrap=True)
        if res.matched:
            out.print("  each stage against its precision-matched reference, on the inputs it received:")
            for k, o in res.matched:
                out.print(_matched_line(o, f"stage {k} "), soft_wrap=True)
    if not res.passed:
        raise typer.Exit(1)


@app.command("run")
def run_cmd(
    program: str = typer.Argument(..., help="A Program file written by `tremula compile ... -o`."),
    model: str = typer.Argument(..., help="The model it was compiled from (ONNX file, checkpoint folder, or zoo "
                                          "name), for its weights."),
    inputs: str = typer.Option(..., "--inputs", help="An .npz of input name -> array (an .npy for a one-input "
                                                     "model), at the Program's batch."),
    out_path: Optional[str] = typer.Option(None, "--out", help="Write the outputs here, an .npz of output name -> "
                                                               "array."),
    chip: Optional[str] = typer.Option(None, "--chip", help="Refuse the Program unless it was compiled for this "
                                                            "chip (built-in name or TOML file, by its sha256)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Load a saved Program, refuse it if it was made for another chip or other weights, and simulate it on your
    inputs on the chip it embeds."""
    import numpy as np

    from tremula.outputs import check_outputs
    from tremula.run_program import prepare, run_saved

    if out_path is not None:
        for path, what in ((program, "the program"), (inputs, "the inputs")):
            if Path(out_path).resolve() == Path(path).resolve():
                raise TremulaError(f"--out {out_path} would overwrite {what} {path}; choose another output path")
        check_outputs({"--out": out_path}, model, chip)
    user_inputs = _arrays_file(inputs, "--inputs", "inputs")
    prepared = prepare(program, model, chip)
    with _Bar(not json_out) as bar:
        res = run_saved(prepared, user_inputs or {}, progress=bar)
    if out_path is not None:
        with open(out_path, "wb") as f:
            np.savez(f, **res.outputs)
    p, prov = prepared.program, prepared.program.provenance
    rows = [{"name": k, "shape": list(v.shape), "dtype": str(v.dtype),
             "min": float(v.min()) if v.size else None, "max": float(v.max()) if v.size else None,
             "mean": float(v.astype(np.float64).mean()) if v.size else None} for k, v in res.outputs.items()] \
        if res.outputs else []
    if json_out:
        _print_json({"program": program, "model": model, "chip": p.chip, "chip_sha256": prov.chip_sha256,
                     "weights_sha256": prov.weights_sha256, "batch": p.batch, "dtype": p.dtype,
                     "simulation_seconds": round(res.seconds, 3), "outputs": rows, "written": out_path})
        return
    out.print(f"[bold]{safe(program)}[/bold]: {safe(model)} on {safe(p.chip)} (embedded, sha256 "
              f"{prov.chip_sha256[:12]}), batch {p.batch}, {p.dtype}; weights sha256 {prov.weights_sha256[:12]} "
              "match", soft_wrap=True)
    for r in rows:
        out.print(f"  {escape(printable(r['name']).ljust(24))} {r['dtype']}{r['shape']}  min {r['min']:.6g}  "
                  f"max {r['max']:.6g}  mean {r['mean']:.6g}", soft_wrap=True)
    out.print(f"  simulated in {res.seconds:.1f} s", soft_wrap=True)
    if out_path is not None:
        out.print(f"  outputs written to {safe(out_path)}", soft_wrap=True)


def _print_rows(rows: list[dict], title: str) -> None:
    table = Table(title=title)
    for key in rows[0]:
        table.add_column(key)
    for r in rows:
        table.add_row(*("-" if v is None else f"{v:.4g}" if isinstance(v, float) else safe(v) for v in r.values()))
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
    from tremula.target.chip import load_chip
    from tremula.timing.microbench import amp_microbench

    try:
        ns = [int(v) for v in n.split(",") if v.strip()]
    except ValueError:
        raise TremulaError(f"--n must be comma-separated integers (got {n!r})") from None
    rows = amp_microbench(load_chip(chip), ns)
    if json_out:
        _print_json(rows)
    else:
        _print_rows(rows, f"AMP microbenchmark on {safe(chip)} (every tile, FP16 [N,16]x[16,16])")


@microbench_app.command("matmul")
def microbench_matmul(
    chip: str = typer.Option("c600", "--chip", help="Built-in chip name or a chip TOML file."),
    rows: int = typer.Option(..., "--rows", help="Rows R of the left operand [R,K]."),
    k: int = typer.Option(..., "--k", help="Inner dimension K."),
    cols: int = typer.Option(..., "--cols", help="Output columns N of [K,N]."),
    dtype: str = typer.Option("fp16", "--dtype", help="fp16 or fp8 operands."),
    partials: Optional[str] = typer.Option(None, "--partials",
                                           help="half or float accumulation (default: the planner's, float for "
                                                "fp16 and half for fp8)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """One tile's [R,K]x[K,N] matmul vertex: modelled cycles, MACs/cycle and % of the AMP peak, beside a measured
    kernel where ipu-stack-facts §2.1 has that shape."""
    from tremula.target.chip import load_chip
    from tremula.timing.microbench import matmul_point

    row = matmul_point(load_chip(chip), rows, k, cols, dtype.strip().lower(),
                       None if partials is None else partials.strip().lower())
    if json_out:
        _print_json(row)
        return
    # One kernel: quantities down, model and measurement across, so the table fits a terminal.
    m = row["measured_cycles"]
    table = Table(title=f"[{rows},{k}] x [{k},{cols}] {row['dtype']} on one {safe(chip)} tile")
    table.add_column("")
    table.add_column("model", justify="right")
    table.add_column("measured", justify="right")
    peak = row["peak_macs_per_cycle"]
    measured = [f"{m:,}", f"{row['macs']:,}", f"{row['macs'] / m:.2f}", f"{100 * row['macs'] / m / peak:.1f}"] \
        if m else ["-"] * 4
    for label, v, w in zip(("cycles", "MACs", "MACs / cycle", "% of AMP peak"),
                           (f"{row['cycles']:,}", f"{row['macs']:,}", f"{row['macs_per_cycle']:.2f}",
                            f"{row['pct_amp_peak']:.1f}"), measured):
        table.add_row(label, v, w)
    out.print(table)
    out.print(f"model: {safe(row['path'])}, {row['partials']} partials; AMP peak {peak:g} MACs / cycle / tile",
              soft_wrap=True)
    if m:
        out.print(f"measured: {safe(row['source'])}; model {row['error_pct']:+.1f} % against it", soft_wrap=True)
    else:
        out.print("measured: no published point for this chip and shape (ipu-stack-facts §2.1)", soft_wrap=True)


@app.command()
def calibrate(
    models: bool = typer.Option(True, "--models/--no-models",
                                help="Include PopRT's end-to-end results (compiles ViT-B/16 and BERT-base)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """The cost model against every published measurement we have, with the error of each."""
    from tremula.calibrate import calibration_rows

    rows = calibration_rows(include_models=models)
    if json_out:
        _print_json(rows)
    else:
        _print_rows(rows, "Model vs published measurements (sources in shared reference ipu-hardware.md)")


def _show_notice(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, TremulaNotice):
        err.print(f"tremula: note: {printable(message)}", soft_wrap=True, markup=False)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


def main() -> None:
    """Entry point. Every error is one line on stderr: flag and user errors (TremulaError) exit 2, Ctrl-C 130,
    anything else is an internal error (exit 3; TREMULA_DEBUG=1 shows the traceback). Notices (errors.notice) are
    one line each, before the answer they qualify."""
    warnings.showwarning = _show_notice
    try:
        # Not standalone: the CLI library would print a flag error as a framed box over several lines.
        code = app(prog_name="tremula", standalone_mode=False)
    except Exception as e:
        kind = _click_kind(e)
        if kind == "NoArgsIsHelpError":  # bare `tremula` or a bare group: the help, as asked
            out.print(e.format_message(), markup=False, highlight=False)  # type: ignore[attr-defined]
            sys.exit(0)
        if kind == "Abort":
            err.print("tremula: interrupted", markup=False)
            sys.exit(130)
        if kind == "ClickException":  # a bad flag or argument
            ctx = getattr(e, "ctx", None)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            err.print(f"tremula: error: {printable(e.format_message())}{hint}",  # type: ignore[attr-defined]
                      soft_wrap=True, markup=False)
            sys.exit(int(getattr(e, "exit_code", 2)))
        if os.environ.get("TREMULA_DEBUG"):
            raise
        if isinstance(e, TremulaError):
            err.print(f"tremula: error: {printable(e)}", soft_wrap=True, markup=False)
            sys.exit(2)
        err.print(f"tremula: internal error: {type(e).__name__}: {printable(e)} "
                  "(set TREMULA_DEBUG=1 for a traceback)", soft_wrap=True, markup=False)
        sys.exit(3)
    sys.exit(code if isinstance(code, int) else 0)


def _click_kind(e: BaseException) -> str | None:
    """The CLI library's error family of `e` ("NoArgsIsHelpError", "Abort", "ClickException"), or None. By class
    name: recent Typer versions carry their own copy of Click, so the classes are not importable from one place."""
    names = [c.__name__ for c in type(e).__mro__]
    return next((k for k in ("NoArgsIsHelpError", "Abort", "ClickException") if k in names), None)

"""Calibration: the model against every published measurement in ipu-hardware.md (AMP curve, exchange, sync, PopRT)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tremula.errors import TremulaError
from tremula.target.chip import load_chip
from tremula.timing.microbench import MEASURED_AMP_SOURCE, MEASURED_AMP_TFLOPS, amp_point
from tremula.timing.timetable import stream_rate

PENDING = "pending"


@dataclass(frozen=True)
class EndToEnd:
    """A published end-to-end inference measurement (ipu-hardware.md §7) to reproduce with compile_model."""

    model: str  # zoo name
    chip: str
    dtype: str
    batch: int
    measured: float  # items per second
    unit: str
    source: str


# ipu-hardware.md §7, PopRT benchmarks (C600 era, FP16).
END_TO_END = (
    EndToEnd("vit-base-patch16-224", "c600", "fp16", 8, 2600.0, "img/s",
             "ipu-hardware.md §7: graphcore/PopRT benchmarks/ViT/README.md [M]"),
    EndToEnd("vit-base-patch16-224", "c600", "fp16", 32, 3109.0, "img/s",
             "ipu-hardware.md §7: graphcore/PopRT benchmarks/ViT/README.md [M]"),
    EndToEnd("bert-base-uncased", "c600", "fp16", 16, 4817.0, "seq/s",
             "ipu-hardware.md §7: graphcore/PopRT benchmarks/bert/README.md, seq 128 [M]"),
    EndToEnd("bert-base-uncased", "c600", "fp16", 128, 5672.0, "seq/s",
             "ipu-hardware.md §7: graphcore/PopRT benchmarks/bert/README.md, seq 128 [M]"),
)

# ipu-hardware.md §4: T10/Elk's calibrated exchange ("shift") cost on Mk2, cycles per byte per core [C].
ELK_EXCHANGE_CYCLES_PER_BYTE = 0.28
# ipu-hardware.md §4: T10/Elk's calibrated SYNC_CYCLES on Mk2 [C].
ELK_SYNC_CYCLES = 118
# ipu-hardware.md §1: Mk2 on-chip exchange "8 TB/s any pattern" aggregate [V].
MK2_EXCHANGE_AGGREGATE_BYTES_PER_SECOND = 8e12
# ipu-hardware.md §4: the seed article's all-core sync barrier, ~100 ns.
SEED_SYNC_SECONDS = 100e-9


def _row(quantity: str, source: str, measured, model, unit: str, note: str = "") -> dict:
    err = None
    if isinstance(model, (int, float)) and isinstance(measured, (int, float)) and measured:
        err = 100.0 * (model - measured) / measured
    return {"quantity": quantity, "source": source, "measured": measured, "model": model, "unit": unit,
            "error_pct": err, "note": note}


def amp_rows() -> list[dict]:
    rows = []
    for chip_name, points in MEASURED_AMP_TFLOPS.items():
        chip = load_chip(chip_name)
        for n, measured in sorted(points.items()):
            p = amp_point(chip, n)
            rows.append(_row(f"AMP FP16 [{n},16]x[16,16] on all tiles ({chip_name})", MEASURED_AMP_SOURCE, measured,
                             p["model_tflops"], "TFLOP/s", f"{p['cycles']} cycles per vertex"))
    return rows


def exchange_rows() -> list[dict]:
    mk2 = load_chip("mk2")
    rate = stream_rate(mk2)
    return [
        _row("exchange bytes per cycle per tile (mk2)",
             f"ipu-hardware.md §4: T10/Elk calibrated shift cost {ELK_EXCHANGE_CYCLES_PER_BYTE} cycles/B/core [C]",
             1.0 / ELK_EXCHANGE_CYCLES_PER_BYTE, float(rate), "B/cycle",
             "model: a stream's rate = min(send, receive B/cycle) from the chip file"),
        _row("exchange aggregate, any pattern (mk2)", "ipu-hardware.md §1: \"8 TB/s any pattern\" [V]",
             MK2_EXCHANGE_AGGREGATE_BYTES_PER_SECOND / 1e12, mk2.tiles * rate * mk2.clock_hz / 1e12, "TB/s",
             "model: tiles x stream B/cycle x clock (streaming peak, no fixed cost)"),
    ]


def sync_rows() -> list[dict]:
    mk2 = load_chip("mk2")
    return [
        _row("sync barrier cycles (mk2)", f"ipu-hardware.md §4: T10/Elk SYNC_CYCLES = {ELK_SYNC_CYCLES} [C]",
             float(ELK_SYNC_CYCLES), float(mk2.sync_cycles), "cycles",
             "the chip file takes its value from this source, so agreement is by construction"),
        _row("sync barrier time (mk2)", "ipu-hardware.md §4: the seed article, all-core sync ~100 ns",
             SEED_SYNC_SECONDS * 1e9, mk2.sync_cycles / mk2.clock_hz * 1e9, "ns", "an approximate figure (~)"),
    ]


def end_to_end_rows(compile_fn: Callable | None = None, entries: tuple[EndToEnd, ...] = END_TO_END) -> list[dict]:
    """PopRT rows: items/s = batch x clock / (cycles charged per batch: the compiled Program's forward plus its
    host I/O, as `compile` reports throughput; CompileResult.throughput_cycles).

    Without an importable compiler the rows say 'pending' instead of a number. A plan that does not fit in SRAM is
    still priced (require_fit=False) and the row says so.
    """
    if compile_fn is None:
        try:
            from tremula.compiler import compile_model as compile_fn
        except ImportError:
            compile_fn = None
    rows = []
    for e in entries:
        q = f"{e.model} {e.dtype} batch {e.batch} ({e.chip})"
        if compile_fn is None:
            rows.append(_row(q, e.source, e.measured, PENDING, e.unit, "the compiler is not available yet"))
            continue
        chip = load_chip(e.chip)
        try:
            res = compile_fn(e.model, chip, batch=e.batch, dtype=e.dtype, require_fit=False)
        except TremulaError as err:
            rows.append(_row(q, e.source, e.measured, PENDING, e.unit, f"compile failed: {err}"))
            continue
        per_batch = res.throughput_cycles
        model = e.batch * chip.clock_hz / per_batch if per_batch else PENDING
        note = f"{res.cycles:,} cycles per forward + {per_batch - res.cycles:,} of host I/O"
        if not res.fits:
            note += f"; does not fit in SRAM at batch {e.batch} (priced anyway)"
        rows.append(_row(q, e.source, e.measured, model, e.unit, note))
    return rows


def calibration_rows(include_models: bool = True) -> list[dict]:
    """Model vs every published measurement: each row has quantity, source, measured, model, unit, error_pct (model
    vs measured, in %, None when either side is missing) and a note. include_models=False skips the end-to-end rows
    (each compiles a full model)."""
    rows = amp_rows() + exchange_rows() + sync_rows()
    if include_models:
        rows += end_to_end_rows()
    return rows

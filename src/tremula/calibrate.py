"""Calibration: the model against every published measurement (ipu-hardware.md: AMP curve, exchange, sync, PopRT;
ipu-stack-facts.md: one tile's kernels timed on a C600)."""

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


# ../shared/reference/ipu-stack-facts.md §2.2 [M]: other kernels timed on a C600 by a stack with its own kernels:
# (quantity, measured cycles, what the model prices, note). Where a measured kernel is the faster the chip file prices
# with it (GELU); where poplibs' estimate is, that stays (adds, reductions, softmax), and the row shows the gap.
_FACTS_22 = "ipu-stack-facts.md §2.2 [M]"


def kernel_rows() -> list[dict]:
    """One tile's kernels on the C600 against the kernels timed there (§2.1 matmuls, §2.2 the rest)."""
    from tremula.codelets import codelet
    from tremula.target import cost_terms
    from tremula.target.cost import amp_matmul_cycles
    from tremula.timing.microbench import MEASURED_MATMUL_CYCLES, matmul_point

    c600 = load_chip("c600")
    rows = []
    for (chip_name, dt, r, k, n), (measured, source) in MEASURED_MATMUL_CYCLES.items():
        p = matmul_point(load_chip(chip_name), r, k, n, dt)
        note = p["path"] + ("; the measured kernel packs its output for the next AMP (another variant, slower per "
                            "row), the model writes rows" if "packed-output" in source else "")
        if " QK " in source:  # an attention product: its coefficients are activations, not stored weights
            est = amp_matmul_cycles(load_chip(chip_name), r, k, n, dt, "fp16")
            note = f"as a Linear's weights; attention prices its QK with the ConvPartial1x1 estimate, {est:,} cycles"
        rows.append(_row(f"{dt} matmul [{r},{k}]x[{k},{n}] on one tile ({chip_name})", source, measured, p["cycles"],
                         "cycles", note))
    red = codelet("reduce_partials")
    for n, parts, measured in ((2208, 4, 4_974), (576, 15, 3_090)):
        model = red.cycles(c600, (parts, 0, 1), [(1, n), (parts - 1, n), (1, n)], ("float16",) * 3)
        rows.append(_row(f"half sum of {parts} partials, {n} elements (c600)", _FACTS_22, measured, model, "cycles",
                         "poplibs' add estimate per part (the measured kernel: 282 + 6 x n/48 x (11 + 2 (P - 1)))"))
    for n, measured in ((1152, 1_368), (2152, 2_124)):
        rows.append(_row(f"half add, {n} elements (c600)", _FACTS_22, measured,
                         cost_terms.vector_cycles(c600, "add", n, "float16"), "cycles", "poplibs' BinaryOp estimate"))
    rows.append(_row("half GeLU f16v4mix (bias + GeLU), 2,152 elements (c600)", _FACTS_22, 8_550,
                     cost_terms.vector_cycles(c600, "gelu", 2152, "float16"), "cycles",
                     "the kernel the chip file prices GELU with ([vector.gelu_fp16])"))
    rows.append(_row("half GeLU, plain kernel, 2,208 elements (c600)", _FACTS_22, 12_060,
                     cost_terms.vector_cycles(c600, "gelu", 2208, "float16"), "cycles",
                     "priced by the faster f16v4mix kernel"))
    rows.append(_row("half LayerNorm, 1 row of 1,152 (c600)", _FACTS_22, 6_732,
                     cost_terms.layernorm_cycles(c600, 1, 1152, "float16"), "cycles", "composed of vector estimates"))
    for r, measured, what in ((8, 21_770, "8 rows x 768 keys, split-worker (21,762-21,780)"),
                              (1, 12_258, "one row of 768 keys")):
        rows.append(_row(f"half softmax, {what} (c600)", _FACTS_22, measured,
                         cost_terms.softmax_cycles(c600, r, 768, "float16"), "cycles",
                         "composed of vector estimates (float32 row max and sum)"))
    return rows


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
    rows = amp_rows() + kernel_rows() + exchange_rows() + sync_rows()
    if include_models:
        rows += end_to_end_rows()
    return rows

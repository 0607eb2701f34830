"""The Chip: a frozen, validated description of one tile machine, loaded from a TOML file with a source per value."""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from tremula.errors import TremulaError

ARCHS = ("ipu1", "ipu2", "ipu21")
_RELEASE_ORDER = ("mk1", "mk2", "bow", "c600")

# Element-type spellings accepted by the cost model; the AMP and vector tables are keyed by the short names.
_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
    "fp8": "fp8", "float8": "fp8", "quarter": "fp8", "f143": "fp8", "f152": "fp8",
    "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}

# Upper bounds on a chip file's numbers: far beyond any tile machine (a C600 has 1,472 tiles of 624 KiB), they keep a
# hand-written file from asking for arrays of every tile that exhaust the host (2**24 tiles: 5 GiB for one table) or
# from overflowing the planner's int64 arithmetic (a supervisor cost of 2**63 - 1 cycles did, in plan/finalize.py).
MAX_TILES = 1 << 20
MAX_COUNT = 1 << 32  # any other integer: bytes, cycles, units
MIN_RATE, MAX_RATE = 1.0, 1e18  # clock in Hz, bandwidths in bytes/s: 1/x and x * seconds stay finite

# The AMP pair the vendor's peak figure refers to, per input type (fp16 peaks are quoted for half->half).
_PEAK_PAIR = {"fp32": "fp32_fp32", "fp16": "fp16_fp16", "fp8": "fp8_fp16"}


def normalize_dtype(dtype: str) -> str:
    """'float16' / 'half' / 'fp16' -> 'fp16' (likewise fp32, fp8); anything else is a TremulaError."""
    key = str(dtype).lower()
    if key not in _DTYPE_ALIASES:
        raise TremulaError(f"unknown element type {dtype!r} for the cost model (use fp32, fp16 or fp8)")
    return _DTYPE_ALIASES[key]


@dataclass(frozen=True)
class AmpPair:
    """One AMP (accumulating matrix product) configuration: input type -> accumulator type.

    MAC/cycle/tile = conv_units * weights_per_conv_unit / core_loop_worker_cycles (6 workers each issue once per 6
    tile cycles, so worker and tile rates cancel). The rest are the ConvPartial1x1 vertex's overheads (see
    target/cost.py).
    """

    in_dtype: str
    acc_dtype: str
    macs_per_cycle_per_tile: int
    conv_units: int
    weights_per_conv_unit: int
    core_loop_worker_cycles: int
    supervisor_cycles: int
    out_group_cycles: int
    in_group_cycles: int
    pass_cycles: int
    worker_base_cycles: int
    worker_cycles_1_row: int
    worker_cycles_2_rows: int
    zero_worker_cycles_per_row: int
    worker_delta_cycles_without_zeroing: int
    retention_worker_savings_cycles: int
    retention_supervisor_cycles_per_input_group: int
    # A measured kernel for a matmul whose coefficients are weights the compiler stores (in the kernel's layout, at
    # load time): (fixed cycles, cycles per row per group, cycles per group), a group being weights_per_conv_unit
    # input channels x conv_units output channels, when the chip file has one ([amp.<pair>.weights_kernel]); else
    # the ConvPartial1x1 estimate prices those too (target/cost.amp_matmul_cycles).
    weights_kernel: tuple[int, int, int] | None = None

    @property
    def key(self) -> str:
        return f"{self.in_dtype}_{self.acc_dtype}"


@dataclass(frozen=True)
class VectorOp:
    """Cost of one element-wise codelet's inner loop: cycles per loop and elements per loop, per element type."""

    name: str
    fp16_cycles_per_loop: int
    fp16_elems_per_loop: int
    fp32_cycles_per_loop: int
    fp32_elems_per_loop: int


@dataclass(frozen=True)
class ExchangeCode:
    """Bytes of exchange and control instructions per tile: the encoding model of ipu-stack-facts §1.2 (chip file
    table [exchange_code]); target/overheads.py applies it to transfer tables."""

    send_bytes: int  # one send: address set-up + send, carrying up to send_words words
    send_words: int
    continue_bytes: int  # each continuation (sendoff) of a longer payload, up to continue_words words
    continue_words: int
    receive_bytes: int  # one receive: incoming-mux select + teardown
    pointer_reset_bytes: int  # a receive that does not continue the previous one's addresses
    phase_bytes_per_tile: int  # entry and return of an exchange phase on each tile taking part
    control_bytes_per_step: int  # a step's supervisor control code on every tile


@dataclass(frozen=True)
class Chip:
    """Every hardware constant of one chip. Frozen and hashable, so planners may cache on it."""

    name: str
    arch: str
    description: str
    source_path: str
    tiles: int
    sram_bytes_per_tile: int
    clock_hz: float
    workers_per_tile: int
    data_path_bytes: int
    local_load_bytes_per_cycle: int
    memory_element_bytes: int
    non_interleaved_bytes_per_tile: int  # the region instructions can be fetched from (code, exchange code)
    interleaved_element_bytes: int  # an effective memory element above that region (elements interleaved in pairs)
    operand_align_bytes: int  # alignment of every buffer (AMP operands need it)
    exchange_send_bytes_per_cycle_per_tile: int
    exchange_recv_bytes_per_cycle_per_tile: int
    tiles_per_shared_exchange_bus: int
    exchange_instruction_bytes: int
    exchange_code: ExchangeCode
    exchange_fixed_cycles: int
    sync_cycles: int
    host_bytes_per_second: float
    chip_link_bytes_per_second: float
    amp_coeff_load_bytes_per_cycle: int
    amp_worker_tag_cycles: int
    amp: tuple[AmpPair, ...]
    vector_supervisor_cycles: int
    vector_fp16_worker_cycles: int
    vector_fp32_worker_cycles: int
    vector_fp16_flops_per_cycle_per_tile: int
    vector_fp32_flops_per_cycle_per_tile: int
    vector_ops: tuple[VectorOp, ...]
    reduce_supervisor_cycles: int
    reduce_worker_cycles: int
    reduce_per_output_cycles: int
    reduce_cycles_per_loop: int
    reduce_fp16_accumulator_elems: int
    reduce_fp32_accumulator_elems: int
    # A measured half-precision GELU kernel, (fixed cycles, cycles per block, elements per block) of one tile, when the
    # chip file has one ([vector.gelu_fp16]); else GELU is priced from its vector ops (target/cost.gelu_cycles).
    gelu_fp16: tuple[int, int, int] | None = None

    def __hash__(self) -> int:
        # The fields' hash, computed once: the planner's caches hash the chip on every call (a batch probe of
        # BERT-base hashed its nested tables 680,000 times, 0.5 s).
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        # (not the cached hash: a string's hash differs in another process)
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    # ---- lookups -------------------------------------------------------------------------------------------------
    def amp_pair(self, in_dtype: str, acc_dtype: str) -> AmpPair:
        key = f"{normalize_dtype(in_dtype)}_{normalize_dtype(acc_dtype)}"
        for pair in self.amp:
            if pair.key == key:
                return pair
        known = ", ".join(p.key.replace("_", "->") for p in self.amp)
        raise TremulaError(f"chip {self.name} has no AMP path {key.replace('_', '->')} (it has: {known})")

    def vector_op(self, op_kind: str) -> VectorOp:
        for op in self.vector_ops:
            if op.name == op_kind:
                return op
        known = ", ".join(op.name for op in self.vector_ops)
        raise TremulaError(f"chip {self.name} has no vector cost for op {op_kind!r} (known: {known})")

    # ---- derived properties --------------------------------------------------------------------------------------
    def supports(self, dtype: str) -> bool:
        """True when the chip's AMP takes this input type (fp8 only on ipu21)."""
        d = normalize_dtype(dtype)
        return any(p.in_dtype == d for p in self.amp)

    def peak_flops(self, dtype: str) -> float:
        """Matmul peak FLOP/s = 2 x MAC/cycle/tile x tiles x clock, using the pair the vendor quotes for that input."""
        d = normalize_dtype(dtype)
        if not self.supports(d):
            raise TremulaError(f"chip {self.name} has no {d} matmul unit (choose another --dtype or chip)")
        quoted = [p for p in self.amp if p.key == _PEAK_PAIR[d]]
        # A user chip without the quoted pair still has a peak: its fastest path for that input type.
        same_input = [p for p in self.amp if p.in_dtype == d]
        pair = quoted[0] if quoted else max(same_input, key=lambda p: p.macs_per_cycle_per_tile)
        return 2.0 * pair.macs_per_cycle_per_tile * self.tiles * self.clock_hz

    @property
    def total_sram_bytes(self) -> int:
        return self.tiles * self.sram_bytes_per_tile

    @property
    def exchange_bytes_per_second_per_tile(self) -> float:
        return self.exchange_send_bytes_per_cycle_per_tile * self.clock_hz

    @property
    def memory_elements_per_tile(self) -> int:
        return self.sram_bytes_per_tile // self.memory_element_bytes


# ---- loading ------------------------------------------------------------------------------------------------------


def builtin_chip_names() -> list[str]:
    """Names of the chip files shipped with tremula: mk1, mk2, bow, c600."""
    folder = resources.files("tremula") / "chips"
    names = [p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml")]
    # Generations in release order first (for the `tremula chips` table), then anything else alphabetically.
    return sorted(names, key=lambda n: (_RELEASE_ORDER.index(n) if n in _RELEASE_ORDER else len(_RELEASE_ORDER), n))


def load_chip(name_or_path: str) -> Chip:
    """A built-in chip by name (mk1, mk2, bow, c600; any case) or a user chip from a path to a TOML file."""
    spec = str(name_or_path)
    looks_like_path = spec.endswith(".toml") or "/" in spec or "\\" in spec
    if not looks_like_path:
        names = builtin_chip_names()
        if spec.lower() in names:
            return _load_builtin(spec.lower())
        if not Path(spec).is_file():
            raise TremulaError(f"unknown chip {spec!r} (built-in chips: {', '.join(names)}; or give a path to a .toml)")
    path = Path(spec)
    if not path.is_file():
        raise TremulaError(f"chip file {spec} does not exist (give a built-in name: {', '.join(builtin_chip_names())})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TremulaError(f"chip file {spec} cannot be read: {e}") from None
    return _parse(text, spec)


@functools.lru_cache(maxsize=None)
def _load_builtin(key: str) -> Chip:
    # Shipped files never change while running, and the Chip is frozen, so planners may call load_chip freely.
    res = resources.files("tremula") / "chips" / f"{key}.toml"
    return _parse(res.read_text(encoding="utf-8"), f"{key}.toml")


def _parse(text: str, where: str) -> Chip:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TremulaError(f"chip file {where} is not valid TOML: {e}") from None
    r = _Reader(data, where)
    amp_table = r.table("amp")
    pairs = []
    for key in sorted(k for k, v in amp_table.items() if isinstance(v, dict)):
        pairs.append(_amp_pair(r, key))
    if not pairs:
        raise TremulaError(f"chip file {where}: table 'amp' has no dtype pair (add e.g. [amp.fp16_fp16])")
    ops = tuple(_vector_op(r, name) for name in sorted(r.table("vector.ops")))
    chip = Chip(
        name=r.string("name"),
        arch=r.choice("arch", ARCHS),
        description=r.string("description"),
        source_path=where,
        tiles=r.pos_int("tiles", MAX_TILES),
        sram_bytes_per_tile=r.pos_int("sram_bytes_per_tile"),
        clock_hz=r.pos_float("clock_hz"),
        workers_per_tile=r.pos_int("workers_per_tile"),
        data_path_bytes=r.pos_int("data_path_bytes"),
        local_load_bytes_per_cycle=r.pos_int("local_load_bytes_per_cycle"),
        memory_element_bytes=r.pos_int("memory_element_bytes"),
        non_interleaved_bytes_per_tile=r.pos_int("non_interleaved_bytes_per_tile"),
        interleaved_element_bytes=r.pos_int("interleaved_element_bytes"),
        operand_align_bytes=r.pos_int("operand_align_bytes"),
        exchange_send_bytes_per_cycle_per_tile=r.pos_int("exchange_send_bytes_per_cycle_per_tile"),
        exchange_recv_bytes_per_cycle_per_tile=r.pos_int("exchange_recv_bytes_per_cycle_per_tile"),
        tiles_per_shared_exchange_bus=r.pos_int("tiles_per_shared_exchange_bus"),
        exchange_instruction_bytes=r.pos_int("exchange_instruction_bytes"),
        exchange_code=ExchangeCode(**{f: (r.pos_int if f.endswith("words") else r.nonneg_int)(f"exchange_code.{f}")
                                      for f in ExchangeCode.__dataclass_fields__}),
        exchange_fixed_cycles=r.nonneg_int("exchange_fixed_cycles"),
        sync_cycles=r.nonneg_int("sync_cycles"),
        host_bytes_per_second=r.pos_float("host_bytes_per_second"),
        chip_link_bytes_per_second=r.pos_float("chip_link_bytes_per_second"),
        amp_coeff_load_bytes_per_cycle=r.pos_int("amp.coeff_load_bytes_per_cycle"),
        amp_worker_tag_cycles=r.nonneg_int("amp.worker_tag_cycles"),
        amp=tuple(pairs),
        vector_supervisor_cycles=r.nonneg_int("vector.supervisor_cycles"),
        vector_fp16_worker_cycles=r.nonneg_int("vector.fp16_worker_cycles"),
        vector_fp32_worker_cycles=r.nonneg_int("vector.fp32_worker_cycles"),
        vector_fp16_flops_per_cycle_per_tile=r.pos_int("vector.fp16_flops_per_cycle_per_tile"),
        vector_fp32_flops_per_cycle_per_tile=r.pos_int("vector.fp32_flops_per_cycle_per_tile"),
        vector_ops=ops,
        reduce_supervisor_cycles=r.nonneg_int("reduce.supervisor_cycles"),
        reduce_worker_cycles=r.nonneg_int("reduce.worker_cycles"),
        reduce_per_output_cycles=r.nonneg_int("reduce.per_output_cycles"),
        reduce_cycles_per_loop=r.pos_int("reduce.cycles_per_loop"),
        reduce_fp16_accumulator_elems=r.pos_int("reduce.fp16_accumulator_elems"),
        reduce_fp32_accumulator_elems=r.pos_int("reduce.fp32_accumulator_elems"),
        gelu_fp16=(r.nonneg_int("vector.gelu_fp16.fixed_cycles"), r.pos_int("vector.gelu_fp16.cycles_per_block"),
                   r.pos_int("vector.gelu_fp16.block_elems")) if r.has("vector.gelu_fp16") else None,
    )
    r.check_no_unknown_keys()
    _check_consistency(chip, where)
    return chip


def _amp_pair(r: _Reader, key: str) -> AmpPair:
    parts = key.split("_")
    if len(parts) != 2 or any(p not in ("fp32", "fp16", "fp8") for p in parts):
        raise TremulaError(f"chip file {r.where}: amp table {key!r} must be named input_accumulator, e.g. fp16_fp32")
    p = f"amp.{key}."
    return AmpPair(
        in_dtype=parts[0],
        acc_dtype=parts[1],
        macs_per_cycle_per_tile=r.pos_int(p + "macs_per_cycle_per_tile"),
        conv_units=r.pos_int(p + "conv_units"),
        weights_per_conv_unit=r.pos_int(p + "weights_per_conv_unit"),
        core_loop_worker_cycles=r.pos_int(p + "core_loop_worker_cycles"),
        supervisor_cycles=r.nonneg_int(p + "supervisor_cycles"),
        out_group_cycles=r.nonneg_int(p + "out_group_cycles"),
        in_group_cycles=r.nonneg_int(p + "in_group_cycles"),
        pass_cycles=r.nonneg_int(p + "pass_cycles"),
        worker_base_cycles=r.pos_int(p + "worker_base_cycles"),
        worker_cycles_1_row=r.pos_int(p + "worker_cycles_1_row"),
        worker_cycles_2_rows=r.pos_int(p + "worker_cycles_2_rows"),
        zero_worker_cycles_per_row=r.nonneg_int(p + "zero_worker_cycles_per_row"),
        worker_delta_cycles_without_zeroing=r.integer(p + "worker_delta_cycles_without_zeroing"),
        retention_worker_savings_cycles=r.nonneg_int(p + "retention_worker_savings_cycles"),
        retention_supervisor_cycles_per_input_group=r.nonneg_int(p + "retention_supervisor_cycles_per_input_group"),
        weights_kernel=(r.nonneg_int(p + "weights_kernel.fixed_cycles"), r.pos_int(p + "weights_kernel.row_cycles"),
                        r.nonneg_int(p + "weights_kernel.group_cycles")) if r.has(p + "weights_kernel") else None,
    )


def _vector_op(r: _Reader, name: str) -> VectorOp:
    p = f"vector.ops.{name}."
    return VectorOp(
        name=name,
        fp16_cycles_per_loop=r.pos_int(p + "fp16_cycles_per_loop"),
        fp16_elems_per_loop=r.pos_int(p + "fp16_elems_per_loop"),
        fp32_cycles_per_loop=r.pos_int(p + "fp32_cycles_per_loop"),
        fp32_elems_per_loop=r.pos_int(p + "fp32_elems_per_loop"),
    )


def _check_consistency(chip: Chip, where: str) -> None:
    """Relations between fields that a typo would break; each message names the field to fix."""
    if chip.sram_bytes_per_tile % chip.memory_element_bytes:
        raise TremulaError(f"chip file {where}: field 'memory_element_bytes' must divide sram_bytes_per_tile")
    if chip.operand_align_bytes & (chip.operand_align_bytes - 1) or chip.operand_align_bytes % 8:
        raise TremulaError(f"chip file {where}: field 'operand_align_bytes' must be a power of two and at least 8")
    if chip.interleaved_element_bytes % chip.memory_element_bytes:
        raise TremulaError(f"chip file {where}: field 'interleaved_element_bytes' must be a multiple of "
                           "memory_element_bytes")
    if chip.non_interleaved_bytes_per_tile > chip.sram_bytes_per_tile:
        raise TremulaError(f"chip file {where}: field 'non_interleaved_bytes_per_tile' exceeds sram_bytes_per_tile")
    for p in chip.amp:
        if p.macs_per_cycle_per_tile * p.core_loop_worker_cycles != p.conv_units * p.weights_per_conv_unit:
            raise TremulaError(
                f"chip file {where}: field 'amp.{p.key}.macs_per_cycle_per_tile' ({p.macs_per_cycle_per_tile})"
                f" must equal"
                f" conv_units x weights_per_conv_unit / core_loop_worker_cycles"
                f" ({p.conv_units * p.weights_per_conv_unit / p.core_loop_worker_cycles:g})"
            )


class _Reader:
    """Typed access to dotted keys of a parsed TOML document; every error names the file and the field."""

    def __init__(self, data: dict[str, Any], where: str, kind: str = "chip file") -> None:
        self.data = data
        self.where = where
        self.kind = kind  # what the messages call the file ("chip file", "system file")
        self.used: set[str] = set()

    _MISSING = object()

    def _walk(self, dotted: str) -> Any:
        node: Any = self.data
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return self._MISSING
            node = node[part]
        return node

    def _get(self, dotted: str) -> Any:
        node = self._walk(dotted)
        if node is self._MISSING:
            raise TremulaError(f"{self.kind} {self.where}: field '{dotted}' is missing")
        self.used.add(dotted)
        return node

    def has(self, dotted: str) -> bool:
        """Whether an optional field or table is there."""
        return self._walk(dotted) is not self._MISSING

    def _fail(self, dotted: str, what: str, value: Any) -> TremulaError:
        return TremulaError(f"{self.kind} {self.where}: field '{dotted}' must be {what}, got {value!r}")

    def table(self, dotted: str) -> dict[str, Any]:
        v = self._get(dotted)
        if not isinstance(v, dict):
            raise self._fail(dotted, "a table", v)
        return {k: x for k, x in v.items() if not k.endswith("_source")}

    def string(self, dotted: str) -> str:
        v = self._get(dotted)
        if not isinstance(v, str) or not v.strip():
            raise self._fail(dotted, "a non-empty string", v)
        return v

    def choice(self, dotted: str, options: tuple[str, ...]) -> str:
        v = self.string(dotted)
        if v not in options:
            raise self._fail(dotted, f"one of {', '.join(options)}", v)
        return v

    def integer(self, dotted: str) -> int:
        v = self._get(dotted)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._fail(dotted, "an integer", v)
        if abs(v) > MAX_COUNT:
            raise self._fail(dotted, f"an integer of magnitude at most {MAX_COUNT:,}", v)
        return v

    def pos_int(self, dotted: str, maximum: int = MAX_COUNT) -> int:
        v = self.integer(dotted)
        if not 0 < v <= maximum:
            raise self._fail(dotted, f"a positive integer (at most {maximum:,})", v)
        return v

    def nonneg_int(self, dotted: str) -> int:
        v = self.integer(dotted)
        if v < 0:
            raise self._fail(dotted, "a non-negative integer", v)
        return v

    def pos_float(self, dotted: str) -> float:
        v = self._get(dotted)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not MIN_RATE <= v <= MAX_RATE:
            raise self._fail(dotted, f"a positive number from {MIN_RATE:g} to {MAX_RATE:g}", v)
        return float(v)

    def fraction(self, dotted: str) -> float:
        v = self._get(dotted)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise self._fail(dotted, "a number in (0, 1]", v)
        return float(v)

    def nonneg_float(self, dotted: str) -> float:
        v = self._get(dotted)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_RATE:
            raise self._fail(dotted, f"a number from 0 to {MAX_RATE:g}", v)
        return float(v)

    def check_no_unknown_keys(self) -> None:
        """A misspelt key would otherwise be ignored silently and its default never noticed."""
        for dotted in _leaf_keys(self.data):
            if dotted.endswith("_source"):
                continue
            if dotted not in self.used:
                raise TremulaError(f"{self.kind} {self.where}: unknown field '{dotted}' (check its spelling)")


def _leaf_keys(node: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in node.items():
        dotted = f"{prefix}{k}"
        if isinstance(v, dict):
            out.extend(_leaf_keys(v, dotted + "."))
        else:
            out.append(dotted)
    return out


# ---- the `tremula chips` table ------------------------------------------------------------------------------------


# The precision each chip_rows column is shown at; chip_rows rounds to it, so JSON and the table agree.
CHIP_ROW_FORMATS = {"SRAM/tile KiB": "g", "SRAM MiB": ".1f", "clock GHz": ".3f", "FP32 TFLOP/s": ".1f",
                    "FP16 TFLOP/s": ".1f", "FP8 TFLOP/s": ".1f", "exchange GB/s/tile": ".2f", "host GB/s": ".1f"}


def chip_rows(chips: list[Chip]) -> list[dict[str, str | int | float | None]]:
    """One row per chip: sizes, clock, matmul peaks (None where the chip lacks the type), bandwidths, as numbers
    rounded to the precision CHIP_ROW_FORMATS shows them at."""
    rows = []
    for c in chips:

        def shown(key: str, value: float) -> float:
            return float(format(value, CHIP_ROW_FORMATS[key]))

        def peak(d: str, c: Chip = c) -> float | None:
            return shown(f"{d.upper()} TFLOP/s", c.peak_flops(d) / 1e12) if c.supports(d) else None

        rows.append(
            {
                "name": c.name,
                "arch": c.arch,
                "tiles": c.tiles,
                "SRAM/tile KiB": shown("SRAM/tile KiB", c.sram_bytes_per_tile / 1024),
                "SRAM MiB": shown("SRAM MiB", c.total_sram_bytes / 2**20),
                "clock GHz": shown("clock GHz", c.clock_hz / 1e9),
                "FP32 TFLOP/s": peak("fp32"),
                "FP16 TFLOP/s": peak("fp16"),
                "FP8 TFLOP/s": peak("fp8"),
                "exchange GB/s/tile": shown("exchange GB/s/tile", c.exchange_bytes_per_second_per_tile / 1e9),
                "host GB/s": shown("host GB/s", c.host_bytes_per_second / 1e9),
            }
        )
    return rows


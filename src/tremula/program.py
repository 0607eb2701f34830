"""The Program: BSP steps (compute set, then exchange), host streams, the memory plan and weight images; saved as data.

Storage is columnar (NumPy arrays per step) because a big model has millions of vertices and transfers; `Vertex` and
`Transfer` are the row views of those tables. Every operand is a tile-local byte address plus a 2-D shape and dtype.

Weights are not stored in the file: a `ConstImage` names the graph constant and the 2-D block of it (rows r0:r1,
cols c0:c1 of the constant viewed as [rows, cols], in the program's dtype) that goes at (tile, addr). The simulator
materialises the bytes at load time from the Graph the Program was compiled from. So a Program file stays small; what
makes it stand alone is its `Provenance` (provenance.py): the chip's TOML text and its sha256, and the sha256 of the
weights it was compiled for, so `tremula run` can refuse another chip or other weights in one line.

FP8 is a dtype here as in the Graph: an FP8 operand or weight constant has its format's ml_dtypes name (FP8_DTYPES),
and tile memory holds one code byte an element (`storage_dtype`, how the simulator views it). Loading checks every FP8
operand's name against the format its codelet's parameters give (FP8_OPERANDS).

File format: one NPZ (zip of .npy entries written with fixed timestamps, so the same Program gives the same bytes)
holding `header.json` (a uint8 array of UTF-8 JSON) and flat arrays; read back with `np.load(allow_pickle=False)`.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tremula.errors import TremulaError
from tremula.numerics.fp8 import FP8_DTYPES, is_fp8

# 2: shared layers' steps are calls of a template step with a patch; a Provenance (chip TOML, chip and weights
# sha256); FP8 operands named by format. 3: FP8 weights hash with their FP8 dtype's name (provenance.WEIGHTS_HASH).
# 4: weight images may be streamed from the host (a ninth field: the step they arrive at). 5: attention vertices
# hold their scores in an operand of their own (codelets/attention.py).
FORMAT_VERSION = 5


@dataclass(frozen=True)
class Operand:
    addr: int
    shape: tuple[int, int]
    dtype: str


@dataclass(frozen=True)
class Vertex:
    """One codelet instance on one tile (a row of a VertexGroup)."""

    codelet: str
    tile: int
    params: tuple[int, ...]
    operands: tuple[Operand, ...]


@dataclass
class VertexGroup:
    """Vertices of one codelet in one compute set: vertex i runs on tiles[i] with params[i] and operands i."""

    codelet: str
    dtypes: tuple[str, ...]  # element type of each operand (same for every vertex of the group)
    tiles: np.ndarray  # int32 [n]
    params: np.ndarray  # int64 [n, P]
    addrs: np.ndarray  # int64 [n, A] tile-local byte addresses
    shapes: np.ndarray  # int64 [n, A, 2] each operand viewed as [rows, cols]

    def __len__(self) -> int:
        return len(self.tiles)

    def vertex(self, i: int) -> Vertex:
        ops = tuple(
            Operand(int(self.addrs[i, a]), (int(self.shapes[i, a, 0]), int(self.shapes[i, a, 1])), self.dtypes[a])
            for a in range(len(self.dtypes))
        )
        return Vertex(self.codelet, int(self.tiles[i]), tuple(int(p) for p in self.params[i]), ops)


@dataclass(frozen=True)
class Destination:
    tile: int
    addr: int
    stride: int


@dataclass(frozen=True)
class Origin:
    """What a step computes, as data (reports attribute steps by it, never by parsing labels): the graph node (the
    planner's key: its name, else its first output), its op, the value the step writes, and the phase of the op's
    lowering ("" for the op itself, or "partials", "reduce", "moments", "combine")."""

    node: str
    op: str
    value: str
    phase: str = ""


@dataclass(frozen=True)
class Transfer:
    """Copy `rows` rows of `row_bytes` bytes from src (rows `src_stride` apart) to every destination (multicast)."""

    src_tile: int
    src_addr: int
    rows: int
    row_bytes: int
    src_stride: int
    dsts: tuple[Destination, ...]


@dataclass
class TransferTable:
    """The transfers of one exchange, columnar; destinations of transfer i are d_*[dst_start[i]:dst_start[i+1]]."""

    src_tile: np.ndarray  # int32 [n]
    src_addr: np.ndarray  # int64 [n]
    rows: np.ndarray  # int64 [n]
    row_bytes: np.ndarray  # int64 [n]
    src_stride: np.ndarray  # int64 [n]
    dst_start: np.ndarray  # int64 [n + 1]
    d_tile: np.ndarray  # int32 [m]
    d_addr: np.ndarray  # int64 [m]
    d_stride: np.ndarray  # int64 [m]
    # bool [n] or None: sources read relative to the tile's weight base register (a shared layer's code sets the base
    # to its own weights before it runs; plan/share.py). Only the steps that shared layers call have it.
    based: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.src_tile)

    @staticmethod
    def empty() -> TransferTable:
        i32, i64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
        return TransferTable(i32, i64, i64, i64, i64, np.zeros(1, np.int64), i32, i64, i64)

    def transfer(self, i: int) -> Transfer:
        lo, hi = int(self.dst_start[i]), int(self.dst_start[i + 1])
        dsts = tuple(Destination(int(self.d_tile[j]), int(self.d_addr[j]), int(self.d_stride[j])) for j in range(lo, hi))
        return Transfer(int(self.src_tile[i]), int(self.src_addr[i]), int(self.rows[i]), int(self.row_bytes[i]),
                        int(self.src_stride[i]), dsts)

    def bytes_sent(self) -> np.ndarray:
        return self.rows * self.row_bytes

    def n_dests(self) -> np.ndarray:
        return np.diff(self.dst_start)


@dataclass
class FieldPatch:
    """The vertex fields one shared layer rewrites in one of its template's vertex groups: operand pointers (its own
    weights) and parameters (its own FP8 scales), one 32-bit word per field and vertex
    (target/overheads.PATCH_WORD_BYTES)."""

    addr_cols: np.ndarray  # int64 [fa] operand fields rewritten
    addrs: np.ndarray  # int64 [n, fa] their values in this layer
    param_cols: np.ndarray  # int64 [fp] parameter fields rewritten
    params: np.ndarray  # int64 [n, fp]

    @property
    def words(self) -> int:
        return len(self.addr_cols) + len(self.param_cols)

    def apply(self, g: VertexGroup) -> VertexGroup:
        """The group as this layer runs it (the template's own object when nothing is rewritten)."""
        if not self.words:
            return g
        addrs, params = g.addrs.copy(), g.params.copy()
        addrs[:, self.addr_cols] = self.addrs
        params[:, self.param_cols] = self.params
        return VertexGroup(g.codelet, g.dtypes, g.tiles, params, addrs, g.shapes)

    @staticmethod
    def none(n: int) -> FieldPatch:
        z = np.zeros(0, np.int64)
        return FieldPatch(z, np.zeros((n, 0), np.int64), z, np.zeros((n, 0), np.int64))


@dataclass
class Call:
    """A shared layer's step: it runs step `template`'s code (a step with code of its own) after rewriting the vertex
    fields of `fields` (one per template vertex group) and setting each tile's weight base to `base` (tiles
    `base_tiles`), which the template's `based` sources are read relative to."""

    template: int  # index of the template step in Program.steps
    fields: list[FieldPatch]
    base_tiles: np.ndarray  # int64 [k], ascending
    base: np.ndarray  # int64 [k] byte distance of this layer's weights from the template layer's, on that tile



class Step:
    """One BSP superstep: every tile runs its vertices, all tiles sync, then the exchange moves data.

    A step with a `call` holds no code of its own: its vertex groups and transfers are its template step's with the
    call's patch applied, made afresh on every access (so a corrupted template or patch is what runs)."""

    def __init__(self, compute: list[VertexGroup], exchange: TransferTable, label: str = "",
                 call: Call | None = None, template: Step | None = None, origin: Origin | None = None):
        self._compute, self._exchange, self.label, self.call, self._template = compute, exchange, label, call, template
        self.origin = origin  # None: an exchange-only step (a re-layout for the next step)
        if call is not None:
            if template is None or template.call is not None:
                raise TremulaError("a shared layer's step must call a step that has code of its own")
            if len(call.fields) != len(template.compute):
                raise TremulaError("a call must patch each vertex group of its template step")

    @property
    def template(self) -> Step | None:
        return self._template

    def patch_words(self, tiles: int) -> np.ndarray:
        """Vertex fields a call rewrites on each tile before the template's code runs (zeros for other steps)."""
        words = np.zeros(tiles, np.int64)
        if self.call is not None:
            for f, g in zip(self.call.fields, self._template.compute):  # type: ignore[union-attr]
                words += np.bincount(g.tiles, minlength=tiles).astype(np.int64) * f.words
        return words

    def base_tiles(self, tiles: int) -> np.ndarray:
        """bool [tiles]: tiles whose weight base a call sets (they send from the template's weight-based sources)."""
        on = np.zeros(tiles, bool)
        if self.call is not None:
            t = self._template.exchange  # type: ignore[union-attr]
            if t.based is not None:
                on[t.src_tile[t.based]] = True
        return on

    @property
    def compute(self) -> list[VertexGroup]:
        if self.call is None:
            return self._compute
        return [f.apply(g) for f, g in zip(self.call.fields, self._template.compute)]  # type: ignore[union-attr]

    @compute.setter
    def compute(self, groups: list[VertexGroup]) -> None:
        if self.call is not None:
            raise TremulaError("a shared layer's step runs its template's code: change the template or the patch")
        self._compute = groups

    @property
    def exchange(self) -> TransferTable:
        if self.call is None:
            return self._exchange
        t = self._template.exchange  # type: ignore[union-attr]
        if t.based is None or not t.based.any():
            return t
        src = t.src_tile[t.based].astype(np.int64)
        pos = np.searchsorted(self.call.base_tiles, src)
        if (pos >= len(self.call.base_tiles)).any() or (self.call.base_tiles[np.minimum(pos, len(self.call.base_tiles) - 1)] != src).any():
            raise TremulaError(f"step {self.label}: a weight-based transfer's tile has no weight base in this call")
        addr = t.src_addr.copy()
        addr[t.based] += self.call.base[pos]
        return TransferTable(t.src_tile, addr, t.rows, t.row_bytes, t.src_stride, t.dst_start, t.d_tile, t.d_addr,
                             t.d_stride)

    @exchange.setter
    def exchange(self, table: TransferTable) -> None:
        if self.call is not None:
            raise TremulaError("a shared layer's step runs its template's code: change the template or the patch")
        self._exchange = table

    def vertices(self) -> Iterator[Vertex]:
        for g in self.compute:
            for i in range(len(g)):
                yield g.vertex(i)


@dataclass(frozen=True)
class HostStream:
    """Elements [elem_offset, elem_offset + rows*cols) of a graph input/output, in `rows` runs of `cols` elements;
    run r starts at element elem_offset + r*elem_stride and lives at tile address addr + r*cols*itemsize."""

    name: str
    tile: int
    addr: int
    elem_offset: int
    rows: int
    cols: int
    elem_stride: int
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * np.dtype(self.dtype).itemsize


def host_stream_bytes(streams: list[HostStream]) -> int:
    """Bytes the host link carries for these streams: each stream's runs once per tile it writes (or reads), since
    every tile's copy is its own transfer over the link; an element streamed to two tiles crosses it twice."""
    return sum(s.nbytes for s in streams)


@dataclass(frozen=True)
class ConstImage:
    """Block [r0:r1, c0:c1] of constant `name` (viewed 2-D as [rows, cols], cast to dtype) stored row-major at addr:
    loaded with the Program (step -1), or streamed from host memory on every run, arriving before the compute of
    `step` (plan/stream.py)."""

    name: str
    tile: int
    addr: int
    r0: int
    r1: int
    c0: int
    c1: int
    dtype: str
    step: int = -1

    @property
    def nbytes(self) -> int:
        return (self.r1 - self.r0) * (self.c1 - self.c0) * storage_dtype(self.dtype).itemsize


def streamed_weight_bytes(consts: list[ConstImage]) -> int:
    """Bytes of weights the host link carries on every run (the streamed blocks, once per tile they go to)."""
    return sum(c.nbytes for c in consts if c.step >= 0)


@dataclass
class BufferTable:
    """The memory plan: buffer b lives on tiles b_tiles[tile_start[b]:tile_start[b+1]], at b_addr with b_size bytes
    on each, for half-steps first[b]..last[b] (2*step = compute of step, 2*step+1 = its exchange; weights always,
    first = -1, except streamed weights: from the compute of the step they arrive at)."""

    names: list[str]
    category: list[str]  # weights | activations | buffers
    first: np.ndarray  # int64 [n]
    last: np.ndarray  # int64 [n]
    tile_start: np.ndarray  # int64 [n + 1]
    b_tiles: np.ndarray  # int32 [m]
    b_addr: np.ndarray  # int64 [m]
    b_size: np.ndarray  # int64 [m]


# Codelet -> {operand index: params column holding that operand's FP8 format id} (codelets/fp8.py's param layouts).
FP8_OPERANDS: dict[str, dict[int, int]] = {"fp8_cast": {1: 0}, "matmul_fp8": {0: 1, 1: 2}}


def storage_dtype(name: str) -> np.dtype:
    """The NumPy type an element of dtype `name` is stored as in tile memory: an FP8 format's code byte (uint8), else
    the type itself."""
    return np.dtype(np.uint8) if is_fp8(name) else np.dtype(name)


def _checked_dtypes(codelet: str, names: list[str], params: np.ndarray) -> tuple[str, ...]:
    """A group's operand dtypes from the file, refused (ValueError: a damaged file) when one is not a type, or an FP8
    one is on an operand that is not FP8 or disagrees with the format its params give."""
    fp8 = FP8_OPERANDS.get(codelet, {})
    for a, name in enumerate(names):
        np.dtype(name)  # an unknown name is a TypeError: a damaged file
        if is_fp8(name):
            if a not in fp8:
                raise ValueError(f"{codelet} operand {a} is named {name}, but it is not an FP8 operand")
            if len(params) and not (params[:, fp8[a]] == FP8_DTYPES.index(name)).all():
                raise ValueError(f"{codelet} operand {a} is named {name}, but its vertices' format ids differ")
    return tuple(names)


@dataclass
class Provenance:
    """What a saved Program carries to load and run alone (provenance.seal fills it; empty until then).

    `run` rebuilds the planned graph from the model (canonical + precision lowering at `seq_len`, with `fp8_scales`
    set on the activation casts, no planning), refuses it unless its weights hash to `weights_sha256`, and refuses a
    --chip whose TOML text does not hash to `chip_sha256`."""

    chip_toml: str = ""  # the chip description, the TOML text it was loaded from
    chip_sha256: str = ""  # sha256 (hex) of chip_toml's UTF-8 bytes
    weights_sha256: str = ""  # provenance.weights_sha256 of the planned graph's constants this Program reads
    seq_len: int | None = None  # the --seq-len compiled with (None: the model's own)
    fp8_scales: dict[str, int] = field(default_factory=dict)  # activation cast node name -> its power-of-two scale

    @property
    def sealed(self) -> bool:
        return bool(self.chip_sha256 and self.weights_sha256)

    def to_json(self) -> dict:
        return {"chip_toml": self.chip_toml, "chip_sha256": self.chip_sha256, "weights_sha256": self.weights_sha256,
                "seq_len": self.seq_len, "fp8_scales": dict(sorted(self.fp8_scales.items()))}

    @staticmethod
    def from_json(d: dict) -> Provenance:
        seq = d["seq_len"]
        if seq is not None and (not isinstance(seq, int) or seq < 1):
            raise ValueError(f"seq_len {seq!r} is not a positive integer")
        scales = {str(k): int(v) for k, v in d["fp8_scales"].items()}
        return Provenance(str(d["chip_toml"]), str(d["chip_sha256"]), str(d["weights_sha256"]), seq, scales)


@dataclass
class Program:
    chip: str
    tiles: int
    sram_bytes_per_tile: int
    dtype: str  # element type of the program: float32, float16 or fp8 (FP8 Linear operands, float16 elsewhere)
    batch: int
    steps: list[Step]
    host_in: list[HostStream]
    host_out: list[HostStream]
    consts: list[ConstImage]
    buffers: BufferTable
    io_types: dict[str, tuple[tuple[int, ...], str]]  # graph input/output name -> (shape, dtype)
    reserved_bytes: np.ndarray  # int64 [tiles] code + vertex state + exchange code (top of each tile's SRAM)
    meta: dict = field(default_factory=dict)  # plan summary: cycles, memory by category, strategies (JSON-able)
    # reserved_bytes by category (code, vertex_state, exchange_code): what the memory plan reserved; the Program's
    # own count (target/overheads.reserved_bytes of its steps) never exceeds it, which compiling checks
    reserved_split: dict = field(default_factory=dict)
    # what the file carries to stand alone: chip TOML and hashes, how to rebuild the planned graph (provenance.py)
    provenance: Provenance = field(default_factory=Provenance)

    @property
    def shared_steps(self) -> np.ndarray:
        """Steps that run another step's code (a layer calling its template layer's code)."""
        return np.array([k for k, s in enumerate(self.steps) if s.call is not None], np.int64)

    def n_vertices(self) -> int:
        return sum(len(g) for s in self.steps for g in s.compute)

    def n_transfers(self) -> int:
        return sum(len(s.exchange) for s in self.steps)


# ------------------------------------------------------------------------------------------------ save / load

_GROUP_ARRAYS = ("tiles", "params", "addrs", "shapes")
_TT_ARRAYS = ("src_tile", "src_addr", "rows", "row_bytes", "src_stride", "dst_start", "d_tile", "d_addr", "d_stride")
_BT_ARRAYS = ("first", "last", "tile_start", "b_tiles", "b_addr", "b_size")


def _cat(parts: list[np.ndarray], dtype, width: tuple[int, ...] = ()) -> np.ndarray:
    if not parts:
        return np.zeros((0,) + width, dtype)
    return np.ascontiguousarray(np.concatenate([np.asarray(p, dtype).reshape((-1,) + width) for p in parts]))


def _stream_dict(s: HostStream) -> dict:
    return {k: getattr(s, k) for k in HostStream.__dataclass_fields__}


def _json_number(o: object) -> int | float:
    """NumPy scalars in the header (a constant's tile or address, a shape taken from an array) as JSON numbers."""
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    raise TypeError(f"{type(o).__name__} in a Program header is not JSON data")


_CALL_ARRAYS = ("addr_cols", "addrs", "param_cols", "params", "base_tiles", "base", "based")


def _save_call(c: Call, parts: dict[str, list[np.ndarray]]) -> dict:
    for f in c.fields:
        for k in ("addr_cols", "addrs", "param_cols", "params"):
            parts[k].append(np.asarray(getattr(f, k)).reshape(-1))
    parts["base_tiles"].append(c.base_tiles)
    parts["base"].append(c.base)
    return {"template": c.template, "fields": [[len(f.addr_cols), len(f.param_cols)] for f in c.fields],
            "n_base": len(c.base_tiles)}


def _load_call(cm: dict, template: Step, c: dict[str, np.ndarray], cur: dict[str, int]) -> Call:
    def take(k: str, n: int) -> np.ndarray:
        a = c[k][cur[k]: cur[k] + n]
        if len(a) != n:
            raise ValueError(f"call table {k} is short")
        cur[k] += n
        return a.astype(np.int64)

    fields = []
    for (fa, fp), g in zip(cm["fields"], template.compute):
        n = len(g)
        fields.append(FieldPatch(take("addr_cols", fa), take("addrs", n * fa).reshape(n, fa),
                                 take("param_cols", fp), take("params", n * fp).reshape(n, fp)))
    return Call(cm["template"], fields, take("base_tiles", cm["n_base"]), take("base", cm["n_base"]))


def _save_origin(o: Origin | None) -> list[str] | None:
    return None if o is None else [o.node, o.op, o.value, o.phase]


def _load_origin(sm: dict) -> Origin | None:
    o = sm.get("origin")  # (files written before steps carried origins have none)
    if o is None:
        return None
    if not (isinstance(o, list) and len(o) == 4 and all(isinstance(x, str) for x in o)):
        raise TremulaError(f"not a tremula program: step {sm.get('label')!r} has a malformed origin")
    return Origin(*o)


def save_program(program: Program, path: str | Path) -> None:
    """Write the Program to one file; the same Program always gives the same bytes."""
    groups_meta, steps_meta = [], []
    gparts: dict[str, list[np.ndarray]] = {k: [] for k in _GROUP_ARRAYS}
    tparts: dict[str, list[np.ndarray]] = {k: [] for k in _TT_ARRAYS}
    cparts: dict[str, list[np.ndarray]] = {k: [] for k in _CALL_ARRAYS}
    for s in program.steps:
        if s.call is not None:  # a shared layer's step: only what differs from its template
            steps_meta.append({"label": s.label, "origin": _save_origin(s.origin),
                               "call": _save_call(s.call, cparts)})
            continue
        gids = []
        for g in s.compute:
            gids.append(len(groups_meta))
            groups_meta.append({"codelet": g.codelet, "dtypes": list(g.dtypes), "n": len(g),
                                "n_params": int(g.params.shape[1]), "n_ops": len(g.dtypes)})
            for k in _GROUP_ARRAYS:
                gparts[k].append(np.asarray(getattr(g, k)).reshape(-1))
        ex = s.exchange
        steps_meta.append({"label": s.label, "origin": _save_origin(s.origin), "groups": gids, "n_transfers": len(ex),
                           "n_dests": len(ex.d_tile), "based": ex.based is not None})
        for k in _TT_ARRAYS:
            a = getattr(ex, k)
            tparts[k].append(a[1:] if k == "dst_start" else a)  # per-step dst_start rebuilt from counts at load
        if ex.based is not None:
            cparts["based"].append(ex.based)
    header = {
        "format": "tremula-program", "version": FORMAT_VERSION, "chip": program.chip, "tiles": program.tiles,
        "sram_bytes_per_tile": program.sram_bytes_per_tile, "dtype": program.dtype, "batch": program.batch,
        "steps": steps_meta, "groups": groups_meta,
        "host_in": [_stream_dict(s) for s in program.host_in], "host_out": [_stream_dict(s) for s in program.host_out],
        "consts": [[c.name, c.tile, c.addr, c.r0, c.r1, c.c0, c.c1, c.dtype, c.step] for c in program.consts],
        "buffers": {"names": program.buffers.names, "category": program.buffers.category},
        "io_types": {k: [list(v[0]), v[1]] for k, v in sorted(program.io_types.items())},
        "meta": program.meta,
        "provenance": program.provenance.to_json(),
    }
    text = json.dumps(header, sort_keys=True, default=_json_number)
    arrays: dict[str, np.ndarray] = {"header.json": np.frombuffer(text.encode(), np.uint8)}
    for k in _GROUP_ARRAYS:
        arrays[f"g_{k}"] = _cat(gparts[k], np.int64)
    for k in _TT_ARRAYS:
        arrays[f"t_{k}"] = _cat(tparts[k], np.int64)
    for k in _BT_ARRAYS:
        arrays[f"b_{k}"] = np.ascontiguousarray(np.asarray(getattr(program.buffers, k), np.int64))
    for k in _CALL_ARRAYS:
        arrays[f"c_{k}"] = _cat(cparts[k], np.int64)
    arrays["reserved_bytes"] = np.ascontiguousarray(np.asarray(program.reserved_bytes, np.int64))
    for k, v in program.reserved_split.items():
        arrays[f"reserved_{k}"] = np.ascontiguousarray(np.asarray(v, np.int64))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name in sorted(arrays):
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            buf = io.BytesIO()
            np.lib.format.write_array(buf, arrays[name], allow_pickle=False)
            z.writestr(info, buf.getvalue())


def load_program(path: str | Path) -> Program:
    """Read a Program file written by save_program; anything else fails with a one-line TremulaError."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        header = json.loads(bytes(arrays.pop("header.json")).decode())
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise TremulaError(f"cannot read program file {path}: {e}; recompile it with `tremula compile`") from None
    if not isinstance(header, dict) or header.get("format") != "tremula-program" \
            or header.get("version") != FORMAT_VERSION:
        raise TremulaError(f"{path} is not a tremula program file of version {FORMAT_VERSION}; recompile it")
    try:
        return _from_arrays(header, arrays)
    except (KeyError, ValueError, IndexError, TypeError) as e:
        raise TremulaError(f"program file {path} is damaged ({e}); recompile it") from None


def _load_consts(rows: list) -> list[ConstImage]:
    consts = []
    for name, tile, addr, r0, r1, c0, c1, dtype, step in rows:
        np.dtype(dtype)  # an unknown type name is a damaged file (TypeError), not a failure deep in the simulator
        consts.append(ConstImage(name, tile, addr, r0, r1, c0, c1, dtype, int(step)))
    return consts


def _from_arrays(header: dict, arrays: dict[str, np.ndarray]) -> Program:
    groups = []
    cursor = {k: 0 for k in _GROUP_ARRAYS}
    for gm in header["groups"]:
        n, p, a = gm["n"], gm["n_params"], gm["n_ops"]
        sizes = {"tiles": n, "params": n * p, "addrs": n * a, "shapes": n * a * 2}
        shapes = {"tiles": (n,), "params": (n, p), "addrs": (n, a), "shapes": (n, a, 2)}
        part = {}
        for k in _GROUP_ARRAYS:
            flat = arrays[f"g_{k}"][cursor[k]: cursor[k] + sizes[k]]
            part[k] = flat.reshape(shapes[k]).astype(np.int32 if k == "tiles" else np.int64)
            cursor[k] += sizes[k]
        groups.append(VertexGroup(gm["codelet"], _checked_dtypes(gm["codelet"], gm["dtypes"], part["params"]),
                                  part["tiles"], part["params"], part["addrs"], part["shapes"]))
    steps = []
    tc, dc = 0, 0
    t = {k: arrays[f"t_{k}"] for k in _TT_ARRAYS}
    calls = {k: arrays[f"c_{k}"] for k in _CALL_ARRAYS}
    ccur = {k: 0 for k in _CALL_ARRAYS}

    def take_based(n: int) -> np.ndarray:
        a = calls["based"][ccur["based"]: ccur["based"] + n]
        ccur["based"] += n
        return a.astype(bool)

    for sm in header["steps"]:
        if "call" in sm:
            tmpl = steps[sm["call"]["template"]]
            steps.append(Step([], TransferTable.empty(), sm["label"], _load_call(sm["call"], tmpl, calls, ccur), tmpl,
                              _load_origin(sm)))
            continue
        n, m = sm["n_transfers"], sm["n_dests"]
        starts = np.concatenate([[0], t["dst_start"][tc: tc + n]]).astype(np.int64)  # stored per step, relative
        ex = TransferTable(
            t["src_tile"][tc: tc + n].astype(np.int32), t["src_addr"][tc: tc + n], t["rows"][tc: tc + n],
            t["row_bytes"][tc: tc + n], t["src_stride"][tc: tc + n], starts,
            t["d_tile"][dc: dc + m].astype(np.int32), t["d_addr"][dc: dc + m], t["d_stride"][dc: dc + m],
        )
        if sm.get("based"):
            ex.based = take_based(n)
        tc, dc = tc + n, dc + m
        steps.append(Step([groups[i] for i in sm["groups"]], ex, sm["label"], origin=_load_origin(sm)))
    bt = BufferTable(header["buffers"]["names"], header["buffers"]["category"],
                     *[arrays[f"b_{k}"] for k in _BT_ARRAYS])
    bt.b_tiles = bt.b_tiles.astype(np.int32)
    consts = _load_consts(header["consts"])
    if any(not -1 <= c.step < len(steps) for c in consts):
        raise ValueError("a weight image arrives at a step the program does not have")
    return Program(
        chip=header["chip"], tiles=header["tiles"], sram_bytes_per_tile=header["sram_bytes_per_tile"],
        dtype=header["dtype"], batch=header["batch"], steps=steps,
        host_in=[HostStream(**d) for d in header["host_in"]], host_out=[HostStream(**d) for d in header["host_out"]],
        consts=consts, buffers=bt, provenance=Provenance.from_json(header["provenance"]),
        io_types={k: (tuple(v[0]), v[1]) for k, v in header["io_types"].items()},
        reserved_bytes=arrays["reserved_bytes"], meta=header["meta"],
        reserved_split={k[len("reserved_"):]: v for k, v in arrays.items() if k.startswith("reserved_")
                        and k != "reserved_bytes"},
    )

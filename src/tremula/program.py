"""The Program: BSP steps (compute set, then exchange), host streams, the memory plan and weight images; saved as data.

Storage is columnar (NumPy arrays per step) because a big model has millions of vertices and transfers; `Vertex` and
`Transfer` are the row views of those tables. Every operand is a tile-local byte address plus a 2-D shape and dtype.

Weights are not stored in the file: a `ConstImage` names the graph constant and the 2-D block of it (rows r0:r1,
cols c0:c1 of the constant viewed as [rows, cols], in the program's dtype) that goes at (tile, addr). The simulator
materialises the bytes at load time from the Graph the Program was compiled from. So a Program file stays small.

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

FORMAT_VERSION = 1


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
class Step:
    """One BSP superstep: every tile runs its vertices, all tiles sync, then the exchange moves data."""

    compute: list[VertexGroup]
    exchange: TransferTable
    label: str = ""

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
    """Block [r0:r1, c0:c1] of constant `name` (viewed 2-D as [rows, cols], cast to dtype) stored row-major at addr."""

    name: str
    tile: int
    addr: int
    r0: int
    r1: int
    c0: int
    c1: int
    dtype: str


@dataclass
class BufferTable:
    """The memory plan: buffer b lives on tiles b_tiles[tile_start[b]:tile_start[b+1]], at b_addr with b_size bytes
    on each, for half-steps first[b]..last[b] (2*step = compute of step, 2*step+1 = its exchange; weights always)."""

    names: list[str]
    category: list[str]  # weights | activations | buffers
    first: np.ndarray  # int64 [n]
    last: np.ndarray  # int64 [n]
    tile_start: np.ndarray  # int64 [n + 1]
    b_tiles: np.ndarray  # int32 [m]
    b_addr: np.ndarray  # int64 [m]
    b_size: np.ndarray  # int64 [m]


@dataclass
class Program:
    chip: str
    tiles: int
    sram_bytes_per_tile: int
    dtype: str  # float element type of the program: float32 or float16
    batch: int
    steps: list[Step]
    host_in: list[HostStream]
    host_out: list[HostStream]
    consts: list[ConstImage]
    buffers: BufferTable
    io_types: dict[str, tuple[tuple[int, ...], str]]  # graph input/output name -> (shape, dtype)
    reserved_bytes: np.ndarray  # int64 [tiles] code + vertex state + exchange code (top of each tile's SRAM)
    meta: dict = field(default_factory=dict)  # plan summary: cycles, memory by category, strategies (JSON-able)
    # reserved_bytes by category (code, vertex_state, exchange_code): what the memory plan counted, which the steps
    # alone cannot tell when layers share code (plan/share.py)
    reserved_split: dict = field(default_factory=dict)
    # steps whose vertex state and exchange code are another step's (a layer running its template layer's code)
    shared_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

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


def save_program(program: Program, path: str | Path) -> None:
    """Write the Program to one file; the same Program always gives the same bytes."""
    groups_meta, steps_meta = [], []
    gparts: dict[str, list[np.ndarray]] = {k: [] for k in _GROUP_ARRAYS}
    tparts: dict[str, list[np.ndarray]] = {k: [] for k in _TT_ARRAYS}
    for s in program.steps:
        gids = []
        for g in s.compute:
            gids.append(len(groups_meta))
            groups_meta.append({"codelet": g.codelet, "dtypes": list(g.dtypes), "n": len(g),
                                "n_params": int(g.params.shape[1]), "n_ops": len(g.dtypes)})
            for k in _GROUP_ARRAYS:
                gparts[k].append(np.asarray(getattr(g, k)).reshape(-1))
        ex = s.exchange
        steps_meta.append({"label": s.label, "groups": gids, "n_transfers": len(ex), "n_dests": len(ex.d_tile)})
        for k in _TT_ARRAYS:
            a = getattr(ex, k)
            tparts[k].append(a[1:] if k == "dst_start" else a)  # per-step dst_start rebuilt from counts at load
    header = {
        "format": "tremula-program", "version": FORMAT_VERSION, "chip": program.chip, "tiles": program.tiles,
        "sram_bytes_per_tile": program.sram_bytes_per_tile, "dtype": program.dtype, "batch": program.batch,
        "steps": steps_meta, "groups": groups_meta,
        "host_in": [_stream_dict(s) for s in program.host_in], "host_out": [_stream_dict(s) for s in program.host_out],
        "consts": [[c.name, c.tile, c.addr, c.r0, c.r1, c.c0, c.c1, c.dtype] for c in program.consts],
        "buffers": {"names": program.buffers.names, "category": program.buffers.category},
        "io_types": {k: [list(v[0]), v[1]] for k, v in sorted(program.io_types.items())},
        "meta": program.meta,
    }
    text = json.dumps(header, sort_keys=True, default=_json_number)
    arrays: dict[str, np.ndarray] = {"header.json": np.frombuffer(text.encode(), np.uint8)}
    for k in _GROUP_ARRAYS:
        arrays[f"g_{k}"] = _cat(gparts[k], np.int64)
    for k in _TT_ARRAYS:
        arrays[f"t_{k}"] = _cat(tparts[k], np.int64)
    for k in _BT_ARRAYS:
        arrays[f"b_{k}"] = np.ascontiguousarray(np.asarray(getattr(program.buffers, k), np.int64))
    arrays["reserved_bytes"] = np.ascontiguousarray(np.asarray(program.reserved_bytes, np.int64))
    arrays["shared_steps"] = np.ascontiguousarray(np.asarray(program.shared_steps, np.int64))
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
    if header.get("format") != "tremula-program" or header.get("version") != FORMAT_VERSION:
        raise TremulaError(f"{path} is not a tremula program file of version {FORMAT_VERSION}; recompile it")
    try:
        return _from_arrays(header, arrays)
    except (KeyError, ValueError, IndexError, TypeError) as e:
        raise TremulaError(f"program file {path} is damaged ({e}); recompile it") from None


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
        groups.append(VertexGroup(gm["codelet"], tuple(gm["dtypes"]), part["tiles"], part["params"], part["addrs"],
                                  part["shapes"]))
    steps = []
    tc, dc = 0, 0
    t = {k: arrays[f"t_{k}"] for k in _TT_ARRAYS}
    for sm in header["steps"]:
        n, m = sm["n_transfers"], sm["n_dests"]
        starts = np.concatenate([[0], t["dst_start"][tc: tc + n]]).astype(np.int64)  # stored per step, relative
        ex = TransferTable(
            t["src_tile"][tc: tc + n].astype(np.int32), t["src_addr"][tc: tc + n], t["rows"][tc: tc + n],
            t["row_bytes"][tc: tc + n], t["src_stride"][tc: tc + n], starts,
            t["d_tile"][dc: dc + m].astype(np.int32), t["d_addr"][dc: dc + m], t["d_stride"][dc: dc + m],
        )
        tc, dc = tc + n, dc + m
        steps.append(Step([groups[i] for i in sm["groups"]], ex, sm["label"]))
    bt = BufferTable(header["buffers"]["names"], header["buffers"]["category"],
                     *[arrays[f"b_{k}"] for k in _BT_ARRAYS])
    bt.b_tiles = bt.b_tiles.astype(np.int32)
    return Program(
        chip=header["chip"], tiles=header["tiles"], sram_bytes_per_tile=header["sram_bytes_per_tile"],
        dtype=header["dtype"], batch=header["batch"], steps=steps,
        host_in=[HostStream(**d) for d in header["host_in"]], host_out=[HostStream(**d) for d in header["host_out"]],
        consts=[ConstImage(*c) for c in header["consts"]], buffers=bt,
        io_types={k: (tuple(v[0]), v[1]) for k, v in header["io_types"].items()},
        reserved_bytes=arrays["reserved_bytes"], meta=header["meta"],
        reserved_split={k[len("reserved_"):]: v for k, v in arrays.items() if k.startswith("reserved_")
                        and k != "reserved_bytes"},
        shared_steps=arrays.get("shared_steps", np.zeros(0, np.int64)),
    )

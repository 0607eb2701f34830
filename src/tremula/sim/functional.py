"""The functional simulator: executes a Program on tile SRAM held as bytes; it never evaluates a Graph op.

Memory is one uint8 array [tiles, bytes]; a vertex sees its own tile's bytes at the addresses the Program gives; data
crosses tiles only through the exchange's transfers. Weights are materialised at load time from the Graph's constants
(a Program stores references, see program.py); weights streamed from the host (plan/stream.py) at the step they arrive
at, and in check mode forgotten again after their last reader.

Execution is vectorised: the vertices of a group whose operand shapes (and code-path params) agree run as one stack.
Each operand of the stack is gathered from the tiles' bytes with one fancy index (a window of the operand's bytes at
every vertex's tile * SRAM + address), the codelet runs once on the stacked blocks and the outputs are scattered back
the same way. An exchange copies all its rows of one length with one gather and one scatter. With numba (the `fast`
extra) these byte moves and the written map's checks run as compiled loops instead (sim/moves.py: each transfer row
straight to its destinations), the same bytes.

Check mode keeps a shadow "written" bitmap (one bit per byte), and fails with SimCheckError on: reading bytes nothing
wrote (vertex operand, transfer source, host output), two vertices (or two transfers) writing overlapping bytes in one
step, a vertex reading bytes another vertex of the same compute set writes (a read-after-write race: on the chip they
run in parallel), and an exchange reading bytes the same exchange writes. A step's rules are checked before it moves
a byte, over all its ranges at once (the map over their union in address order), and its writes marked after. In
both modes an address outside the tile's SRAM or outside every planned buffer fails. Memory starts as zeros (pages
the program never touches cost nothing); in check mode no unwritten byte is ever read, so its value cannot matter. A
codelet's output buffers start as a poison pattern, so a byte a codelet forgot to write shows as a wrong but finite
value.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import numpy as np
from numpy.lib.stride_tricks import as_strided

from tremula.codelets import Codelet, codelet
from tremula.codelets.embed import IndexOutOfRange
from tremula.errors import TremulaError
from tremula.ir.graph import Graph
from tremula.program import Program, VertexGroup, storage_dtype
from tremula.sim import moves
from tremula.sorting import positions_in_runs

# As float32 0xA5A5A5A5 is -2.9e-16, as float16 0xA5A5 is -0.022: wrong but finite, so reads must be caught.
POISON = 0xA5
CHUNK_BYTES = 1 << 24  # bytes gathered per vectorised batch (bounds the temporaries of a big step)
BIG_BLOCK = 1 << 14  # weight blocks this big are copied one by one (a slice copy beats a gather and a scatter)
WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
ONES = {w: (1 << (8 * w)) - 1 for w in WORDS}  # a word of the written map with all its bytes' bits set
_NO_EDGES = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint8))


class SimCheckError(TremulaError):
    """The simulated program broke a rule (unwritten read, out of bounds, overlapping writes)."""


def _sorted_rows(tile: np.ndarray, start: np.ndarray, nbytes: np.ndarray, flag: np.ndarray | None = None):
    """(tile, start, end, flag) of byte ranges sorted by tile and start. One packed int64 key per range (tile, start,
    length, flag bit fields) sorts several times faster than a lexsort of the columns (and int64 throughout, no
    unsigned copies of the columns: the fields fit in 63 bits for any real SRAM)."""
    a_bits = max(int(start.max(initial=0)), int(nbytes.max(initial=0))).bit_length()
    if int(tile.max(initial=0)).bit_length() + 2 * a_bits + 1 > 63:  # (never for real SRAM sizes)
        flag = np.zeros(len(tile), bool) if flag is None else flag
        order = np.lexsort((start, tile))
        return tile[order], start[order], start[order] + nbytes[order], flag[order]
    sh_t, sh_s, mask = 2 * a_bits + 1, a_bits + 1, (1 << a_bits) - 1
    key = (np.asarray(tile, np.int64) << sh_t) | (np.asarray(start, np.int64) << sh_s) \
        | (np.asarray(nbytes, np.int64) << 1)
    if flag is not None:
        key |= flag
    key.sort()
    s = (key >> sh_s) & mask
    e = s + ((key >> 1) & mask)
    return key >> sh_t, s, e, (key & 1).astype(bool)


def _first_overlap(t: np.ndarray, s: np.ndarray, e: np.ndarray) -> tuple[int, int] | None:
    """(tile, start) of a byte range overlapping an earlier one (in address order) on the same tile, else None; the
    ranges (tile, start, end) come sorted by tile and start (_sorted_rows)."""
    if len(t) < 2:
        return None
    # Running max of ends within each tile (tiles are sorted, so offset by tile to keep groups apart).
    span = int(e.max()) + 1
    run = np.maximum.accumulate(e + t * span) - t * span
    bad = np.flatnonzero((t[1:] == t[:-1]) & (s[1:] < run[:-1]))
    return (int(t[bad[0] + 1]), int(s[bad[0] + 1])) if len(bad) else None


def _union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the union of byte ranges [start, end) sorted by start: ranges that overlap or touch become
    one. The written map is checked and marked over these, in address order, instead of row by row in the order the
    rows are copied: an exchange's rows land all over the tiles, so row by row every map access missed the cache
    (vit-base b1 fp32: 0.8 s of its exchanges' 1.4 s)."""
    if not len(start):
        return start, start
    run = np.maximum.accumulate(end)
    first = np.flatnonzero(np.concatenate([[True], start[1:] > run[:-1]]))
    last = np.append(first[1:] - 1, len(start) - 1)
    return start[first], run[last] - start[first]


def _read_of_other_write(wt: np.ndarray, ws: np.ndarray, wl: np.ndarray, wv: np.ndarray, rt: np.ndarray,
                         rs: np.ndarray, rl: np.ndarray, rv: np.ndarray) -> tuple[int, int] | None:
    """(tile, byte) where a read range overlaps a write range of another vertex, else None. The vertices of one
    compute set run in parallel on the chip, so such a read sees the old or the new bytes by chance (the simulator,
    running groups in order, would silently give one answer). A vertex may read what it writes itself. The write
    ranges do not overlap each other (checked before), so sorted by start their ends are sorted too, and the writes
    a read overlaps are one run of them, found with two binary searches."""
    keep_w, keep_r = wl > 0, rl > 0
    wt, ws, wl, wv = wt[keep_w], ws[keep_w], wl[keep_w], wv[keep_w]
    rt, rs, rl, rv = rt[keep_r], rs[keep_r], rl[keep_r], rv[keep_r]
    if not len(wt) or not len(rt):
        return None
    span = int(max((ws + wl).max(), (rs + rl).max())) + 1  # tile * span + address: one sorted key across tiles
    wkey = wt * span + ws
    order = np.argsort(wkey, kind="stable")
    w0, w1, wv = wkey[order], wkey[order] + wl[order], wv[order]
    r0 = rt * span + rs
    lo = np.searchsorted(w1, r0, side="right")  # first write ending after the read starts
    hi = np.searchsorted(w0, r0 + rl, side="left")  # writes starting before the read ends
    n = hi - lo
    one = np.flatnonzero((n == 1) & (wv[np.minimum(lo, len(wv) - 1)] != rv))
    many = [int(i) for i in np.flatnonzero(n > 1) if (wv[lo[i]:hi[i]] != rv[i]).any()]
    bad = sorted(set(one.tolist()) | set(many))
    if not bad:
        return None
    i = bad[0]
    return int(rt[i]), int(rs[i])


def _by_value(nbytes: np.ndarray) -> list[np.ndarray]:
    """Indices of the rows grouped by equal value (a row length, or a block shape as one key), each group in its
    original order. An exchange has few distinct lengths: a mask per length is cheaper than sorting millions of
    rows; many lengths (timetable pieces) fall back to one sort."""
    groups, rest = [], np.arange(len(nbytes))
    for _ in range(8):
        if not len(rest):
            return groups
        same = nbytes[rest] == nbytes[rest[0]]
        groups.append(rest[same])
        rest = rest[~same]
    if len(rest):
        order = rest[np.argsort(nbytes[rest], kind="stable")]
        vals = nbytes[order]
        groups.extend(np.split(order, np.flatnonzero(vals[1:] != vals[:-1]) + 1))
    return groups


def _spans(starts: np.ndarray, nbytes: int):
    """The bits of the written map (one bit per byte, 8 to a map byte) that the byte rows [start, start + nbytes)
    cover: ([(rows, first map byte of each, map bytes per row)] for whole map bytes, grouped by start % 8 so the count
    is one per group, and (row, map byte, bit mask) of the partly covered map bytes at the rows' ends)."""
    if nbytes == 0:
        return [], _NO_EDGES
    off = starts & 7
    if nbytes % 8 == 0 and not off.any():
        return [(np.arange(len(starts)), starts >> 3, nbytes >> 3)], _NO_EDGES
    whole, e_row, e_byte, e_mask = [], [], [], []
    for o in (int(x) for x in np.unique(off)):
        rows = np.flatnonzero(off == o)
        q = starts[rows] >> 3  # the map byte holding each row's first byte
        head = 1 if o else 0
        end = (o + nbytes) >> 3  # map bytes from q to the one holding the row's end
        if end - head > 0:
            whole.append((rows, q + head, end - head))
        tail = (o + nbytes) & 7
        if o:  # the first map byte: bits o.. (up to the row's end when the row ends in it)
            e_row.append(rows)
            e_byte.append(q)
            e_mask.append(np.full(len(rows), ((1 << min(8, o + nbytes)) - 1) & ~((1 << o) - 1) & 0xFF, np.uint8))
        if tail and not (o and end == 0):  # the last map byte, unless the row ends in its first one
            e_row.append(rows)
            e_byte.append(q + end)
            e_mask.append(np.full(len(rows), (1 << tail) - 1, np.uint8))
    if not e_row:
        return whole, _NO_EDGES
    return whole, (np.concatenate(e_row), np.concatenate(e_byte), np.concatenate(e_mask))


def _width(nbytes: int, starts: np.ndarray) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides the length and every start: fewer, wider elements to copy.
    (The low 3 bits of all starts OR-ed together: one pass over them, not one per width tried.)"""
    low = nbytes | (int(np.bitwise_or.reduce(starts & 7)) if len(starts) else 0)
    return 8 if not low & 7 else 4 if not low & 3 else 2 if not low & 1 else 1


def _row_ids(keys: np.ndarray) -> np.ndarray:
    """An id per row of an int [n, k] array, equal for equal rows: the columns' value ranks packed into one int64
    (k 1-D uniques are several times cheaper than one unique over rows, which sorts them as records)."""
    packed, span = np.zeros(len(keys), np.int64), 1
    for col in keys.T:
        if (col == col[0]).all():
            continue
        _, rank = np.unique(col, return_inverse=True)
        size = int(rank.max()) + 1
        if span * size >= 1 << 62:  # (too many distinct rows to pack: rank the rows themselves)
            return np.unique(keys, axis=0, return_inverse=True)[1].reshape(-1)
        packed, span = packed * size + rank.reshape(-1), span * size
    return packed


def _stacks(g: VertexGroup, cl: Codelet, nbytes: np.ndarray) -> list[np.ndarray]:
    """The vertices of a group in stacks that one codelet call can run: equal operand shapes and uniform params, at
    most about CHUNK_BYTES of operands each."""
    n = len(g)
    uniform = [j for j in cl.uniform if j < g.params.shape[1]]  # (optional params an older Program lacks)
    keys = np.concatenate([g.shapes.reshape(n, -1), g.params[:, uniform]], axis=1)
    if n == 1 or (keys == keys[0]).all():
        groups = [np.arange(n)]
    else:
        inv = _row_ids(keys)
        order = np.argsort(inv, kind="stable")
        groups = np.split(order, np.flatnonzero(np.diff(inv[order])) + 1)
    out = []
    for sel in groups:
        per = max(1, CHUNK_BYTES // max(1, int(nbytes[sel[0]].sum())))
        out.extend(sel[i: i + per] for i in range(0, len(sel), per))
    return out


class Machine:
    def __init__(self, program: Program, check: bool = True):
        self.p = program
        self.check = check
        bt = program.buffers
        ends = bt.b_addr + bt.b_size
        self.size = int(ends.max()) if len(ends) else 8
        self.size = min(max(self.size, 8), program.sram_bytes_per_tile)
        # Word views of the whole memory need a multiple of 8 bytes, and so do those of the written map (one bit a
        # byte): 64. (A 1-tile chip whose memory was 24 bytes had a 3-byte map, and its 2-byte view failed.)
        self.size = (self.size + 63) // 64 * 64
        self.mem = np.zeros((program.tiles, self.size), np.uint8)
        # One bit per byte (bit j of map byte i is memory byte 8i + j): an eighth of the bytes to scatter and gather.
        self.written = np.zeros((program.tiles, self.size // 8), np.uint8) if check else None

    # ------------------------------------------------------------------------------------------------ bytes
    @staticmethod
    def _windows(arr: np.ndarray, nbytes: int, w: int) -> np.ndarray:
        """Every w-aligned window of nbytes in the flat byte array, as rows of w-byte words: row i starts at byte w*i.
        Indexing it with starts // w gathers (or scatters) one operand block per row."""
        words = arr.reshape(-1).view(WORDS[w])
        n = nbytes // w
        return as_strided(words, (len(words) - n + 1, n), (w, w))

    def _gather(self, starts: np.ndarray, nbytes: int) -> np.ndarray:
        """The blocks of nbytes at flat byte offsets `starts`, as uint8 [n, nbytes]."""
        if moves.enabled():
            return moves.gather(self.mem.reshape(-1), starts, nbytes)
        w = _width(nbytes, starts)
        return self._windows(self.mem, nbytes, w)[starts // w].view(np.uint8)

    def _scatter(self, starts: np.ndarray, data: np.ndarray, mark: bool = True) -> None:
        """Write rows of bytes (uint8 [n, nbytes]) at flat byte offsets `starts`, and mark them written (unless `mark`
        is False: steps mark their writes together after, see _map_ranges)."""
        wmap = None if self.written is None or not mark else self.written.reshape(-1)
        if moves.enabled():
            moves.scatter(self.mem.reshape(-1), wmap, starts, data)
            return
        nbytes = data.shape[1]
        w = _width(nbytes, starts)
        self._windows(self.mem, nbytes, w)[starts // w] = data.view(WORDS[w])
        if wmap is not None:
            self._mark(starts, nbytes)

    def _mark(self, starts: np.ndarray, nbytes: int, written: bool = True) -> None:
        """Mark the rows [start, start + nbytes) written (check mode), or unwritten (`written` False: a dead streamed
        weight's bytes)."""
        if self.written is not None and nbytes and written and moves.enabled():
            moves.mark(self.written.reshape(-1), starts, nbytes)
        elif self.written is not None and nbytes:
            whole, (_, e_byte, e_mask) = _spans(starts, nbytes)
            for _, first, count in whole:
                v = _width(count, first)
                self._windows(self.written, count, v)[first // v] = ONES[v] if written else 0
            if len(e_byte):  # (rows side by side may share an edge byte of the map: or.at adds every row's bits)
                if written:
                    np.bitwise_or.at(self.written.reshape(-1), e_byte, e_mask)
                else:
                    np.bitwise_and.at(self.written.reshape(-1), e_byte, ~e_mask)

    def _unwritten(self, starts: np.ndarray, nbytes: int) -> tuple[int, int] | None:
        """(row, byte offset) of the first unwritten byte of the rows [start, start + nbytes), or None when all are
        written."""
        if moves.enabled():
            return moves.unwritten(self.written.reshape(-1), starts, nbytes)
        whole, (e_row, e_byte, e_mask) = _spans(starts, nbytes)
        ok = np.ones(len(starts), bool)
        for rows, first, count in whole:
            v = _width(count, first)
            got = self._windows(self.written, count, v)[first // v]
            if len(got) and got.min() != ONES[v]:
                ok[rows] &= (got == ONES[v]).all(axis=1)
        if len(e_byte):
            e_ok = (self.written.reshape(-1)[e_byte] & e_mask) == e_mask
            ok[e_row[~e_ok]] = False
        if ok.all():
            return None
        i = int(np.argmin(ok))  # the first failing row, and its first unwritten byte
        s0 = int(starts[i])
        bits = np.unpackbits(self.written.reshape(-1)[s0 >> 3: (s0 + nbytes + 7) >> 3], bitorder="little")
        return i, int(np.argmin(bits[s0 & 7: (s0 & 7) + nbytes]))

    def _map_ranges(self, tile: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The byte ranges (tile, start, end; sorted by tile and start) as flat (starts, lengths) for the written
        map: their union with the compiled moves (fewer, longer ranges, in address order), the ranges themselves on
        NumPy's path (whose passes take one length at a time, and a union has many)."""
        fs, fe = tile * self.size + start, tile * self.size + end
        return _union(fs, fe) if moves.enabled() else (fs, fe - fs)

    def _first_unwritten(self, starts: np.ndarray, lens: np.ndarray) -> int | None:
        """The flat offset of an unwritten byte in the ranges (starts, lengths), or None when all are written."""
        if moves.enabled():
            bad = moves.unwritten(self.written.reshape(-1), starts, lens)
            return None if bad is None else int(starts[bad[0]]) + bad[1]
        for grp in _by_value(lens):
            bad = self._unwritten(starts[grp], int(lens[grp[0]]))
            if bad is not None:
                return int(starts[grp[bad[0]]]) + bad[1]
        return None

    def _mark_ranges(self, starts: np.ndarray, lens: np.ndarray) -> None:
        """Mark the ranges (flat starts, lengths) written."""
        if moves.enabled():
            moves.mark(self.written.reshape(-1), starts, lens)
            return
        for grp in _by_value(lens):
            self._mark(starts[grp], int(lens[grp[0]]))

    def _flat(self, tile, addr) -> np.ndarray:
        return np.asarray(tile, np.int64) * self.size + np.asarray(addr, np.int64)

    # ------------------------------------------------------------------------------------------------ checks
    def _bounds(self, what: str, tile, addr, nbytes) -> None:
        tile, addr, nbytes = (np.asarray(x, np.int64) for x in (tile, addr, nbytes))
        bad = (addr < 0) | (addr + nbytes > self.p.sram_bytes_per_tile) | (tile < 0) | (tile >= self.p.tiles)
        if bad.any():
            i = int(np.flatnonzero(bad.reshape(-1))[0])
            raise SimCheckError(f"{what}: address out of bounds (tile {tile.reshape(-1)[i] if tile.ndim else tile}, "
                                f"byte {addr.reshape(-1)[i]}, {nbytes.reshape(-1)[i]} bytes)")
        if ((addr + nbytes) > self.size).any():
            raise SimCheckError(f"{what}: address beyond every planned buffer (simulated SRAM is {self.size} bytes)")

    # ------------------------------------------------------------------------------------------------ loading
    def load_weights(self, graph: Graph) -> None:
        """The weights loaded with the Program; streamed ones are kept to be written at their steps (stream_weights).
        In check mode, a streamed weight buffer's bytes are forgotten after its last reader (BufferTable.last), so
        a layer whose block never arrived reads unwritten bytes, not the bytes of the layer it replaced."""
        self.graph = graph
        self.streamed: dict[int, list[int]] = {}
        for i, c in enumerate(self.p.consts):
            if c.step >= 0:
                self.streamed.setdefault(c.step, []).append(i)
        self._write_images(graph, [i for i, c in enumerate(self.p.consts) if c.step < 0])
        bt = self.p.buffers
        dies = np.flatnonzero(np.array([c == "weights" for c in bt.category], bool) & (bt.first >= 0))
        self.dying: dict[int, list[int]] = {}  # half-step -> streamed weight buffers whose last reader it is
        for b in dies.tolist():
            self.dying.setdefault(int(bt.last[b]), []).append(b)

    def stream_weights(self, k: int) -> None:
        """The weight blocks streamed from the host before step k's compute."""
        idx = self.streamed.get(k)
        if idx:
            self._write_images(self.graph, idx)

    def forget_dead(self, half_step: int) -> None:
        """Check mode: forget the bytes of the streamed weight buffers whose last reader was this half-step."""
        bt = self.p.buffers
        for b in self.dying.get(half_step, ()) if self.written is not None else ():
            lo, hi = int(bt.tile_start[b]), int(bt.tile_start[b + 1])
            starts, sizes = self._flat(bt.b_tiles[lo:hi], bt.b_addr[lo:hi]), bt.b_size[lo:hi]
            for grp in _by_value(sizes):
                self._mark(starts[grp], int(sizes[grp[0]]), written=False)

    def _write_images(self, graph: Graph, which: list[int]) -> None:
        """Weight blocks p.consts[which] at their tiles and addresses: a big block is one slice copy straight from
        the constant into the tile's bytes (a gather into a stack first copies it twice); small ones, one gather and
        one scatter per block shape."""
        cs = self.p.consts
        if not which:
            return
        by_const: dict[tuple[str, str], list[int]] = {}
        for i in which:
            by_const.setdefault((cs[i].name, cs[i].dtype), []).append(i)
        for (name, dtype), idx in by_const.items():
            if name not in graph.constants:
                raise TremulaError(f"the program needs constant {name!r}, which the model does not have")
            v = graph.constants[name].value()
            width = v.shape[-1] if v.ndim else 1
            store = storage_dtype(dtype)  # FP8 weights are written as their code bytes
            src = np.ascontiguousarray(v.reshape(-1, width)).astype(dtype, copy=False).view(store)
            dtype = store
            r0, r1, c0, c1, tile, addr = (np.array([getattr(cs[i], f) for i in idx], np.int64)
                                          for f in ("r0", "r1", "c0", "c1", "tile", "addr"))
            isz = src.itemsize
            nbytes = (r1 - r0) * (c1 - c0) * isz
            self._bounds(f"weights {name}", tile, addr, nbytes)
            if ((r0 < 0) | (r1 > src.shape[0]) | (r0 > r1) | (c0 < 0) | (c1 > src.shape[1]) | (c0 > c1)).any():
                raise TremulaError(f"the program reads a block outside constant {name!r}")
            flat = self._flat(tile, addr)
            shapes = (r1 - r0) * (1 << 32) + (c1 - c0)
            for grp in _by_value(shapes):
                rows, cols = int(r1[grp[0]] - r0[grp[0]]), int(c1[grp[0]] - c0[grp[0]])
                if rows * cols == 0:
                    continue
                if moves.enabled():  # every block's rows straight from the constant to its tile
                    moves.blocks(self.mem.reshape(-1), None if self.written is None else self.written.reshape(-1),
                                 flat[grp], src, r0[grp], c0[grp], rows, cols)
                elif rows * cols * isz >= BIG_BLOCK:  # a slice copy each, straight into the tile's bytes
                    for t, a, ra, ca in zip(tile[grp].tolist(), addr[grp].tolist(), r0[grp].tolist(),
                                            c0[grp].tolist()):
                        self.mem[t, a: a + rows * cols * isz].view(dtype).reshape(rows, cols)[...] = \
                            src[ra: ra + rows, ca: ca + cols]
                    self._mark(flat[grp], rows * cols * isz)
                else:  # many small blocks: windows [rows, cols] at every (row, col) of the constant, one gather
                    win = as_strided(src, (src.shape[0] - rows + 1, src.shape[1] - cols + 1, rows, cols),
                                     src.strides * 2)
                    blocks = np.ascontiguousarray(win[r0[grp], c0[grp]]).reshape(len(grp), -1).view(np.uint8)
                    self._scatter(flat[grp], blocks)

    def host_in(self, feeds: dict[str, np.ndarray]) -> None:
        flats: dict[tuple[str, str], np.ndarray] = {}  # each input in a stream's dtype once, not once per stream
        for s in self.p.host_in:
            shape, _ = self.p.io_types[s.name]
            if s.name not in feeds:
                raise TremulaError(f"missing input {s.name!r}")
            x = np.asarray(feeds[s.name])
            if tuple(x.shape) != tuple(shape):
                raise TremulaError(f"input {s.name!r} has shape {tuple(x.shape)}, the program expects {tuple(shape)}")
            flat = flats.get((s.name, s.dtype))
            if flat is None and x.dtype.kind in "iu" and np.dtype(s.dtype).kind in "iu":
                # int64 ids held as int32 (passes/int32.py): the host narrows them, and refuses what does not fit
                lim = np.iinfo(s.dtype)
                if x.size and (int(x.min()) < lim.min or int(x.max()) > lim.max):
                    raise TremulaError(f"input {s.name!r} holds {int(x.min())}..{int(x.max())}, outside the "
                                       f"program's {s.dtype} ({lim.min}..{lim.max})")
            if flat is None:
                flat = flats[(s.name, s.dtype)] = np.ascontiguousarray(x.astype(s.dtype)).reshape(-1)
            isz = np.dtype(s.dtype).itemsize
            r = np.arange(s.rows, dtype=np.int64)
            e0 = s.elem_offset + r * s.elem_stride
            addr = s.addr + r * s.cols * isz
            self._bounds(f"host stream {s.name}", s.tile, addr, s.cols * isz)
            if s.rows and ((e0 < 0) | (e0 + s.cols > len(flat))).any():
                raise TremulaError(f"host stream {s.name} reads outside the input")
            rows = flat[e0[:, None] + np.arange(s.cols)].view(np.uint8).reshape(s.rows, -1)
            self._scatter(self._flat(s.tile, addr), rows)

    def host_out(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for s in self.p.host_out:
            shape, _ = self.p.io_types[s.name]
            if s.name not in out:
                out[s.name] = np.zeros(int(np.prod(shape, dtype=np.int64)), s.dtype)
            isz = np.dtype(s.dtype).itemsize
            r = np.arange(s.rows, dtype=np.int64)
            addr = s.addr + r * s.cols * isz
            self._bounds(f"host stream {s.name}", s.tile, addr, s.cols * isz)
            starts = self._flat(s.tile, addr)
            if self.written is not None:
                bad = self._unwritten(starts, s.cols * isz)
                if bad is not None:
                    raise SimCheckError(f"output {s.name}: reads unwritten byte {int(addr[bad[0]]) + bad[1]} on tile "
                                        f"{s.tile}")
            e0 = s.elem_offset + r * s.elem_stride
            out[s.name][e0[:, None] + np.arange(s.cols)] = self._gather(starts, s.cols * isz).view(s.dtype)
        return {k: v.reshape(self.p.io_types[k][0]) for k, v in out.items()}

    # ------------------------------------------------------------------------------------------------ steps
    def compute(self, k: int) -> None:
        """A compute set: in check mode every address rule first (the vertices run in parallel on the chip, so the
        step's reads see the memory as it was before it, and no vertex may read another's output), then the stacks,
        then the step's writes marked in the written map at once."""
        step = self.p.steps[k]
        runs = []
        writes, reads = ([], [], [], []), ([], [], [], [])  # tile, start, bytes, vertex (matched by vertex)
        vx0 = 0  # the step's index of each group's first vertex
        for g in step.compute:
            cl = codelet(g.codelet)
            outs = cl.written(len(g.dtypes))
            isz = np.array([np.dtype(d).itemsize for d in g.dtypes], np.int64)
            nbytes = g.shapes[:, :, 0] * g.shapes[:, :, 1] * isz[None, :]
            self._bounds(f"step {k} {g.codelet}", g.tiles[:, None], g.addrs, nbytes)
            runs.append((g, cl, outs, nbytes))
            if self.check:
                vx = vx0 + np.arange(len(g.tiles), dtype=np.int64)
                for a in range(len(g.dtypes)):
                    for col, x in zip(writes if a in outs else reads, (g.tiles.astype(np.int64), g.addrs[:, a],
                                                                       nbytes[:, a], vx)):
                        col.append(x)
            vx0 += len(g.tiles)
        marks = self._check_compute(k, runs, *(np.concatenate(c) for c in writes + reads)) \
            if self.check and (writes[0] or reads[0]) else None
        for g, cl, outs, nbytes in runs:
            for sel in _stacks(g, cl, nbytes):
                self._run(k, g, cl, outs, sel, nbytes)
        if marks is not None:
            self._mark_ranges(*marks)

    def _check_compute(self, k: int, runs, wt, ws, wl, wv, rt, rs, rl, rv) -> tuple[np.ndarray, np.ndarray]:
        """A compute set's address rules (its writes and reads: tile, start, bytes, vertex): no two vertices write
        the same bytes, none reads another's output, every byte read was written before the step. Returns the
        write ranges to mark once the step has run."""
        label = self.p.steps[k].label
        t, s, e, _ = _sorted_rows(wt, ws, wl)
        j = _first_overlap(t, s, e)
        if j is not None:
            raise SimCheckError(f"step {k} ({label}): two vertices write overlapping bytes on tile {j[0]} at byte "
                                f"{j[1]}")
        race = _read_of_other_write(wt, ws, wl, wv, rt, rs, rl, rv)
        if race is not None:
            raise SimCheckError(f"step {k} ({label}): a vertex reads bytes another vertex of the same compute set "
                                f"writes (tile {race[0]}, byte {race[1]}): a read-after-write race")
        rt_, rs_, re_, _ = _sorted_rows(rt, rs, rl)
        if self._first_unwritten(*self._map_ranges(rt_, rs_, re_)) is not None:
            self._raise_unwritten_read(k, runs)
        return self._map_ranges(t, s, e)

    def _raise_unwritten_read(self, k: int, runs) -> None:
        """Name the first operand, in the step's order, that reads an unwritten byte."""
        for g, cl, outs, nbytes in runs:
            for a in range(len(g.dtypes)):
                if a in outs:
                    continue
                flat, first = self._flat(g.tiles, g.addrs[:, a]), None
                for grp in _by_value(nbytes[:, a]):  # (each group in vertex order: the first failing vertex of all)
                    bad = self._unwritten(flat[grp], int(nbytes[grp[0], a]))
                    if bad is not None and (first is None or grp[bad[0]] < first[0]):
                        first = (int(grp[bad[0]]), bad[1])
                if first is not None:
                    v, b = first
                    raise SimCheckError(f"step {k} ({self.p.steps[k].label}) {g.codelet} operand {a}: reads "
                                        f"unwritten byte {int(g.addrs[v, a]) + b} on tile {int(g.tiles[v])}")
        raise AssertionError("an unwritten read that no operand makes")

    def _run(self, k: int, g: VertexGroup, cl: Codelet, outs: list[int], sel: np.ndarray, nbytes: np.ndarray) -> None:
        """One stack of vertices (equal shapes, uniform params): gather every operand, run the codelet once, scatter
        the outputs (marked written by the step, after all its stacks)."""
        n = len(sel)
        base = g.tiles[sel].astype(np.int64) * self.size
        ops, starts = [], []
        views = [storage_dtype(d) for d in g.dtypes]  # codelets see FP8 operands as their code bytes
        for a in range(len(g.dtypes)):
            st = base + g.addrs[sel, a]
            nb = int(nbytes[sel[0], a])
            shape = (n, int(g.shapes[sel[0], a, 0]), int(g.shapes[sel[0], a, 1]))
            if a in outs:  # written whole by the codelet; poison shows any byte it would leave behind
                ops.append(np.full((n, nb), POISON, np.uint8).view(views[a]).reshape(shape))
            else:
                ops.append(self._gather(st, nb).view(views[a]).reshape(shape))
            starts.append(st)
        try:
            cl.run(ops, g.params[sel])
        except IndexOutOfRange as e:
            raise TremulaError(f"step {k} ({self.p.steps[k].label}): {e}") from None
        for a in outs:
            self._scatter(starts[a], np.ascontiguousarray(ops[a]).reshape(n, -1).view(np.uint8), mark=False)

    def exchange(self, k: int) -> None:
        ex = self.p.steps[k].exchange
        n = len(ex)
        if n == 0:
            return
        # Every transfer's rows: source (tile, address) and bytes, read once however many destinations it has.
        rows, nd = ex.rows, np.diff(ex.dst_start)
        ri = np.repeat(np.arange(n), rows)
        r_local = positions_in_runs(rows)
        src = (ex.src_tile[ri].astype(np.int64), ex.src_addr[ri] + r_local * ex.src_stride[ri], ex.row_bytes[ri])
        self._bounds(f"step {k} exchange source", *src)
        # A destination's rows lie between its first and last row's addresses: bounds checked at both ends.
        ti = np.repeat(np.arange(n), nd)
        drows = rows[ti]
        last = np.maximum(drows - 1, 0) * ex.d_stride
        for a in (ex.d_addr, ex.d_addr + last):
            self._bounds(f"step {k} exchange destination", ex.d_tile, a, ex.row_bytes[ti])
        marks = None
        if self.check:
            # One entry per (transfer, destination, row) for the overlap check.
            di = np.repeat(np.arange(len(ti)), drows)
            d_local = positions_in_runs(drows)
            dst_t = ex.d_tile[di].astype(np.int64)
            dst_a = ex.d_addr[di] + d_local * ex.d_stride[di]
            marks = self._check_transfers(k, src, dst_t, dst_a, ex.row_bytes[ti[di]])
        if moves.enabled():  # every row straight to its destinations
            moves.exchange(self.mem.reshape(-1), self._flat(ex.src_tile, ex.src_addr), ex.src_stride, ex.row_bytes,
                           rows, ex.dst_start, self._flat(ex.d_tile, ex.d_addr), ex.d_stride)
        else:
            s_flat = self._flat(src[0], src[1])
            for grp in _by_value(src[2]):
                length = int(src[2][grp[0]])
                if length == 0:
                    continue
                grp = grp[np.argsort(-nd[ri[grp]], kind="stable")]  # most destinations first (see _multicast)
                per = max(1, CHUNK_BYTES // length)
                for lo in range(0, len(grp), per):
                    sel = grp[lo: lo + per]
                    self._multicast(ex, ri[sel], r_local[sel], nd[ri[sel]], self._gather(s_flat[sel], length))
        if marks is not None:
            self._mark_ranges(*marks)

    def _multicast(self, ex, t: np.ndarray, r: np.ndarray, nds: np.ndarray, data: np.ndarray) -> None:
        """Write row i of `data` (row r[i] of transfer t[i]) to every destination of its transfer. The rows come
        sorted by their number of destinations, most first, so the rows that have a j-th destination are a prefix
        of `data`: one scatter per j from a view, and the source bytes are gathered once, not once per destination.
        When few rows are left with many destinations each, their remaining (row, destination) pairs go at once
        (a copy of those rows, at most CHUNK_BYTES)."""
        neg = -nds
        j = 0
        while j < nds[0]:
            c = int(np.searchsorted(neg, -j, side="left"))  # rows with more than j destinations
            cnt = nds[:c] - j
            if c * 8 < len(nds) and int(nds[0]) - j > 8 and int(cnt.sum()) * data.shape[1] <= CHUNK_BYTES:
                idx = np.repeat(np.arange(c), cnt)
                d = ex.dst_start[t[idx]] + j + positions_in_runs(cnt)
                self._scatter(self._flat(ex.d_tile[d], ex.d_addr[d] + r[idx] * ex.d_stride[d]), data[idx], mark=False)
                return
            d = ex.dst_start[t[:c]] + j
            self._scatter(self._flat(ex.d_tile[d], ex.d_addr[d] + r[:c] * ex.d_stride[d]), data[:c], mark=False)
            j += 1

    def exchange_by_timetable(self, k: int, chip) -> None:
        """The same exchange, executed chunk by chunk in the order its cycle-precise timetable completes them."""
        from tremula.timing import chunk_segments, replay_order, schedule_exchange

        ex = self.p.steps[k].exchange
        if len(ex) == 0:
            return
        tt = schedule_exchange(ex, chip)
        chunk, row, col, nbytes = chunk_segments(ex, tt)
        rank = np.empty(len(tt.transfer), np.int64)
        rank[replay_order(tt)] = np.arange(len(tt.transfer))
        order = np.argsort(rank[chunk], kind="stable")
        chunk, row, col, nbytes = chunk[order], row[order], col[order], nbytes[order]
        tr = np.asarray(tt.transfer, np.int64)[chunk]
        src = (ex.src_tile[tr].astype(np.int64), ex.src_addr[tr] + row * ex.src_stride[tr] + col, nbytes)
        nd = np.diff(ex.dst_start)[tr]
        pi = np.repeat(np.arange(len(tr)), nd)  # one entry per (piece, destination)
        d = np.repeat(ex.dst_start[tr], nd) + positions_in_runs(nd)
        src_t = src[0][pi]
        src_a = src[1][pi]
        dst_t = ex.d_tile[d].astype(np.int64)
        dst_a = ex.d_addr[d] + row[pi] * ex.d_stride[d] + col[pi]
        self._copy(k, src, src_t, src_a, dst_t, dst_a, nbytes[pi])

    def _copy(self, k: int, src, src_t, src_a, dst_t, dst_a, nb) -> None:
        """Copy rows of bytes between tiles (the only way data crosses tiles), checking them first in check mode.
        `src` is (tile, address, bytes) of every source row once; the others have one entry per destination row."""
        self._bounds(f"step {k} exchange source", *src)
        self._bounds(f"step {k} exchange destination", dst_t, dst_a, nb)
        marks = self._check_transfers(k, src, dst_t, dst_a, nb) if self.check else None
        s_flat, d_flat = self._flat(src_t, src_a), self._flat(dst_t, dst_a)
        # Sources and destinations do not overlap (checked above), so batches may run in any order: one per length.
        for grp in _by_value(nb):
            length = int(nb[grp[0]])
            if length == 0:
                continue
            per = max(1, CHUNK_BYTES // length)
            for lo in range(0, len(grp), per):
                sel = grp[lo: lo + per]
                self._scatter(d_flat[sel], self._gather(s_flat[sel], length), mark=False)
        if marks is not None:
            self._mark_ranges(*marks)

    def _check_sources(self, k: int, tile, addr, nb) -> None:
        """Every source byte of the exchange was written before it."""
        flat = self._flat(tile, addr)
        for grp in _by_value(nb):
            length = int(nb[grp[0]])
            per = max(1, CHUNK_BYTES // max(length, 1))
            for lo in range(0, len(grp) if length else 0, per):
                sel = grp[lo: lo + per]
                bad = self._unwritten(flat[sel], length)
                if bad is not None:
                    self._raise_unwritten_source(k, int(flat[sel[bad[0]]]) + bad[1])

    def _raise_unwritten_source(self, k: int, byte: int) -> None:
        raise SimCheckError(f"step {k} ({self.p.steps[k].label}): a transfer reads unwritten byte {byte % self.size} "
                            f"on tile {byte // self.size}")

    def _check_transfers(self, k: int, src, dst_t, dst_a, nb) -> tuple[np.ndarray, np.ndarray]:
        """An exchange's rules (_check_exchange's, and every source byte written before it), checked over the rows in
        address order; returns the destination ranges to mark once the rows are copied. `src` is (tile, address,
        bytes) of every source row once; the others have one entry per destination row."""
        sources, destinations = self._check_exchange(k, src, dst_t, dst_a, nb)
        if self._first_unwritten(*sources) is not None:
            self._check_sources(k, *src)  # names the first unwritten byte in the transfers' order
            raise AssertionError("an unwritten source byte that no transfer reads")
        return destinations

    def _check_exchange(self, k: int, src, dst_t, dst_a, nb):
        """Destination rows must not overlap each other nor any source row of the same exchange: one sort of all
        rows by tile and address, then running maxima of the destination and source ends. `src` is (tile, address,
        bytes) of each source row once. Returns the sources' and the destinations' ranges for the written map
        (_map_ranges). With the compiled moves, one pass over the sorted rows does it all (moves.scan_rows)."""
        src_t, src_a, src_nb = src
        is_src = np.concatenate([np.zeros(len(dst_t), bool), np.ones(len(src_t), bool)])
        t, s, e, src = _sorted_rows(np.concatenate([dst_t, src_t]), np.concatenate([dst_a, src_a]),
                                    np.concatenate([nb, src_nb]), is_src)
        if moves.enabled():
            clash, race, sources, destinations = moves.scan_rows(t, s, e, src, self.size)
            if clash >= 0:
                raise SimCheckError(f"step {k}: two transfers write overlapping bytes on tile {t[clash]} at byte "
                                    f"{s[clash]}")
            if race >= 0:
                raise SimCheckError(f"step {k}: the exchange reads bytes it also writes (tile {t[race]}, byte "
                                    f"{s[race]})")
            return sources, destinations
        big = int(e.max()) + 1
        dmax = np.maximum.accumulate(np.where(~src, e, 0) + t * big) - t * big
        same = t[1:] == t[:-1]
        clash = np.flatnonzero(same & ~src[1:] & (s[1:] < dmax[:-1]))
        if len(clash):
            i = int(clash[0]) + 1
            raise SimCheckError(f"step {k}: two transfers write overlapping bytes on tile {t[i]} at byte {s[i]}")
        smax = np.maximum.accumulate(np.where(src, e, 0) + t * big) - t * big
        race = same & ((src[1:] & (s[1:] < dmax[:-1])) | (~src[1:] & (s[1:] < smax[:-1])))
        if race.any():
            i = int(np.flatnonzero(race)[0]) + 1
            raise SimCheckError(f"step {k}: the exchange reads bytes it also writes (tile {t[i]}, byte {s[i]})")
        return self._map_ranges(t[src], s[src], e[src]), self._map_ranges(t[~src], s[~src], e[~src])


def simulate(program: Program, graph: Graph, feeds: dict[str, np.ndarray], check: bool = True,
             progress: Callable[[str, int, int], None] | None = None, timetable_chip=None) -> dict[str, np.ndarray]:
    """Run the Program on `feeds`; returns the graph outputs read back through the host output streams.

    With `timetable_chip`, every exchange is scheduled into its cycle-precise timetable on that chip and executed
    chunk by chunk in timetable order (slower; proves the timetable moves every byte the Program asks for).
    """
    with _small_pages():
        m = Machine(program, check)
        m.load_weights(graph)
        m.host_in(feeds)
        n = len(program.steps)
        for k in range(n):
            if progress:
                progress("simulate", k, n)
            m.stream_weights(k)
            m.compute(k)
            m.forget_dead(2 * k)
            if timetable_chip is None:
                m.exchange(k)
            else:
                m.exchange_by_timetable(k, timetable_chip)
            m.forget_dead(2 * k + 1)
        if progress:
            progress("simulate", n, n)
        return m.host_out()


# NumPy asks the kernel for transparent huge pages on every array of 4 MB or more (madvise). The simulator's tile
# memory and its large stacked operands are such arrays, written once each: where the kernel compacts memory to
# find a huge page on such a fault (Linux's default "defrag=madvise"), that took seconds. BERT-base fp32 batch 8,
# one simulation on a 2-core VM: 3.0-3.2 s of kernel time and 14.0-14.5 CPU seconds in all with the advice, 0.5 s
# and 11.7-11.8 s without it; vit-base fp32 batch 8 18.0-18.3 -> 16.3-16.6 s. At fp16 the two were within 3 % (BERT-base
# batch 8 15.1-15.3 -> 14.9 s, vit-base 16.9-17.9 -> 17.7-18.2 s): fewer huge pages cost more TLB misses. It is
# switched off while a simulation runs, and back on after.
_SET_HUGEPAGE = getattr(getattr(getattr(np, "_core", None) or getattr(np, "core", None), "multiarray", None),
                        "_set_madvise_hugepage", None)  # (np.core before NumPy 2)


@contextmanager
def _small_pages():
    """NumPy's huge-page advice off for the duration (where this NumPy has the switch)."""
    if _SET_HUGEPAGE is None:
        yield
        return
    was = _SET_HUGEPAGE(False)
    try:
        yield
    finally:
        _SET_HUGEPAGE(was)

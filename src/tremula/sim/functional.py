"""The functional simulator: executes a Program on tile SRAM held as bytes; it never evaluates a Graph op.

Memory is one uint8 array [tiles, bytes]; a vertex sees views of its own tile's bytes at the addresses the Program
gives; data crosses tiles only through the exchange's transfers. Weights are materialised at load time from the
Graph's constants (a Program stores references, see program.py).

Check mode fills memory with a poison byte pattern and keeps a shadow "written" bitmap, and fails with SimCheckError on:
reading bytes nothing wrote (vertex operand, transfer source, host output), an address outside the tile's SRAM or
outside every planned buffer, two vertices (or two transfers) writing overlapping bytes in one step, and an exchange
reading bytes the same exchange writes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tremula.codelets import codelet
from tremula.codelets.embed import IndexOutOfRange
from tremula.errors import TremulaError
from tremula.ir.graph import Graph
from tremula.program import Program, VertexGroup

# As float32 0xA5A5A5A5 is -2.9e-16, as float16 0xA5A5 is -0.022: wrong but finite, so reads must be caught.
POISON = 0xA5
CHUNK_BYTES = 1 << 24  # exchange bytes copied per vectorised batch


class SimCheckError(TremulaError):
    """The simulated program broke a rule (unwritten read, out of bounds, overlapping writes)."""


def _first_overlap(tile: np.ndarray, start: np.ndarray, end: np.ndarray) -> int | None:
    """Index (in sorted order) of an interval overlapping an earlier one on the same tile, else None."""
    if len(tile) < 2:
        return None
    order = np.lexsort((start, tile))
    t, s, e = tile[order], start[order], end[order]
    # Running max of ends within each tile (tiles are sorted, so offset by tile to keep groups apart).
    big = int(e.max()) + 1
    run = np.maximum.accumulate(e + t * big) - t * big
    bad = (t[1:] == t[:-1]) & (s[1:] < run[:-1])
    idx = np.flatnonzero(bad)
    return int(order[idx[0] + 1]) if len(idx) else None


class Machine:
    def __init__(self, program: Program, check: bool = True):
        self.p = program
        self.check = check
        bt = program.buffers
        ends = bt.b_addr + bt.b_size
        self.size = int(ends.max()) if len(ends) else 8
        self.size = min(max(self.size, 8), program.sram_bytes_per_tile)
        self.size = (self.size + 7) // 8 * 8  # word views of the whole memory need a multiple of 8 bytes
        self.mem = np.full((program.tiles, self.size), POISON if check else 0, np.uint8)
        self.written = np.zeros((program.tiles, self.size), bool) if check else None

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

    def _read_ok(self, what: str, tile: int, addr: int, nbytes: int) -> None:
        if self.written is not None and not self.written[tile, addr: addr + nbytes].all():
            k = int(np.argmin(self.written[tile, addr: addr + nbytes]))
            raise SimCheckError(f"{what}: reads unwritten byte {addr + k} on tile {tile}")

    # ------------------------------------------------------------------------------------------------ loading
    def load_weights(self, graph: Graph) -> None:
        cache: dict[tuple[str, str], np.ndarray] = {}
        for c in self.p.consts:
            key = (c.name, c.dtype)
            if key not in cache:
                if c.name not in graph.constants:
                    raise TremulaError(f"the program needs constant {c.name!r}, which the model does not have")
                v = graph.constants[c.name].value()
                cols = v.shape[-1] if v.ndim else 1
                cache[key] = np.ascontiguousarray(v.reshape(-1, cols).astype(c.dtype))
            block = np.ascontiguousarray(cache[key][c.r0: c.r1, c.c0: c.c1]).view(np.uint8).reshape(-1)
            if not (0 <= c.addr and c.addr + len(block) <= self.size and 0 <= c.tile < self.p.tiles):
                self._bounds(f"weights {c.name}", c.tile, c.addr, len(block))
            self.mem[c.tile, c.addr: c.addr + len(block)] = block
            if self.written is not None:
                self.written[c.tile, c.addr: c.addr + len(block)] = True

    def host_in(self, feeds: dict[str, np.ndarray]) -> None:
        for s in self.p.host_in:
            shape, _ = self.p.io_types[s.name]
            if s.name not in feeds:
                raise TremulaError(f"missing input {s.name!r}")
            x = np.asarray(feeds[s.name])
            if tuple(x.shape) != tuple(shape):
                raise TremulaError(f"input {s.name!r} has shape {tuple(x.shape)}, the program expects {tuple(shape)}")
            flat = np.ascontiguousarray(x.astype(s.dtype)).reshape(-1)
            isz = np.dtype(s.dtype).itemsize
            for r in range(s.rows):
                e0 = s.elem_offset + r * s.elem_stride
                data = flat[e0: e0 + s.cols].view(np.uint8)
                a = s.addr + r * s.cols * isz
                self._bounds(f"host stream {s.name}", s.tile, a, len(data))
                self.mem[s.tile, a: a + len(data)] = data
                if self.written is not None:
                    self.written[s.tile, a: a + len(data)] = True

    def host_out(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for s in self.p.host_out:
            shape, _ = self.p.io_types[s.name]
            if s.name not in out:
                out[s.name] = np.zeros(int(np.prod(shape, dtype=np.int64)), s.dtype)
            isz = np.dtype(s.dtype).itemsize
            for r in range(s.rows):
                a = s.addr + r * s.cols * isz
                self._bounds(f"host stream {s.name}", s.tile, a, s.cols * isz)
                self._read_ok(f"output {s.name}", s.tile, a, s.cols * isz)
                e0 = s.elem_offset + r * s.elem_stride
                out[s.name][e0: e0 + s.cols] = self.mem[s.tile, a: a + s.cols * isz].view(s.dtype)
        return {k: v.reshape(self.p.io_types[k][0]) for k, v in out.items()}

    # ------------------------------------------------------------------------------------------------ steps
    def compute(self, k: int) -> None:
        step = self.p.steps[k]
        w_tile, w_start, w_end = [], [], []
        for g in step.compute:
            cl = codelet(g.codelet)
            n_ops = len(g.dtypes)
            outs = cl.written(n_ops)
            isz = np.array([np.dtype(d).itemsize for d in g.dtypes], np.int64)
            nbytes = g.shapes[:, :, 0] * g.shapes[:, :, 1] * isz[None, :]
            if self.check:
                self._bounds(f"step {k} {g.codelet}", g.tiles[:, None], g.addrs, nbytes)
            if cl.batchable and len(g) > 1:
                # Vertices with the same shapes and params run as one stacked call.
                keys = np.concatenate([g.shapes.reshape(len(g), -1), g.params], axis=1)
                _, inv = np.unique(keys, axis=0, return_inverse=True)
                inv = inv.reshape(-1)
                for u in range(int(inv.max()) + 1):
                    sel = np.flatnonzero(inv == u)
                    sub = VertexGroup(g.codelet, g.dtypes, g.tiles[sel], g.params[sel], g.addrs[sel], g.shapes[sel])
                    if len(sel) > 1:
                        self._compute_batched(k, sub, cl, outs, nbytes[sel])
                    else:
                        self._compute_each(k, sub, cl, outs, nbytes[sel])
            else:
                self._compute_each(k, g, cl, outs, nbytes)
            for a in outs:
                w_tile.append(g.tiles.astype(np.int64))
                w_start.append(g.addrs[:, a])
                w_end.append(g.addrs[:, a] + nbytes[:, a])
        if self.check and w_tile:
            t, s, e = np.concatenate(w_tile), np.concatenate(w_start), np.concatenate(w_end)
            j = _first_overlap(t, s, e)
            if j is not None:
                raise SimCheckError(f"step {k} ({step.label}): two vertices write overlapping bytes on tile {t[j]} "
                                    f"at byte {s[j]}")

    def _words(self, w: int) -> tuple[np.ndarray, np.ndarray | None, int]:
        """Memory (and the written map) as w-byte words, and the value of a fully written word."""
        dt = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[w]
        mem = self.mem.reshape(-1).view(dt)
        wr = self.written.reshape(-1).view(dt) if self.written is not None else None
        return mem, wr, int.from_bytes(b"\x01" * w, "little")

    def _compute_batched(self, k: int, g, cl, outs: list[int], nbytes: np.ndarray) -> None:
        """All vertices of the group have the same shapes and params: run the codelet once on stacked operands."""
        n = len(g)
        base = g.tiles.astype(np.int64) * self.size
        idx, views, words = [], [], []
        for a in range(len(g.dtypes)):
            dt = np.dtype(g.dtypes[a])
            w = dt.itemsize if not (g.addrs[:, a] % dt.itemsize).any() else 1
            mem, wr, full = self._words(w)
            ix = ((base + g.addrs[:, a]) // w)[:, None] + np.arange(int(nbytes[0, a]) // w)
            if wr is not None and a not in outs:
                ok = wr[ix] == full
                if not ok.all():
                    v, b = np.unravel_index(int(np.argmin(ok)), ok.shape)
                    raise SimCheckError(f"step {k} ({self.p.steps[k].label}) {g.codelet} operand {a}: reads "
                                        f"unwritten byte {int(g.addrs[v, a]) + int(b) * w} on tile {int(g.tiles[v])}")
            idx.append(ix)
            words.append(w)
            r, c = (int(x) for x in g.shapes[0, a])
            views.append(np.ascontiguousarray(mem[ix]).view(dt).reshape(n, r, c))
        try:
            cl.run(views, g.params[0])
        except IndexOutOfRange as e:
            raise TremulaError(f"step {k} ({self.p.steps[k].label}): {e}") from None
        for a in outs:
            mem, wr, full = self._words(words[a])
            mem[idx[a]] = views[a].reshape(n, -1).view(mem.dtype)
            if wr is not None:
                wr[idx[a]] = full

    def _compute_each(self, k: int, g, cl, outs: list[int], nbytes: np.ndarray) -> None:
        step = self.p.steps[k]
        n_ops = len(g.dtypes)
        for i in range(len(g)):
            t = int(g.tiles[i])
            views = []
            for a in range(n_ops):
                addr, nb = int(g.addrs[i, a]), int(nbytes[i, a])
                if self.check and a not in outs:
                    self._read_ok(f"step {k} ({step.label}) {g.codelet} operand {a}", t, addr, nb)
                views.append(self.mem[t, addr: addr + nb].view(g.dtypes[a]).reshape(g.shapes[i, a]))
            try:
                cl.run(views, g.params[i])
            except IndexOutOfRange as e:
                raise TremulaError(f"step {k} ({step.label}): {e}") from None
            if self.written is not None:
                for a in outs:
                    self.written[t, int(g.addrs[i, a]): int(g.addrs[i, a] + nbytes[i, a])] = True

    def exchange(self, k: int) -> None:
        ex = self.p.steps[k].exchange
        n = len(ex)
        if n == 0:
            return
        nd = np.diff(ex.dst_start)
        ti = np.repeat(np.arange(n), nd)  # one entry per (transfer, destination)
        rows = ex.rows[ti]
        # Expand every 2-D pattern to its rows: (source tile, address) -> (destination tile, address), nbytes.
        ri = np.repeat(np.arange(len(ti)), rows)
        r_local = np.arange(len(ri)) - np.repeat(np.cumsum(rows) - rows, rows)
        src_t = ex.src_tile[ti][ri].astype(np.int64)
        src_a = ex.src_addr[ti][ri] + r_local * ex.src_stride[ti][ri]
        dst_t = ex.d_tile[ri].astype(np.int64)
        dst_a = ex.d_addr[ri] + r_local * ex.d_stride[ri]
        nb = ex.row_bytes[ti][ri]
        self._copy(k, src_t, src_a, dst_t, dst_a, nb)

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
        nd = np.diff(ex.dst_start)[tr]
        pi = np.repeat(np.arange(len(tr)), nd)  # one entry per (piece, destination)
        d = np.repeat(ex.dst_start[tr], nd) + (np.arange(len(pi)) - np.repeat(np.cumsum(nd) - nd, nd))
        src_t = ex.src_tile[tr][pi].astype(np.int64)
        src_a = ex.src_addr[tr][pi] + row[pi] * ex.src_stride[tr][pi] + col[pi]
        dst_t = ex.d_tile[d].astype(np.int64)
        dst_a = ex.d_addr[d] + row[pi] * ex.d_stride[d] + col[pi]
        self._copy(k, src_t, src_a, dst_t, dst_a, nbytes[pi])

    def _copy(self, k: int, src_t, src_a, dst_t, dst_a, nb) -> None:
        """Copy rows of bytes between tiles (the only way data crosses tiles), checking them first in check mode."""
        if self.check:
            self._bounds(f"step {k} exchange source", src_t, src_a, nb)
            self._bounds(f"step {k} exchange destination", dst_t, dst_a, nb)
            self._check_exchange(k, src_t, src_a, dst_t, dst_a, nb)
        # Copy in words as wide as every address and length allows, one batch per row length.
        w = 8
        while w > 1 and ((src_a % w).any() or (dst_a % w).any() or (nb % w).any()):
            w //= 2
        mem, wr, full = self._words(w)
        s_word = (src_t * self.size + src_a) // w
        d_word = (dst_t * self.size + dst_a) // w
        lens = nb // w
        order = np.argsort(lens, kind="stable")
        bounds = np.flatnonzero(np.diff(lens[order])) + 1
        for grp in np.split(order, bounds):
            length = int(lens[grp[0]])
            step_rows = max(1, CHUNK_BYTES // (w * length))
            for lo in range(0, len(grp), step_rows):
                sel = grp[lo: lo + step_rows]
                s_idx = s_word[sel][:, None] + np.arange(length)
                d_idx = d_word[sel][:, None] + np.arange(length)
                if wr is not None and not (wr[s_idx] == full).all():
                    bad = np.argmin((wr[s_idx] == full).reshape(-1))
                    byte = int(s_idx.reshape(-1)[bad]) * w
                    raise SimCheckError(f"step {k} ({self.p.steps[k].label}): a transfer reads unwritten byte "
                                        f"{byte % self.size} on tile {byte // self.size}")
                mem[d_idx] = mem[s_idx]
                if wr is not None:
                    wr[d_idx] = full

    def _check_exchange(self, k: int, src_t, src_a, dst_t, dst_a, nb) -> None:
        """Destination rows must not overlap each other nor any source row of the same exchange."""
        j = _first_overlap(dst_t, dst_a, dst_a + nb)
        if j is not None:
            raise SimCheckError(f"step {k}: two transfers write overlapping bytes on tile {dst_t[j]} "
                                f"at byte {dst_a[j]}")
        tiles = np.concatenate([dst_t, src_t])
        starts = np.concatenate([dst_a, src_a])
        ends = starts + np.concatenate([nb, nb])
        is_dst = np.concatenate([np.ones(len(dst_t), bool), np.zeros(len(src_t), bool)])
        order = np.lexsort((starts, tiles))
        t, s, e, w = tiles[order], starts[order], ends[order], is_dst[order]
        big = int(e.max()) + 1
        dmax = np.maximum.accumulate(np.where(w, e, 0) + t * big) - t * big
        smax = np.maximum.accumulate(np.where(~w, e, 0) + t * big) - t * big
        same = t[1:] == t[:-1]
        race = same & ((~w[1:] & (s[1:] < dmax[:-1])) | (w[1:] & (s[1:] < smax[:-1])))
        if race.any():
            i = int(np.flatnonzero(race)[0]) + 1
            raise SimCheckError(f"step {k}: the exchange reads bytes it also writes (tile {t[i]}, byte {s[i]})")


def simulate(program: Program, graph: Graph, feeds: dict[str, np.ndarray], check: bool = True,
             progress: Callable[[str, int, int], None] | None = None, timetable_chip=None) -> dict[str, np.ndarray]:
    """Run the Program on `feeds`; returns the graph outputs read back through the host output streams.

    With `timetable_chip`, every exchange is scheduled into its cycle-precise timetable on that chip and executed
    chunk by chunk in timetable order (slower; proves the timetable moves every byte the Program asks for).
    """
    m = Machine(program, check)
    m.load_weights(graph)
    m.host_in(feeds)
    n = len(program.steps)
    for k in range(n):
        if progress:
            progress("simulate", k, n)
        m.compute(k)
        if timetable_chip is None:
            m.exchange(k)
        else:
            m.exchange_by_timetable(k, timetable_chip)
    return m.host_out()

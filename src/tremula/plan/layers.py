"""Lowering identical layers identically, so that they can share one copy of their code (plan/share.py proves it).

A transformer's layers are the same ops on the same shapes. Lowered one after another, they still come out different:
tile choices follow the weights placed so far and rotating cursors. In shared-layer mode the Lowerer rewinds those
choices at the start of every layer of a run, so every layer makes the template layer's choices, and it stores each
layer's matmul weights spread over all tiles (the same way in every layer: in even shares, or levelled against the
weights the tiles held before the run, spread_caps) and streams them to every tile that computes with them. Then a
layer differs from the next only in the addresses of its weights: one vertex state and one exchange program serve all
of them, as an outlined function does.

Why spread: with one placement per layer repeated 27 times, a tile holding a block of layer 0's fc1 would hold that
block's copy for every layer (27 x 34 KB on SigLIP so400m), while other tiles hold none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tremula.ir.graph import Constant, DerivedInit, Graph
from tremula.ir.layers import LayerKey, node_key
from tremula.plan.exchange import gather_rects, make_transfers
from tremula.plan.layout import block_rel_offsets, blocks
from tremula.plan.memory import align
from tremula.plan.replay import LayerReplay
from tremula.sorting import positions_in_runs, unique_rows

I64 = np.int64
ALIGN_SLACK = 4  # when a layer's storage overflows its cap, the cap grows by this many aligned words per tile


def untie_layer_vectors(graph: Graph) -> Graph:
    """The graph with every vector constant (rank <= 1) that several nodes read given one copy per reading node (the
    first keeps the original). Exporters store equal
    initializers once: torch.onnx's legacy exporter keeps one all-ones and one all-zeros vector for every LayerNorm
    and bias of a freshly initialised model, so a layer's LayerNorm read another layer's scale, and could not run the
    template layer's code (plan/share.py needs each layer's constants where the template has its own), and a layer's
    two LayerNorms or the patch embedding's bias and a LayerNorm's shared one vector, so the layers' storage held
    fewer vectors than the same model built with its own per node, and planned otherwise. A copy shares the original's
    values (nothing is made twice); on the chip each node then reads its own vectors, as in a model with its own.
    Models without repeated layers are untied too, so they plan as built with their own as well (a one-layer SigLIP
    export's head LayerNorm read a layer's tied scale, 2 cycles off the zoo model). Matrices stay tied: copying an
    ALBERT-style shared layer would multiply its weights."""
    readers: dict[str, list[str]] = {}  # vector -> the nodes that read it (node_key), in order
    for n in graph.nodes:
        k = node_key(n)
        for v in n.inputs:
            c = graph.constants.get(v)
            if c is not None and len(c.type.shape) <= 1 and k not in readers.get(v, []):
                readers.setdefault(v, []).append(k)
    tied = {v: set(keys[1:]) for v, keys in readers.items() if len(keys) > 1}
    if not tied:
        return graph
    g = graph.copy()
    for v, keys in tied.items():
        c = g.constants[v]
        for k in sorted(keys, key=readers[v].index):
            name = f"{v}@{k}"
            g.constants[name] = Constant(name, c.type, init=DerivedInit(c, lambda x: x, f"per-node copy of {v}"))
            g.types[name] = c.type
    for n in g.nodes:
        k = node_key(n)
        n.inputs = [f"{v}@{k}" if k in tied.get(v, ()) else v for v in n.inputs]
    return g


def _rects(a: int, b: int, cols: int) -> list[tuple[int, int, int, int]]:
    """Row-major elements [a, b) of a matrix with `cols` columns as at most three rectangles (r0, r1, c0, c1)."""
    ra, ca, rb, cb = a // cols, a % cols, b // cols, b % cols
    if ra == rb:
        return [(ra, ra + 1, ca, cb)]
    out = []
    if ca:
        out.append((ra, ra + 1, ca, cols))
        ra += 1
    if rb > ra:
        out.append((ra, rb, 0, cols))
    if cb:
        out.append((rb, rb + 1, 0, cb))
    return out


@dataclass
class _Spread:
    """Per-layer storage: tiles filled in order up to their `cap` bytes each; when the last is full (alignment padding
    made the layer's bytes more than the caps), every cap grows a little and filling restarts at tile 0."""

    cap: np.ndarray  # [T] bytes each tile may store in this layer (spread_caps)
    used: np.ndarray  # [T] bytes stored on each tile in this layer
    tile: int = 0


def spread_caps(before: np.ndarray, layer_bytes: int, layers: int, level: bool = False) -> np.ndarray:
    """Each tile's share of one layer's storage when a run of `layers` identical layers stores `layer_bytes` each over
    tiles that hold `before` weight bytes already: the same share on every tile (the layer's bytes over the tiles,
    aligned), or with `level` water-filled, so that before + layers x cap is as even as it can be (tiles above the
    level store nothing). Levelling is the Lowerer's retry (level_weights) for a plan whose fullest tile overflows by
    less than its weights exceed the mean tile's: BERT-base's word-embedding table (61 KB on each of 768 tiles) put that
    tile at 178.7 KB of weights against a mean of 149 KB at batch 128. It is not the default: the weights placed after
    a run go to the least-loaded tiles and fill what even shares leave low, and where a few tiles stand out (SigLIP
    so400m's patch embedding, 28.6 KB on 24 tiles at batch 11) levelling the run under them raised its fullest tile."""
    before = np.asarray(before, np.float64)
    if not level or before.min() == before.max():
        return np.full(len(before), int(align(-(-layer_bytes // len(before)))), np.int64)
    total = float(layers) * layer_bytes
    lv = np.sort(before)
    # the level L where sum(max(0, L - before)) = total: over the k lowest tiles, L = (total + their sum) / k
    k = np.arange(1, len(lv) + 1)
    level_at = (total + np.cumsum(lv)) / k
    ok = level_at >= lv  # (k tiles below the level, and the level below the next tile)
    ok[:-1] &= level_at[:-1] <= lv[1:]
    share = np.maximum(0.0, level_at[np.flatnonzero(ok)[0]] - before) / layers
    return align(np.ceil(share).astype(np.int64))


class SharedLayers(LayerReplay):
    """Mixin for the Lowerer: the rewinds and the spread weight storage of shared-layer mode, and the copies of a run's
    first layer for the layers after it (plan/replay.py)."""

    share_layers = False
    level_weights = False  # level the runs' storage against the weights placed before them (spread_caps)

    def _init_layers(self) -> None:
        self._run: LayerKey | None = None  # (run, index) of the layer being lowered
        self._snap = None  # placement state at the start of the run's first layer
        self._spread: _Spread | None = None
        self._carry: tuple[str, str] | None = None  # the layer's (input, output) hidden state
        self._carry_owner = ""  # the name of the layer's last node: the re-layout of its output is the layer's
        self._by_layer: dict | None = None  # layer -> its nodes, made on first use
        self.weight_layer: dict[int, LayerKey] = {}  # weight buffer -> the layer it was made in (streaming reads it)
        self._init_replay()

    def new_buffer(self, name: str, category: str, tiles, sizes) -> int:
        buf = super().new_buffer(name, category, tiles, sizes)  # type: ignore[misc]
        if category == "weights" and self._run is not None:
            self.weight_layer[buf] = self._run
        return buf

    def _layer_nodes(self, key: LayerKey) -> list:
        if self._by_layer is None:
            self._by_layer = {}
            for n in self.graph.nodes:
                self._by_layer.setdefault(self.layers.get(node_key(n)), []).append(n)
        return self._by_layer.get(key, [])

    def _run_length(self, key: LayerKey) -> int:
        """How many layers key's run has."""
        return 1 + max(i for r, i in self.layers.values() if r == key[0])

    def _layer_bytes(self, key: LayerKey) -> int:
        """Bytes of the constants one layer's nodes read (weights, biases, FP8 scales, LayerNorm parameters): what
        its spread storage holds."""
        consts = {v for n in self._layer_nodes(key) for v in n.inputs if v and v in self.graph.constants}
        return sum(int(align(int(self.types[v].nbytes))) for v in consts)

    def _enter(self, owner: str) -> bool:
        """Called before each node: start, continue or end a run of layers, rewinding placement at layer starts.
        True when the node's layer was copied from its run's template (plan/replay.py): the node is not lowered."""
        key = self.layers.get(owner)
        if self._run is not None and key == self._run:
            if not self._replayed:
                self._carry_owner = owner
            return self._replayed
        if self._run is not None:
            self._pin_carried()
            self._record_end()
        if self._run is not None and (key is None or key[0] != self._run[0]):
            self.wload = self.placed.copy()  # leaving the run: later placements see the true weight loads
            self._run = self._snap = self._spread = None
        self._replayed = False
        if key is None:
            return False
        if self._run is None:
            self._snap = (self.cursor, self.row_cursor, self.wload.copy())
        else:
            self.cursor, self.row_cursor, wload = self._snap
            self.wload = wload.copy()
        if self.steps and (self.steps[-1].groups or self.steps[-1].transfers):
            self.compute_empty()  # every layer starts on a step of its own, so all layers have the same steps
        self._run, self._carry, self._carry_owner = key, self._carried(key), owner
        # (every layer of a run starts from the same weight loads, so gets the same caps)
        self._spread = _Spread(spread_caps(self.wload, self._layer_bytes(key), self._run_length(key),
                                           self.level_weights), np.zeros(self.T, I64))
        self._replayed = self._replay(key)
        if not self._replayed:
            self._record_start(key)
        return self._replayed

    def _spread_pieces(self, rows: int, cols: int, isz: int) -> list[tuple[int, int, int, int, int]]:
        """Storage for a [rows, cols] block: (tile, r0, r1, c0, c1) rectangles of it that cover its row-major
        elements in order, filling tiles in order up to the cap (a rectangle never holds a partial row and more).
        Element granularity keeps every tile within a few bytes of the cap, which matters: the fullest tile holds
        that much once per layer."""
        sp = self._spread
        out: list[tuple[int, int, int, int, int]] = []
        e, n = 0, rows * cols
        while e < n:
            room = (int(sp.cap[sp.tile]) - int(sp.used[sp.tile])) // isz
            if room <= 0:
                sp.tile += 1
                if sp.tile == self.T:
                    sp.tile, sp.cap = 0, sp.cap + 8 * ALIGN_SLACK
                continue
            end = min(e + room, n)
            for r0, r1, c0, c1 in _rects(e, end, cols):
                out.append((sp.tile, r0, r1, c0, c1))
                sp.used[sp.tile] += int(align((r1 - r0) * (c1 - c0) * isz))
            e = end
        return out

    def _spread_operand(self, name: str, const: str, dtype: str, tl, r0, r1, c0, c1):
        """Block [r0:r1, c0:c1] of a constant for every tile of tl, stored spread (each distinct block once, in
        pieces) and received once by every tile that needs it, into a temporary buffer: (buffer, offset) per entry."""
        isz = np.dtype(dtype).itemsize
        tl = np.asarray(tl, I64)
        uniq, inv = unique_rows(np.stack([r0, r1, c0, c1], axis=1))
        inv = inv.reshape(-1)
        img, blk, off = [], [], []  # storage rectangles (tile, r0, r1, c0, c1 of the constant), their block, offset
        for b, (a0, a1, b0, b1) in enumerate(uniq.tolist()):
            for t, q0, q1, d0, d1 in self._spread_pieces(a1 - a0, b1 - b0, isz):
                img.append((t, a0 + q0, a0 + q1, b0 + d0, b0 + d1))
                blk.append(b), off.append((q0 * (b1 - b0) + d0) * isz)
        img = np.array(img, I64).reshape(-1, 5)
        hbuf, hrel = self.resident(name, const, dtype, img[:, 0], img[:, 1], img[:, 2], img[:, 3], img[:, 4])
        hrel, blk, off = (np.asarray(a, I64) for a in (hrel, blk, off))
        nbytes_img = (img[:, 2] - img[:, 1]) * (img[:, 4] - img[:, 3]) * isz
        nb = (uniq[:, 1] - uniq[:, 0]) * (uniq[:, 3] - uniq[:, 2]) * isz
        # each tile receives each distinct block it needs once
        need, back = unique_rows(np.stack([tl, inv], axis=1))
        drel, used = block_rel_offsets(need[:, 0], nb[need[:, 1]])
        sbuf = self.new_buffer(f"{name}@stream", "buffers", *used)
        order = np.argsort(blk, kind="stable")
        starts = np.searchsorted(blk[order], np.arange(len(uniq) + 1))
        # Entry i of `need` receives every storage piece of its block (in piece order).
        cnt = starts[need[:, 1] + 1] - starts[need[:, 1]]
        dst = np.repeat(np.arange(len(need), dtype=I64), cnt)
        piece = order[np.repeat(starts[need[:, 1]], cnt) + positions_in_runs(cnt)]
        nbytes = nbytes_img[piece]
        self.exchange(make_transfers(img[piece, 0], hbuf, hrel[piece], 1, nbytes, nbytes, need[dst, 0], sbuf,
                                     drel[dst] + off[piece], nbytes))
        return np.full(len(tl), sbuf, I64), drel[back.reshape(-1)]

    def _spread_layout(self, value: str, rows: int, cols: int, dtype: str):
        """A constant read as an activation (e.g. a LayerNorm scale, multicast to its users): its home layout in
        the layer's spread storage. A layout is a grid of blocks, so a one-row constant is cut in columns and any
        other in whole rows."""
        if rows == 1:
            pieces = self._spread_pieces(1, cols, np.dtype(dtype).itemsize)
            rc, cc, grid = [0, 1], [p[3] for p in pieces] + [cols], [[p[0] for p in pieces]]
        else:
            pieces = [(t, q0, q1) for t, q0, q1, _, _ in self._spread_pieces(rows, 1, cols * np.dtype(dtype).itemsize)]
            rc, cc, grid = [p[1] for p in pieces] + [rows], [0, cols], [[p[0]] for p in pieces]
        lay = self.alloc_layout(value, rows, cols, dtype, rc, cc, grid, "weights")
        self.count_weights(lay.buf)
        return lay

    # ------------------------------------------------------------------------------------------------ the carried value
    def _carried(self, key: LayerKey) -> tuple[str, str] | None:
        """(value the layer reads from before it, value it leaves to after it) when there is one of each of the same
        type, e.g. a transformer layer's hidden states in and out."""
        nodes = self._layer_nodes(key)
        made = {o for n in nodes for o in n.outputs}

        def mine(v: str) -> bool:  # read by no other layer of the run (unlike an attention mask every layer reads)
            keys = [self.layers.get(node_key(c)) for c in self.consumers.get(v, [])]
            return all(k is None or k == key or k[0] != key[0] for k in keys)

        ins = {v for n in nodes for v in n.inputs if v and v not in made and v not in self.graph.constants and mine(v)}
        outs = {o for o in made if o in self.graph.outputs or
                any(self.layers.get(node_key(c)) != key for c in self.consumers.get(o, []))}
        if len(ins) != 1 or len(outs) != 1:
            return None
        (i,), (o,) = ins, outs
        return (i, o) if self.types[i] == self.types[o] else None

    def _pin_carried(self) -> None:
        """Put the layer's output in its input's layout, so that the next layer reads it exactly as this one did."""
        if self._carry is None:
            return
        x_in, x_out = self._carry
        src, want = self.layout_of(x_out), self.layout_of(x_in)
        if src.same_blocks(want):
            return
        owner, self.owner = self.owner, self._carry_owner
        lay = self.alloc_layout(f"{x_out}@carried", want.rows, want.cols, want.dtype, want.row_cuts, want.col_cuts,
                                want.tiles)
        tl, rel, br0, br1, bc0, bc1 = blocks(lay)
        self.exchange(gather_rects(src, br0, br1, bc0, bc1, tl, lay.buf, rel, (bc1 - bc0) * lay.itemsize))
        self.layouts[x_out] = lay
        self.owner = owner

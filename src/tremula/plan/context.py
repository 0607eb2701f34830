"""The lowering context: the state a lowering rule (plan/lower_*.py) reads and the services it calls to place
values, move them (exchanges) and run codelets on them (compute steps). A rule is a function of (context, node); the
context holds everything a plan decides as it goes (layouts, buffers, steps, weights per tile), so a rule keeps no
state of its own between nodes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tremula.errors import TremulaError
from tremula.ir.graph import Graph, Node
from tremula.ir.layers import LayerKey, find_layers, layer_roles, node_key
from tremula.ir.ops import OPS, _norm_axis
from tremula.plan.exchange import SymTransfers, gather_elems, gather_rects, make_transfers
from tremula.plan.layers import SharedLayers
from tremula.plan.layout import Layout, block_rel_offsets, blocks, reshape_free, view2d
from tremula.plan.head_views import head_views
from tremula.plan.state import LoweringState, SymConst
from tremula.plan.strategies import (
    BUFFER_FRACTION,
    FREE_SHARE,
    ROW_BLOCK_FRACTION,
    TEMP_FRACTION,
    WEIGHT_FRACTION,
)
from tremula.sorting import positions_in_runs
from tremula.target.overheads import BASE_CODE_BYTES, CODE_BYTES, OPTIONAL_CODELETS

I64 = np.int64
STRIDE = 1 << 40  # index maps encode (input k, element e) as k * STRIDE + e

# Every op an element-wise codelet runs, from its row in ir/ops.py (Identity too, which its row plans as a move).
ELEMENTWISE = {name for name, d in OPS.items() if d.elementwise and d.codelet}
MATMULS = ("Linear", "MatMul", "LinearFp8")
# Column blocks of the residual stream under a memory budget (lower_linear._panel_parts). Six: of 4, 6, 8 and 12,
# the one whose plan of SigLIP so400m fp8 at batch 8 has the smallest fullest tile (950, 765, 867 and 1,021 KB);
# fewer panels make the matmuls' output blocks too wide, more make their K splits' reduce-scatters long.
PANEL_PARTS = 6


def tile_room(graph: Graph, chip) -> tuple[int, int]:
    """(bytes of a tile's SRAM left after code, bytes of all matmul weights): the code bounded by every codelet's
    on every tile (FP8 ones only when used)."""
    lin_bytes = sum(graph.types[n.inputs[1]].nbytes for n in graph.nodes
                    if n.op in MATMULS and n.inputs[1] in graph.constants)
    needs = {"fp8"} if any(n.op == "LinearFp8" for n in graph.nodes) else set()
    code = sum(v for c, v in CODE_BYTES.items() if OPTIONAL_CODELETS.get(c, "always") in needs | {"always"})
    return chip.sram_bytes_per_tile - BASE_CODE_BYTES - code, lin_bytes


def free_temp_fraction(graph: Graph, chip) -> float:
    """The operand-block budget (a Lowerer's temp_fraction) of the first, fastest plan, from what a tile has left
    once code and one copy of every matmul weight are placed: an op's temporaries may take FREE_SHARE of that (its
    buffer budget is BUFFER_FRACTION / TEMP_FRACTION times its operand budget), never less than the fixed
    TEMP_FRACTION the tighter plans use. ViT-B/16 fp16 leaves 77 % of a C600 tile (0.23), SigLIP so400m fp8 49 %
    (0.15), a tiny model nearly all of it."""
    usable, lin_bytes = tile_room(graph, chip)
    free = max(0, usable - lin_bytes // chip.tiles)
    return max(TEMP_FRACTION, FREE_SHARE * free / chip.sram_bytes_per_tile * TEMP_FRACTION / BUFFER_FRACTION)


def is_panels(lay: Layout) -> bool:
    """Whether `lay` is the residual stream's panels (PANEL_PARTS even column blocks, under a memory budget)."""
    return lay.even_col_parts == PANEL_PARTS


class LoweringContext(SharedLayers, LoweringState):
    """What lowering rules share: the graph and chip, the plan so far (LoweringState), the layer sharing
    (SharedLayers) and the choices that span nodes (a matmul pair's strategy, a fused projection's shared operand)."""

    def __init__(self, graph: Graph, chip, progress: Callable[[str, int, int], None] | None = None,
                 temp_fraction: float = TEMP_FRACTION, perm_fraction: float | None = None, share_layers: bool = False,
                 layers: dict[str, LayerKey] | None = None, replay: bool = True, thrift: str = "free",
                 level_weights: bool = False, op_scale: dict[str, float] | None = None,
                 code_limit: int | None = None):
        super().__init__(chip.tiles)
        # node_key -> (run, index) of the repeated layers, found by structure (ir/layers.py) unless the caller did
        self.layers = find_layers(graph) if layers is None else layers
        self.temp_fraction, self.perm_fraction = temp_fraction, perm_fraction
        # role (ir/layers.layer_roles: a node of a run's first layer, or a node outside runs) -> its operand budget
        # over temp_fraction: an op whose steps leave bytes free takes more than the plan-wide budget
        # (pipeline._grown_ops)
        self.op_scale = op_scale or {}
        self.plan_fraction = temp_fraction
        self.roles = layer_roles(graph, self.layers) if self.op_scale else {}
        # Which of the choices that buy cycles with bytes to take: "free", as the cost model likes them; "lean", only
        # those that cost no more bytes than going without (K rounds: strategies.choose_linear) or fit the weight-block
        # budget (a fused projection's parts on one gathered operand: _fused_apart)
        self.thrift = thrift
        # bytes a tile would save at most, in one op's temporaries, with lean choices instead of free ones
        # (pipeline.plan_graph retries a plan that does not fit lean only when they could make it fit)
        self.lean_saves = 0
        self.share_layers, self.replay = share_layers, replay  # replay: copy a run's first layer (plan/replay.py)
        self.level_weights = level_weights  # shared layers' storage levelled (plan/layers.spread_caps)
        self._init_layers()
        self.graph, self.chip, self.progress = graph, chip, progress
        self.types = graph.types
        self._ex_written: set[int] = set()
        self.paired: dict = {}  # matmul node name -> the strategy chosen for it together with its producer
        # While a fused projection's parts are lowered apart over one gathered operand: the strategy they share
        # ("key"), the first part's tiles, x, partials and receive buffers, and each part's rounds; else None
        self.shared_x: dict | None = None
        self.head_in, self.head_out, self.head_skip = head_views(graph)
        # [B*S, H*d] values attention reads or writes per head: H column parts for the matmul that makes or reads them
        self.head_parts = {hv.value: hv.heads for hv in (*self.head_in.values(), *self.head_out.values())}
        self._split_heads(graph)
        self.producers = graph.producers()
        self.n_linear = sum(1 for n in graph.nodes if n.op in MATMULS and n.inputs[1] in graph.constants)
        self.consumers = graph.consumers()
        # Cap on how many times matmul weights are replicated, so all of them together stay within the budget of
        # what a tile has left after code.
        usable, lin_bytes = tile_room(graph, chip)
        self.pm_max = max(1, int(WEIGHT_FRACTION * max(usable, 0) * chip.tiles // max(lin_bytes, 1)))
        self.cursor = 0  # first tile of the next weight placement: rotating spreads weights over all tiles
        self.row_block_bytes = int(ROW_BLOCK_FRACTION * chip.sram_bytes_per_tile)
        self.spread_rows = perm_fraction is None  # the fastest plan first; budgets keep row layouts compact
        # Stop with CodeOverflow once the exchange code of the steps made so far overflows this many bytes on a tile
        # (None: never). Without shared layers every step keeps its code, so what is counted can only grow: SigLIP
        # so400m fp16 at batch 12 unshared reserved 4.3 MB of a 208 KiB region, and lowering all 27 layers to find
        # that out took 145 s and 23 GB of host memory (pipeline.plan_graph then plans shared layers).
        self.code_limit = None if share_layers else code_limit
        self._code_seen, self._excode = 0, np.zeros(chip.tiles, I64)
        # every step's exchange code once lowering is done, when it was counted (the memory plan takes it:
        # plan/finalize.memory_plan), else None
        self.exchange_code: np.ndarray | None = None

    def _split_heads(self, graph: Graph) -> None:
        """A fused projection (passes/fuse_qkv.py) whose Split outputs attention reads per head: its output columns
        are cut at every head of every part (Q's, K's and V's heads), so the Split's points fall on block edges and
        each head view reads whole blocks."""
        for n in graph.nodes:
            if n.op != "Split" or not _last_axis(n, self.types):
                continue
            heads = [self.head_parts.get(o, 0) for o in n.outputs]
            widths = [self.types[o].shape[-1] for o in n.outputs]
            if all(heads) and len({w // h for w, h in zip(widths, heads)}) == 1 and \
                    all(w % h == 0 for w, h in zip(widths, heads)):
                self.head_parts[n.inputs[0]] = sum(heads)

    def fraction(self, node: Node) -> float:
        """The operand budget of `node`'s strategies: the plan-wide one, scaled for its role (op_scale)."""
        key = node_key(node)
        return self.plan_fraction * self.op_scale.get(self.roles.get(key, key), 1.0)

    def exchange(self, t: SymTransfers) -> None:
        """Append to the last step's exchange, unless it reads what that exchange writes (then open a new step)."""
        if len(t) == 0:
            return
        if self.steps and self._ex_written & _ids(t.src_buf):
            self.compute_empty()
        super().exchange(t)
        self._ex_written |= _ids(t.d_buf)

    def compute_empty(self) -> None:
        from tremula.plan.state import SymStep

        self.steps.append(SymStep(label="exchange"))
        self._ex_written = set()

    def compute(self, groups, value: str, phase: str = "", part: str = "") -> None:
        super().compute(groups, value, phase, part)
        self._ex_written = set()

    def take_tiles(self, n: int) -> np.ndarray:
        """n tiles for an op that places resident weights: the n with the fewest weight bytes so far (ties from a
        rotating cursor, so equal loads give consecutive tiles). Any n tiles will do, so weights stay balanced to
        within about one block even when ops of very different sizes follow each other (a window of consecutive
        tiles left SigLIP so400m's fullest tile 38 % above the mean)."""
        n = min(n, self.T)
        rot = (np.arange(self.T) - self.cursor) % self.T
        pick = np.lexsort((rot, self.wload))[:n]
        pick = pick[np.argsort(rot[pick], kind="stable")]
        self.cursor = (int(pick[-1]) + 1) % self.T
        return pick.astype(I64)

    def stream_tiles(self, pm: int, n: int) -> np.ndarray:
        """Tiles for a streamed-weight matmul: row group 0 (n tiles, the resident weights) where weights are fewest,
        the other pm - 1 groups on the next other tiles of the row rotation (they hold only temporaries)."""
        home = self.take_tiles(n)
        rest = np.setdiff1d(np.arange(self.T, dtype=I64), home)
        rest = np.roll(rest, -(self.row_cursor % len(rest)))[: (pm - 1) * n]
        self.row_cursor = (int(rest[-1]) + 1) % self.T
        return np.concatenate([home, rest])

    def layout_of(self, value: str) -> Layout:
        if value in self.layouts:
            return self.layouts[value]
        if value not in self.graph.constants:
            raise TremulaError(f"value {value!r} is used before it is produced")
        # A constant read as an activation gets a home: rows spread over tiles, placed at load time.
        t = self.types[value]
        rows, cols = view2d(t.shape)
        if self._spread is not None:  # in a shared layer: in the layer's spread storage
            lay = self._spread_layout(value, rows, cols, t.dtype)
        else:
            lay = self.row_layout(value, rows, cols, t.dtype, category="weights")
        tl, rel, r0, r1, c0, c1 = blocks(lay)
        self.consts.append(SymConst(value, tl, lay.buf, rel, r0, r1, c0, c1, t.dtype))
        self.layouts[value] = lay
        return lay

    def as_rows(self, lay: Layout, name: str) -> Layout:
        """The same matrix with whole rows per tile (an exchange when the layout splits columns)."""
        if lay.is_rows:
            return lay
        new = self.row_layout(name, lay.rows, lay.cols, lay.dtype, category="buffers")
        tl, rel, r0, r1, _, _ = blocks(new)
        self.exchange(gather_rects(lay, r0, r1, 0, lay.cols, tl, new.buf, rel, lay.cols * lay.itemsize))
        return new

    def set_output(self, value: str, lay: Layout) -> None:
        """Record `lay` (a [rows, cols] matrix) as the layout of `value`, re-viewing it in the value's own 2-D shape."""
        rows, cols = view2d(self.types[value].shape)
        free = reshape_free(lay, rows, cols)
        if free is not None:
            self.layouts[value] = free
            return
        self.layouts[value] = self.move_elems(value, [lay], np.arange(rows * cols, dtype=I64), rows, cols, lay.dtype)

    def move_elems(self, name: str, srcs: list[Layout], idx: np.ndarray, rows: int, cols: int, dtype: str) -> Layout:
        """A new row layout whose element e is element idx[e] % STRIDE of source idx[e] // STRIDE."""
        out = self.row_layout(name, rows, cols, dtype)
        flat = idx.reshape(-1)
        g = _chunk(flat, cols, srcs)  # work in runs of g elements that are contiguous on both sides
        if g > 1:
            flat = flat[::g]
        e = np.arange(len(flat), dtype=I64) * g
        bi = np.repeat(np.arange(len(out.row_cuts) - 1), np.diff(out.row_cuts))[e // max(cols, 1)]
        d_tile = out.tiles[bi, 0]
        d_rel = out.rel[bi, 0] + (e - out.row_cuts[bi] * cols) * out.itemsize
        parts = []
        if len(srcs) == 1:
            parts.append(gather_elems(srcs[0], flat, d_tile, out.buf, d_rel, g))
        else:
            which = flat // STRIDE
            for k, src in enumerate(srcs):
                sel = which == k
                if sel.any():
                    parts.append(gather_elems(src, flat[sel] % STRIDE, d_tile[sel], out.buf, d_rel[sel], g))
        self.exchange(SymTransfers.concat(parts))
        return out

    def block_operands(self, value: str, out_shape: tuple[int, ...], lay: Layout, tag: str,
                       resident: bool = True) -> tuple:
        """Operand (buf, rel, rows, cols) per block of `lay` for `value` broadcast to out_shape."""
        t = self.types[value]
        tl, _, r0, r1, c0, c1 = blocks(lay)
        if t.shape == out_shape:
            src = self.layout_of(value)
            if src.same_blocks(lay):
                return (src.buf, src.rel.reshape(-1), r1 - r0, c1 - c0)
            tmp = self.alloc_layout(f"{value}@{tag}", lay.rows, lay.cols, t.dtype, lay.row_cuts, lay.col_cuts,
                                    lay.tiles, "buffers")
            self.exchange(gather_rects(src, r0, r1, c0, c1, tl, tmp.buf, tmp.rel.reshape(-1), (c1 - c0) * tmp.itemsize,
                                       disjoint=True))  # (lay's blocks partition the matrix)
            return (tmp.buf, tmp.rel.reshape(-1), r1 - r0, c1 - c0)
        rows, cols = lay.rows, lay.cols
        # The source element of output element (r, c): row_of[r] * cols + c when the operand's last axis is not
        # broadcast (row_of: the source row each output row reads), else from the whole index map idx [rows, cols]
        # (a bias-like column), which at bert-base b128 would be 12.6 M entries for its position embeddings.
        row_of = _broadcast_rows(t.shape, out_shape)
        if row_of is not None:
            idx = None
            row_const, col_const = bool((row_of == row_of[:1]).all()), cols == 1
        else:
            idx = np.broadcast_to(np.arange(t.size, dtype=I64).reshape(t.shape), out_shape).reshape(rows, cols)
            row_const, col_const = bool((idx == idx[:1]).all()), bool((idx == idx[:, :1]).all())
        nr = np.ones_like(r0) if row_const else r1 - r0
        nc = np.ones_like(c0) if col_const else c1 - c0
        if resident and value in self.graph.constants and row_const and view2d(t.shape)[0] == 1:
            # Bias-like constant: the same slice for every row, kept resident on each tile that needs it.
            cc0 = np.zeros_like(c0) if col_const else c0
            if self._spread is not None:  # in a shared layer: stored spread, streamed to the tiles that need it
                z = np.zeros_like(cc0)
                buf, wrel = self._spread_operand(f"{value}@{tag}", value, t.dtype, tl, z, z + 1, cc0, cc0 + nc)
                return (buf, wrel, nr, nc)
            buf, wrel = self.resident(f"{value}@{tag}", value, t.dtype, tl, 0, 1, cc0, cc0 + nc)
            return (buf, wrel, nr, nc)
        src = self.layout_of(value)
        isz = np.dtype(t.dtype).itemsize
        sizes = nr * nc * isz

        trel, used = block_rel_offsets(tl, sizes)
        buf = self.new_buffer(f"{value}@{tag}", "buffers", *used)
        if row_const and view2d(t.shape)[0] == 1:  # a [1, cols] vector: each block reads one slice of its row
            cc0 = np.zeros_like(c0) if col_const else c0
            self.exchange(gather_rects(src, 0, 1, cc0, cc0 + nc, tl, buf, trel.reshape(-1), nc * isz))
            return (buf, trel, nr, nc)
        # Block k takes idx[r0:r0 + nr, c0:c0 + nc] in row-major order; j counts its elements. Aligned runs of g
        # elements consecutive on both sides (a row of a broadcast embedding) go as one entry each: the same
        # transfers, from g times fewer entries.
        g = _broadcast_chunk(idx, nc, src, row_of, cols)
        cnt = nr * nc // g
        blk = np.repeat(np.arange(len(tl)), cnt)
        j = positions_in_runs(cnt) * g  # the first element of each run
        r, c = r0[blk] + j // nc[blk], c0[blk] + j % nc[blk]
        elems = row_of[r] * cols + c if row_of is not None else idx[r, c]
        self.exchange(gather_elems(src, elems, tl[blk], buf, trel.reshape(-1)[blk] + j * isz, g))
        return (buf, trel, nr, nc)

    def weight_operand(self, name: str, const: str, dtype: str, tl, home, src_i, r0, r1, c0, c1):
        """Block [r0:r1, c0:c1] of a constant for every tile of a matmul: (buffer, offset) per tile. Resident on
        the `home` tiles; each other tile gets its home tile src_i's copy in a temporary buffer, one multicast per
        block (streamed weights, and their bias and scale: a bias copy on every row group cost SigLIP so400m about
        25 KB a tile at batch 4)."""
        r0, r1, c0, c1 = (np.broadcast_to(np.asarray(a, I64), tl.shape) for a in (r0, r1, c0, c1))
        if self._spread is not None:  # in a shared layer: stored spread, streamed to every tile
            return self._spread_operand(name, const, dtype, tl, r0, r1, c0, c1)
        hbuf, hrel = self.resident(name, const, dtype, tl[home], r0[home], r1[home], c0[home], c1[home])
        buf, rel = np.full(len(tl), hbuf, I64), np.zeros(len(tl), I64)
        rel[home] = hrel
        far = ~home
        if far.any():
            nb_ = (r1 - r0)[far] * (c1 - c0)[far] * np.dtype(dtype).itemsize
            sbuf = self.new_buffer(f"{name}@stream", "buffers", tl[far], nb_)
            srel = rel[src_i[far]]
            self.exchange(make_transfers(tl[src_i[far]], hbuf, srel, 1, nb_, nb_, tl[far], sbuf, 0, nb_))
            buf[far] = sbuf
        return buf, rel

    def as_matrix(self, value: str, cols: int) -> Layout:
        lay = self.layout_of(value)
        if lay.cols == cols:
            return lay
        free = reshape_free(lay, lay.rows * lay.cols // cols, cols)
        if free is not None:
            return free
        return self.move_elems(f"{value}@mat", [lay], np.arange(lay.rows * lay.cols, dtype=I64),
                                lay.rows * lay.cols // cols, cols, lay.dtype)


def _last_axis(split, types) -> bool:
    """A Split of its input's last axis (the columns of its 2-D view)."""
    rank = len(types[split.inputs[0]].shape)
    return rank > 0 and _norm_axis(split.attrs.get("axis", 0), rank) == rank - 1


def _largest_run(width: int, srcs: list[Layout], moves_runs: Callable[[int], bool]) -> int:
    """The largest g dividing `width` and every source's row length and column cuts (so a run of g stays inside one
    source block) for which moves_runs(g), tried largest first; 1 when none."""
    top = int(np.gcd.reduce(np.concatenate([[width]] + [np.concatenate([[s.cols], s.col_cuts]) for s in srcs])))
    # every divisor of the gcd, largest first (not only the divisors of the last one tried: from 12, after 6 and 3
    # came 1, and SigLIP's patches, runs of 14 pixels at even columns of a 384-wide row, moved one pixel at a time)
    for g in sorted((d for d in range(2, top + 1) if top % d == 0), reverse=True):
        if moves_runs(g):
            return g
    return 1


def _chunk(flat: np.ndarray, cols: int, srcs: list[Layout]) -> int:
    """The largest g dividing the output row length and every source column block, such that the index map moves
    aligned runs of g consecutive elements (so the map can be handled g elements at a time)."""

    # Where the map does not step by one (positions j + 1 with flat[j + 1] != flat[j] + 1), found once: runs of g
    # are consecutive when every such position is a multiple of g, instead of a pass over the map per g tried.
    breaks = np.flatnonzero(np.diff(flat) != 1) + 1

    def moves_runs(g: int) -> bool:
        if len(flat) % g:
            return False
        return not ((flat[::g] % STRIDE) % g).any() and not (breaks % g).any()

    return _largest_run(cols, srcs, moves_runs)


def _broadcast_rows(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> np.ndarray | None:
    """For an operand of `shape` broadcast to out_shape along its leading axes only (its last axis is the output's):
    the row of the operand's 2-D view that each row of the output's reads; None when the last axis is broadcast."""
    if not shape or not out_shape or shape[-1] != out_shape[-1]:
        return None
    lead = (1,) * (len(out_shape) - len(shape)) + tuple(shape[:-1])
    n = int(np.prod(lead, dtype=I64))
    return np.broadcast_to(np.arange(n, dtype=I64).reshape(lead), out_shape[:-1]).reshape(-1)


def _broadcast_chunk(idx: np.ndarray | None, nc: np.ndarray, src: Layout, row_of: np.ndarray | None = None,
                     cols: int = 0) -> int:
    """_chunk of a broadcast operand's element map (block_operands), found on the index matrix idx [rows, cols]
    instead of on the map's every element: the largest g dividing every block width nc, the source's row length and
    column cuts, such that each aligned run of g columns of idx is g consecutive source elements starting at a
    multiple of g. The blocks partition idx's columns at multiples of g, so these are exactly the map's runs (a block
    of one row of a map whose rows are all equal reads a row that every other row equals). With `row_of`
    (_broadcast_rows; idx None) idx[r, c] is row_of[r] * cols + c: every row is one run, and a run of g starts at a
    multiple of g where its row's start does."""
    if row_of is not None:
        if row_of.size == 0 or cols == 0:
            return 1
        starts = row_of * cols
        return _largest_run(int(np.gcd.reduce(np.asarray(nc, I64).reshape(-1))), [src],
                            lambda g: not (starts % g).any())
    if idx.size == 0:
        return 1
    step: list[np.ndarray] = []  # (made on the first g tried) column c to c + 1 continues the source's run

    def moves_runs(g: int) -> bool:
        if not step:
            step.append(np.diff(idx, axis=1) == 1)
        inner = np.arange(idx.shape[1] - 1)
        return not (idx[:, ::g] % g).any() and bool(step[0][:, inner % g != g - 1].all())

    return _largest_run(int(np.gcd.reduce(np.asarray(nc, I64).reshape(-1))), [src], moves_runs)


def _ids(a: np.ndarray) -> set[int]:
    """The distinct values of a small-int array (usually all equal: one buffer)."""
    if len(a) and (a == a[0]).all():
        return {int(a[0])}
    return set(np.unique(a).tolist())

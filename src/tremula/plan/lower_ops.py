"""Lower each Graph node onto the tiles: choose its layout/strategy, emit the exchanges that bring its operands, and
the compute sets of its codelets. The result is a LoweringState with symbolic addresses (see plan/state.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from tremula.codelets import f2i
from tremula.codelets.elementwise import BINARY_IDS, UNARY_IDS
from tremula.codelets.fp8 import format_id
from tremula.codelets.norm import REDUCE_IDS
from tremula.errors import TremulaError
from tremula.ir.graph import Graph, Node
from tremula.ir.layers import LayerKey, find_layers, layer_roles, node_key
from tremula.ir.ops import OPS, _norm_axis, rule, slice_index_map, transpose_perm
from tremula.numerics.fp8 import fp8_format
from tremula.plan.exchange import SymTransfers, gather_elems, gather_rects, make_transfers
from tremula.plan.layers import SharedLayers
from tremula.plan.layout import Layout, block_rel_offsets, blocks, even_cuts, reshape_free, view2d
from tremula.plan.lower_attention import AttentionLowering, head_views
from tremula.plan.state import LoweringState, SymConst, SymStream
from tremula.plan.strategies import (
    BUFFER_FRACTION,
    FREE_SHARE,
    ROW_BLOCK_FRACTION,
    SMALL_TABLE_FRACTION,
    TEMP_FRACTION,
    WEIGHT_FRACTION,
    SourceShape,
    cdiv,
    choose_linear,
    choose_linear_pair,
    operand_gather_cycles,
    weight_block_budget,
)
from tremula.sorting import positions_in_runs
from tremula.target import cost_terms
from tremula.target.overheads import BASE_CODE_BYTES, CODE_BYTES, OPTIONAL_CODELETS, exchange_code_bytes

I64 = np.int64
STRIDE = 1 << 40  # index maps encode (input k, element e) as k * STRIDE + e

# Each op's family, from its row in ir/ops.py. ELEMENTWISE holds every op an element-wise codelet runs (Identity too,
# which is planned as a move: `_kind` looks at moves first).
MOVE_OPS = {name for name, d in OPS.items() if d.lower == "move"}
ROW_OPS = {name for name, d in OPS.items() if d.lower == "rows"}
ELEMENTWISE = {name for name, d in OPS.items() if d.elementwise and d.codelet}
MATMULS = ("Linear", "MatMul", "LinearFp8")
# Column blocks of the residual stream under a memory budget (Lowerer._panel_parts). Six: of 4, 6, 8 and 12, the one
# whose plan of SigLIP so400m fp8 at batch 8 has the smallest fullest tile (950, 765, 867 and 1,021 KB); fewer panels
# make the matmuls' output blocks too wide, more make their K splits' reduce-scatters long.
PANEL_PARTS = 6


class CodeOverflow(TremulaError):
    """A lowering stopped early (Lowerer's code_limit): the exchange code of the steps it had made already overflowed
    a tile's code region, which the rest of the graph's steps can only add to (every step keeps its own code when
    layers do not share it), so the plan cannot fit."""

    def __init__(self, tile: int, nbytes: int, limit: int, node: int, nodes: int):
        super().__init__(f"exchange code of {nbytes:,} B on tile {tile} after {node} of {nodes} nodes, over the "
                         f"{limit:,} B code region")
        self.tile, self.nbytes, self.limit, self.node = tile, nbytes, limit, node


def supported(graph: Graph) -> list[str]:
    """Ops in the graph this planner cannot place (each op once)."""
    bad = []
    for n in graph.nodes:
        if not (n.op in OPS and OPS[n.op].lower) and n.op not in bad:
            bad.append(n.op)
    return bad


def tile_room(graph: Graph, chip) -> tuple[int, int]:
    """(bytes of a tile's SRAM left after code, bytes of all matmul weights): the code bounded by every codelet's
    on every tile (FP8 ones only when used)."""
    lin_bytes = sum(graph.types[n.inputs[1]].nbytes for n in graph.nodes
                    if n.op in MATMULS and n.inputs[1] in graph.constants)
    needs = {"fp8"} if any(n.op == "LinearFp8" for n in graph.nodes) else set()
    code = sum(v for c, v in CODE_BYTES.items() if OPTIONAL_CODELETS.get(c, "always") in needs | {"always"})
    return chip.sram_bytes_per_tile - BASE_CODE_BYTES - code, lin_bytes


def _keeps_order(node: Node, types) -> bool:
    """A Transpose that moves only axes of size 1 (a sequence-first [S, 1, D] view of [1, S, D] at batch 1): its
    elements keep their order, so it is a Reshape, in place."""
    if node.op != "Transpose":
        return False
    shape = types[node.inputs[0]].shape
    perm = transpose_perm(node.attrs, len(shape))
    moved = [p for p in perm if shape[p] != 1]
    return moved == sorted(moved)


def free_temp_fraction(graph: Graph, chip) -> float:
    """The operand-block budget (a Lowerer's temp_fraction) of the first, fastest plan, from what a tile has left
    once code and one copy of every matmul weight are placed: an op's temporaries may take FREE_SHARE of that (its
    buffer budget is BUFFER_FRACTION / TEMP_FRACTION times its operand budget), never less than the fixed
    TEMP_FRACTION the tighter plans use. ViT-B/16 fp16 leaves 77 % of a C600 tile (0.23), SigLIP so400m fp8 49 %
    (0.15), a tiny model nearly all of it."""
    usable, lin_bytes = tile_room(graph, chip)
    free = max(0, usable - lin_bytes // chip.tiles)
    return max(TEMP_FRACTION, FREE_SHARE * free / chip.sram_bytes_per_tile * TEMP_FRACTION / BUFFER_FRACTION)


class Lowerer(SharedLayers, AttentionLowering, LoweringState):
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
        self._shared_x: dict | None = None
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

    # ------------------------------------------------------------------------------------------------ driver
    def lower(self) -> LoweringState:
        g = self.graph
        bad = supported(g)
        if bad:
            raise TremulaError(f"the planner cannot place op(s) {', '.join(bad)}; run the passes first or file an "
                               f"issue")
        for name in g.inputs:
            t = self.types[name]
            rows, cols = view2d(t.shape)
            lay = self.row_layout(name, rows, cols, t.dtype)
            self.layouts[name] = lay
            self.host_in.append(SymStream(name, lay))
        for i, node in enumerate(g.nodes):
            if self.progress:
                self.progress("plan", i, len(g.nodes))
            if node.outputs[0] in self.head_skip:  # a head split or merge attention reads or writes in place
                continue
            self.owner, self.op = node.name or node.outputs[0], node.op
            if self.share_layers and self._enter(self.owner):
                continue  # its layer is a copy of its run's first (plan/replay.py)
            self.temp_fraction = self._fraction(node)  # what the node's strategies read
            getattr(self, "_lower_" + self._kind(node.op))(node)
            self.temp_fraction = self.plan_fraction
            if self.code_limit is not None:
                self._check_code(i + 1)
        if self.share_layers:
            self._enter("")  # end the last run of layers
        for o in g.outputs:
            self.host_out.append(SymStream(o, self.layout_of(o)))
        if self.code_limit is not None:  # the last step's code too: what the memory plan reserves, counted once
            self._check_code(len(g.nodes), len(self.steps))
            self.exchange_code = self._excode
        return self

    def _check_code(self, done: int, closed: int | None = None) -> None:
        """Add the exchange code of the steps closed since the last call (all but the last step, which may still
        take transfers, unless `closed` says how many are), as the memory plan reserves it
        (target/overheads.exchange_code_bytes); raise CodeOverflow when a tile's total is over code_limit."""
        closed = len(self.steps) - 1 if closed is None else closed
        if closed <= self._code_seen:
            return
        self._excode += exchange_code_bytes(self.T, self.steps[self._code_seen:closed], self.chip)
        self._code_seen = closed
        t = int(np.argmax(self._excode))
        if self._excode[t] > self.code_limit:
            raise CodeOverflow(t, int(self._excode[t]), self.code_limit, done, len(self.graph.nodes))

    def _fraction(self, node: Node) -> float:
        """The operand budget of `node`'s strategies: the plan-wide one, scaled for its role (op_scale)."""
        key = node_key(node)
        return self.plan_fraction * self.op_scale.get(self.roles.get(key, key), 1.0)

    @staticmethod
    def _kind(op: str) -> str:
        if op in MOVE_OPS:
            return "move"
        if op in ROW_OPS:
            return "rows"
        if op in ELEMENTWISE:
            return "elementwise"
        return op.lower()

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

    def _stream_tiles(self, pm: int, n: int) -> np.ndarray:
        """Tiles for a streamed-weight matmul: row group 0 (n tiles, the resident weights) where weights are fewest,
        the other pm - 1 groups on the next other tiles of the row rotation (they hold only temporaries)."""
        home = self.take_tiles(n)
        rest = np.setdiff1d(np.arange(self.T, dtype=I64), home)
        rest = np.roll(rest, -(self.row_cursor % len(rest)))[: (pm - 1) * n]
        self.row_cursor = (int(rest[-1]) + 1) % self.T
        return np.concatenate([home, rest])

    # ------------------------------------------------------------------------------------------------ layouts
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
        self.layouts[value] = self._move_elems(value, [lay], np.arange(rows * cols, dtype=I64), rows, cols, lay.dtype)

    def _move_elems(self, name: str, srcs: list[Layout], idx: np.ndarray, rows: int, cols: int, dtype: str) -> Layout:
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

    # ------------------------------------------------------------------------------------------------ element-wise
    def _lower_elementwise(self, node) -> None:
        out = node.outputs[0]
        ot = self.types[out]
        rows, cols = view2d(ot.shape)
        lay = None
        ins = list(node.inputs)
        if self.perm_fraction is not None:  # under a memory budget the residual stream takes the panels' blocks
            ins.sort(key=lambda i: not (i and i in self.layouts and self._is_panels(self.layouts[i])))
        # A broadcast operand with more than one row (a position embedding) arrives in every block one row segment at
        # a time: rows x column blocks transfer entries. Into an embedding lookup's layout (the table's columns over
        # the tiles, one column a block) that was bert-base b128's 12.6 M two-byte entries, a third of its compile
        # time and most of the exchange code that kept its plan from fitting. When moving the input to a row layout
        # and the broadcast by whole rows takes fewer entries, and the rows spread over at least as many tiles (the
        # op loses no parallelism: GPT-2 b4's embedding sum on 78 row blocks instead of 768 column blocks cost 1.2 %
        # of its cycles), the op runs on rows.
        bcast = any(j and self.types[j].shape != ot.shape and view2d(self.types[j].shape)[0] > 1
                    for j in node.inputs)
        ins = self._spread_first(ins, ot.shape)
        for i in ins:
            if i and self.types[i].shape == ot.shape and i not in self.graph.constants:
                src = self.layout_of(i)
                ncb, parts = len(src.col_cuts) - 1, self.row_parts(rows, cols, ot.dtype)
                if bcast and rows * ncb > ncb * parts + rows and parts >= src.tiles.size:
                    continue
                others = [j for j in node.inputs if j and j != i and j not in self.graph.constants
                          and self.types[j].shape == ot.shape and not src.same_blocks(self.layout_of(j))]
                tiles = src.tiles
                if others:
                    # Another operand must be re-laid out into these blocks anyway: put them on the next tiles of
                    # the rotation, not the input's own (moving the input's blocks is one contiguous transfer each).
                    # A residual stream kept on one set of tiles makes those tiles receive every layer's re-layout
                    # (SigLIP so400m: 102 KB of exchange code on one tile from its 54 residual Adds, 12 KB on the
                    # mean tile).
                    tiles = (src.tiles + self.row_cursor) % self.T
                    self.row_cursor = (self.row_cursor + src.tiles.size) % self.T
                lay = self.alloc_layout(out, rows, cols, ot.dtype, src.row_cuts, src.col_cuts, tiles)
                break
        if lay is None:
            lay = self.row_layout(out, rows, cols, ot.dtype)
        ins = [i for i in node.inputs if i]
        ops = [self.block_operands(i, ot.shape, lay, out) for i in ins]
        tl, rel, r0, r1, c0, c1 = blocks(lay)
        ops.append((lay.buf, rel, r1 - r0, c1 - c0))
        dtypes = tuple(self.types[i].dtype for i in ins) + (ot.dtype,)
        if node.op == "Where":
            name, params = "where", [0]
        elif node.op in BINARY_IDS:
            name, params = "binary", [BINARY_IDS[node.op]]
        elif node.op == "Fp8Quantize":
            name = "fp8_cast"  # scale and seed differ per layer: columns 1 and 3 (plan/replay.PER_LAYER_PARAMS)
            params = [format_id(node.attrs["fmt"]), int(node.attrs["scale"]),
                      int(node.attrs.get("rounding") == "stochastic"), int(node.attrs.get("seed", 0))]
        elif node.op == "Gelu":
            name = "unary"
            params = [UNARY_IDS["GeluTanh" if node.attrs.get("approximate", "none") == "tanh" else "Gelu"]]
        else:
            name, params = "unary", [UNARY_IDS[node.op]]
        if not (name == "fp8_cast" and params[2]):  # stochastic rounding draws its bits per vertex: keep them
            tl, ops = _merge_runs(tl, ops, dtypes)
        self.compute([self.group(name, dtypes, tl, params, ops)], out)
        self.layouts[out] = lay
        self.strategies[node.name or out] = f"{node.op} on {len(lay.tiles.reshape(-1))} blocks"

    def _spread_first(self, ins: list[str], shape) -> list[str]:
        """The inputs in the order an element-wise op tries their layouts: as given, unless every full-shape input
        lies in blocks of its own (whichever layout is kept, the others move), none of them the residual stream's
        panels, and one spreads over more tiles than the first: then that one first, so the op runs on more tiles.
        BERT's embedding sum: the word lookup's 768 column blocks, the token-type lookup's rows on 1,472 tiles. ViT-B
        at batch 1: the residual Adds on the matmuls' blocks over 1,440 tiles instead of 197 rows on 197 (-3.9 % of
        the cycles in fp32, -5.1 % in fp16); GPT-2 b8 fp16 -8.6 %. Tiles, not blocks: counting blocks also moved
        ViT-B b8 fp32's residual Adds off rows on 1,472 tiles onto 5,760 blocks on 1,440 (4.1 % slower: its
        LayerNorms stayed on column blocks and fc2 took twice the rounds)."""
        full = [i for i in ins if i and self.types[i].shape == shape and i not in self.graph.constants]
        lays = [self.layout_of(i) for i in full]
        if len(full) < 2 or any(self._is_panels(a) for a in lays) or any(
                a.same_blocks(b) for k, a in enumerate(lays) for b in lays[k + 1:]):
            return ins
        spread = [np.unique(a.tiles).size for a in lays]
        k = int(np.argmax(spread))
        if spread[k] <= spread[0]:
            return ins
        return [full[k]] + [i for i in ins if i != full[k]]

    # ------------------------------------------------------------------------------------------------ row ops
    def _lower_rows(self, node) -> None:
        x = node.inputs[0]
        xt, out = self.types[x], node.outputs[0]
        ot = self.types[out]
        rank = len(xt.shape)
        if node.op == "LayerNorm":
            axes = (rank - 1,)
        elif node.op == "Softmax":
            axes = (_norm_axis(node.attrs.get("axis", -1), rank),)
        elif node.attrs.get("axes") is not None:
            axes = tuple(sorted(_norm_axis(a, rank) for a in node.attrs["axes"]))
        else:
            axes = tuple(range(rank))
        keep = [a for a in range(rank) if a not in axes]
        red = int(np.prod([xt.shape[a] for a in axes], dtype=I64)) if axes else 1
        lead = int(np.prod([xt.shape[a] for a in keep], dtype=I64)) if keep else 1
        if node.op == "LayerNorm" or axes == (rank - 1,) or rank == 0:
            src = self.layout_of(x)
            mat = src if (red == src.cols or rank == 0) else None
        else:
            mat = None
        if mat is None:  # bring the reduced axes last: a [lead, red] matrix
            perm = keep + list(axes)
            idx = np.transpose(np.arange(xt.size, dtype=I64).reshape(xt.shape), perm).reshape(-1)
            mat = self._move_elems(f"{x}@T@{out}", [self.layout_of(x)], idx, lead, red, xt.dtype)
        if node.op == "LayerNorm" and mat is not None and self._layernorm_blocks(node, mat):
            return
        mat = self.as_rows(mat, f"{x}@rows@{out}")
        ocols = red if node.op in ("LayerNorm", "Softmax") else 1
        res = self.alloc_layout(out if ocols == red and perm_free(node, axes, rank) else f"{out}@res", mat.rows, ocols,
                                ot.dtype, mat.row_cuts, [0, ocols], mat.tiles)
        tl, rel, r0, r1, _, _ = blocks(mat)
        ops = [(mat.buf, rel, r1 - r0, red)]
        dtypes = [xt.dtype]
        if node.op == "LayerNorm":
            for p in node.inputs[1:]:
                if p:
                    ops.append(self.block_operands_rowvec(p, res, out))
                    dtypes.append(self.types[p].dtype)
            name, params = "layernorm", [f2i(node.attrs.get("epsilon", 1e-5)), int(len(ops) == 3)]
        elif node.op == "Softmax":
            name, params = "softmax", [0]
        else:
            name, params = "reduce", [REDUCE_IDS[node.op]]
        ops.append((res.buf, blocks(res)[1], r1 - r0, ocols))
        dtypes.append(ot.dtype)
        self.compute([self.group(name, tuple(dtypes), tl, params, ops)], out)
        if node.op == "Softmax" and axes != (rank - 1,):  # move the softmax axis back where it was
            perm = keep + list(axes)
            inv = np.argsort(perm)
            shape_p = tuple(xt.shape[a] for a in perm)
            idx = np.transpose(np.arange(xt.size, dtype=I64).reshape(shape_p), inv).reshape(-1)
            r, c = view2d(ot.shape)
            self.layouts[out] = self._move_elems(out, [res], idx, r, c, ot.dtype)
        else:
            self.set_output(out, res)
        self.strategies[node.name or out] = f"{node.op} rows over {len(tl)} tiles"

    def _layernorm_blocks(self, node, src: Layout) -> bool:
        """LayerNorm in place on a layout of column blocks (a matmul's output), instead of re-laying it out in rows:
        each block computes its rows' (mean, M2), every block of a row receives the others' (all-gather, one
        contiguous multicast per block), combines them and normalises its own columns. The output keeps the input's
        blocks, so the next matmul's K slices stay whole blocks. A re-layout to rows costs one exchange instruction
        per row and block on both sides, which grows with the batch (SigLIP so400m at batch 8: 28 KB a tile for its
        54 LayerNorms). False (nothing done) when the columns are not even cuts or the moments would not fit."""
        nr, nc = len(src.row_cuts) - 1, len(src.col_cuts) - 1
        if nc == 1 or not src.even_col_parts:
            return False
        tl, rel, r0, r1, c0, c1 = blocks(src)
        rows, w = r1 - r0, c1 - c0
        mom = nc * rows * 8  # every part's (mean, M2) per row, float32
        if mom.max() > self.row_block_bytes * 4:
            return False
        x, out = node.inputs[0], node.outputs[0]
        xt, ot = self.types[x], self.types[out]
        # Under a memory budget (the compiler's retries) always; else only when it is also the faster of the two
        # (on small models the extra step's sync outweighs the re-layout it saves).
        if self.perm_fraction is None:
            chip, isz = self.chip, src.itemsize
            per = cdiv(src.rows, self.row_parts(src.rows, src.cols, src.dtype))  # rows per tile of as_rows' layout
            as_rows = (cost_terms.exchange_cycles(chip, int((rows * w).max()) * isz, per * src.cols * isz)
                       + cost_terms.sync_cycles(chip) + cost_terms.layernorm_cycles(chip, per, src.cols, xt.dtype))
            rm, wm = int(rows.max()), int(w.max())
            in_place = (cost_terms.layernorm_moments_cycles(chip, rm, wm, xt.dtype) + 2 * cost_terms.sync_cycles(chip)
                        + cost_terms.exchange_cycles(chip, rm * 8, (nc - 1) * rm * 8)
                        + cost_terms.layernorm_apply_cycles(chip, rm, wm, nc, xt.dtype))
            if in_place > as_rows:
                return False
        mrel, used = block_rel_offsets(tl, mom)
        mbuf = self.new_buffer(f"{out}@moments", "buffers", *used)
        j = np.tile(np.arange(nc), nr)
        self.compute([self.group("layernorm_moments", (xt.dtype, "float32"), tl, [0],
                                 [(src.buf, rel, rows, w), (mbuf, mrel + j * rows * 8, rows, 2)])],
                     out, "moments")
        # block (i, j) sends its slot j to the nc - 1 other blocks of row block i
        snd = np.repeat(np.arange(nr * nc), nc)
        dst = (snd // nc) * nc + np.tile(np.arange(nc), nr * nc)
        keep = dst != snd
        snd, dst = snd[keep], dst[keep]
        nb_ = rows[snd] * 8
        self.exchange(make_transfers(tl[snd], mbuf, mrel[snd] + j[snd] * nb_, 1, nb_, nb_, tl[dst], mbuf,
                                     mrel[dst] + j[snd] * nb_, nb_))
        res = self.alloc_layout(out, src.rows, src.cols, ot.dtype, src.row_cuts, src.col_cuts, src.tiles)
        ops = [(src.buf, rel, rows, w), (mbuf, mrel, nc * rows, 2)]
        dtypes = [xt.dtype, "float32"]
        for p in node.inputs[1:]:
            if p:
                ops.append(self.block_operands_rowvec(p, res, out))
                dtypes.append(self.types[p].dtype)
        ops.append((res.buf, res.rel.reshape(-1), rows, w))
        params = [f2i(node.attrs.get("epsilon", 1e-5)), int(len(ops) == 5), nc, src.cols]
        self.compute([self.group("layernorm_apply", tuple(dtypes) + (ot.dtype,), tl, params, ops)], out)
        self.set_output(out, res)
        self.strategies[node.name or out] = f"LayerNorm on {nr} x {nc} blocks in place"
        self.split_sums[node.outputs[0]] = ("columns", tuple(int(c) for c in src.col_cuts))
        return True

    def block_operands_rowvec(self, value: str, lay: Layout, tag: str) -> tuple:
        """A [1, cols] constant (LayerNorm scale/bias) resident on every tile of a row layout."""
        # Not resident: a copy on every row tile of every LayerNorm would pile up (2 x cols per tile per LayerNorm);
        # the constant lives once (its home layout) and is multicast to the row tiles when the LayerNorm runs.
        return self.block_operands(value, (lay.rows, lay.cols), lay, tag, resident=False)

    # ------------------------------------------------------------------------------------------------ data movement
    def _lower_move(self, node) -> None:
        ins = [i for i in node.inputs if i]
        outs = node.outputs
        if node.op == "Split" and self._split_free(node):
            return
        in_place = node.op in ("Reshape", "Identity") or _keeps_order(node, self.types)
        if in_place and ins[0] not in self.graph.constants:
            rows, cols = view2d(self.types[outs[0]].shape)
            free = reshape_free(self.layout_of(ins[0]), rows, cols)
            if free is not None:
                self.layouts[outs[0]] = free
                self.strategies[node.name or outs[0]] = f"{node.op} free (same bytes)"
                return
        if node.op == "Slice":  # (its map from the output's size; the generic one is the input's)
            maps = [slice_index_map(self.types[ins[0]].shape, node.attrs)]
        else:
            args = [np.arange(self.types[i].size, dtype=I64).reshape(self.types[i].shape) + k * STRIDE
                    for k, i in enumerate(ins)]
            maps = rule(node.op).ref(args, node.attrs)
        srcs = [self.layout_of(i) for i in ins]
        for o, m in zip(outs, maps):
            t = self.types[o]
            rows, cols = view2d(t.shape)
            self.layouts[o] = self._move_elems(o, srcs, np.asarray(m, I64), rows, cols, t.dtype)
        self.strategies[node.name or outs[0]] = f"{node.op} exchange"

    def _split_free(self, node) -> bool:
        """A Split of the last axis whose points are column-block edges of its input's layout: each output is those
        blocks, in place (a fused projection's Q, K and V). False (nothing done) otherwise."""
        x = node.inputs[0]
        if all(o in self.layouts for o in node.outputs):  # its fused projection made its parts apart
            self.strategies[node.name or node.outputs[0]] = "Split free (its parts were made apart)"
            return True
        if x in self.graph.constants or not _last_axis(node, self.types):
            return False
        src = self.layout_of(x)
        points = np.concatenate([[0], np.cumsum(node.attrs["sizes"])])
        at = np.searchsorted(src.col_cuts, points)
        if src.cols != points[-1] or (at >= len(src.col_cuts)).any() or not np.array_equal(src.col_cuts[at], points):
            return False
        for o, j0, j1 in zip(node.outputs, at[:-1], at[1:]):
            rows, cols = view2d(self.types[o].shape)
            part = Layout(rows, cols, src.dtype, src.row_cuts, src.col_cuts[j0: j1 + 1] - src.col_cuts[j0],
                          src.tiles[:, j0:j1], src.rel[:, j0:j1], src.buf)
            self.layouts[o] = part
        self.strategies[node.name or node.outputs[0]] = "Split free (column blocks of its input)"
        return True

    # ------------------------------------------------------------------------------------------------ gather
    def _lower_gather(self, node) -> None:
        data, ids = node.inputs
        out = node.outputs[0]
        axis = _norm_axis(node.attrs.get("axis", 0), len(self.types[data].shape))
        if ids in self.graph.constants:  # constant indices: pure data movement
            idx = self.graph.constants[ids].value()
            arg = np.arange(self.types[data].size, dtype=I64).reshape(self.types[data].shape)
            m = rule("Gather").ref([arg, idx], node.attrs)[0]
            rows, cols = view2d(self.types[out].shape)
            self.layouts[out] = self._move_elems(out, [self.layout_of(data)], m, rows, cols, self.types[out].dtype)
            return
        if data not in self.graph.constants or axis != 0:
            raise TremulaError(f"Gather {node.name}: only embedding lookups (constant table, axis 0) take runtime "
                               "indices; fold or rewrite the others")
        dt = self.types[data]
        v = dt.shape[0]
        d = int(np.prod(dt.shape[1:], dtype=I64))
        n = self.types[ids].size
        it = self.types[ids]
        isz = np.dtype(it.dtype).itemsize
        src = self.layout_of(ids)
        if self._lookup_rows(v, d, n, dt.dtype, isz):
            return self._lower_lookup_rows(node, src, v, d, n, dt.dtype, it.dtype)
        parts = min(self.T, d)
        ccuts = even_cuts(d, parts)
        tl = self.take_tiles(len(ccuts) - 1)
        tbuf, trel = self.resident(f"{data}@{out}", data, dt.dtype, tl, 0, v, ccuts[:-1], ccuts[1:])
        ibuf = self.new_buffer(f"{ids}@{out}", "buffers", tl, n * isz)
        # every table tile gets all the ids, row-major: the whole id matrix as one rectangle each
        self.exchange(gather_rects(src, 0, src.rows, 0, src.cols, tl, ibuf, 0, src.cols * isz))
        lay = self.alloc_layout(f"{out}@emb", n, d, dt.dtype, [0, n], ccuts, tl[None, :])
        w = np.diff(ccuts)
        ops = [(ibuf, 0, 1, n), (tbuf, trel, v, w), (lay.buf, lay.rel.reshape(-1), n, w)]
        self.compute([self.group("embed", (it.dtype, dt.dtype, dt.dtype), tl, [0], ops)], out)
        self.set_output(out, lay)
        self.strategies[node.name or out] = f"embedding lookup, table columns over {len(tl)} tiles"

    def _lookup_rows(self, v: int, d: int, n: int, dtype: str, isz: int) -> bool:
        """Whether a lookup copies its table to every tile of a row layout of its output, each tile picking the rows of
        its own tokens, instead of spreading the table's columns over the tiles, each of which then receives every id
        and picks one column of every token. Only a table within SMALL_TABLE_FRACTION of a tile (BERT's token types:
        2 x 768 halves), and only when the cost model prices it cheaper: the busiest tile's copies and receives."""
        tsz = np.dtype(dtype).itemsize
        if v * d * tsz > SMALL_TABLE_FRACTION * self.chip.sram_bytes_per_tile:
            return False
        cols = cdiv(d, min(self.T, d))
        rows = cdiv(n, self.row_parts(n, d, dtype))
        by_cols = n * cost_terms.copy_cycles(self.chip, cols * tsz) + cost_terms.exchange_cycles(self.chip, 0, n * isz)
        by_rows = (rows * cost_terms.copy_cycles(self.chip, d * tsz)
                   + cost_terms.exchange_cycles(self.chip, 0, rows * isz + v * d * tsz))
        return by_rows < by_cols

    def _lower_lookup_rows(self, node, src: Layout, v: int, d: int, n: int, dtype: str, idtype: str) -> None:
        """The lookup on a row layout of its output: the whole table on each of its tiles, each tile's ids (its rows'
        tokens, in order) gathered from the id layout. The table is stored once, on the first of those tiles, and
        multicast to the others' temporary buffers when the lookup runs."""
        data, ids = node.inputs
        out = node.outputs[0]
        lay = self.row_layout(f"{out}@emb", n, d, dtype)
        tl, cnt = lay.tiles[:, 0], np.diff(lay.row_cuts)
        isz = np.dtype(idtype).itemsize
        home = np.arange(len(tl)) == 0
        tbuf, trel = self._weight_operand(f"{data}@{out}", data, dtype, tl, home, np.zeros(len(tl), I64), 0, v, 0, d)
        ibuf = self.new_buffer(f"{ids}@{out}", "buffers", tl, cnt * isz)
        tok = np.arange(n, dtype=I64)
        self.exchange(gather_elems(src, tok, np.repeat(tl, cnt), ibuf, (tok - np.repeat(lay.row_cuts[:-1], cnt)) * isz))
        ops = [(ibuf, 0, 1, cnt), (tbuf, trel, v, d), (lay.buf, lay.rel[:, 0], cnt, d)]
        self.compute([self.group("embed", (idtype, dtype, dtype), tl, [0], ops)], out)
        self.set_output(out, lay)
        self.strategies[node.name or out] = f"embedding lookup, the table on each of {len(tl)} tiles of its rows"

    # ------------------------------------------------------------------------------------------------ matmul
    def _lower_linear(self, node, col0: int = 0) -> None:
        """col0: the node is one part of a fused projection (_fused_apart), its output that part's value, its weight
        and bias columns from col0 on."""
        x, w = node.inputs[0], node.inputs[1]
        out = node.outputs[0]
        if w not in self.graph.constants or len(self.types[w].shape) != 2:
            if node.op == "MatMul":
                return self._lower_batched_matmul(node)
            raise TremulaError(f"Linear {node.name}: the weight must be a 2-D constant")
        xt = self.types[x]
        m, k = view2d(xt.shape)
        n = self.types[out].shape[-1]
        src = self.layout_of(x)
        # Column-block outputs suit only consumers that keep the layout (a unary op) or read K-slices (a matmul).
        # (A Split on block edges, a fused projection's, passes column blocks on to the head views.)
        out_rows = not all(c.op in MATMULS or _unary(c) or c.op == "Split" for c in self.consumers.get(out, []))
        even = src.even_col_parts  # n when the K cuts a matmul with pk = n makes are the operand's column blocks
        shape = SourceShape(int(np.diff(src.row_cuts).max()), int(np.diff(src.col_cuts).min()), out_rows, self.n_linear,
                            even)
        # K cut at the operand's own column blocks (attention heads, a LayerNorm kept in place): each tile's K slice
        # is then whole source blocks, contiguous on both sides, and its exchange code does not grow with the rows.
        # A LayerNorm's column blocks are only a preference, priced against a free cut, the cheaper kept: the cut
        # changes the code bytes, which the permanent budget counts (perm_fraction; the first, fastest plan has none),
        # not a gather's cycles (BERT-base fp16 batch 16: the fused QKV made whole on 4 K parts and fc1 on 8, not
        # apart and on the LayerNorm's 12: 5.13 M -> 4.90 M cycles). Head cuts stay: freed, the tiny models' goldens
        # came out 0.2-0.5 % slower, their out-projection estimated faster on 128 tiles with whole rows than on 1024
        # with 2 K parts, and running slower.
        head_k = self.head_parts.get(self._through_elementwise(x), 0)
        pk_fix = head_k or (even if 1 < even <= self.T else 0)
        cuts = (pk_fix, 0) if pk_fix and not head_k else (pk_fix,)
        nxt = self._next_matmul(out)
        if node.name in self.paired:  # the second of a pair: its K parts are the first's column blocks
            st = self.paired.pop(node.name)
        elif nxt is not None:
            n2 = self.types[nxt.inputs[1]].shape[1]
            st, self.paired[nxt.name] = self._noting_lean(lambda rounds: min(
                (choose_linear_pair(self.chip, m, k, n, n2, xt.dtype, self.types[nxt.inputs[0]].dtype, self.pm_max,
                                    self.temp_fraction, shape, self.perm_fraction, c, self._panel_parts(nxt.outputs[0]),
                                    _partials(node), _partials(nxt), rounds, self._fraction(nxt)) for c in cuts),
                key=lambda p: (p[0].over + p[1].over, p[0].cycles + p[1].cycles)))
        else:
            # Output columns cut at head boundaries when attention reads them per head (its head views), or in the
            # residual stream's panels.
            pn_fix = self.head_parts.get(out, 0) or self._panel_parts(out)
            st, = self._noting_lean(lambda rounds: (self._cheapest_linear(m, k, n, xt.dtype, shape, pn_fix, cuts,
                                                                          _partials(node), rounds),))
            if not col0 and self._fused_apart(node, st, m, k, shape, cuts):
                return
        share = self._shared_x
        if share is not None and share.setdefault("key", st) != st:
            share = None  # (the parts chose otherwise than the whole's estimate: each gathers its own x)
        assert share is None or not st.kchunk, "parts sharing a gathered x gather it whole (_fused_apart)"
        rounds = self._linear_rounds(node, col0, st, src, m, k, n, share)
        if share is not None:  # the parts' rounds are interleaved by _fused_apart: round u of every part, then u + 1
            share.setdefault("rounds", []).append(rounds)
        else:
            for _ in rounds:
                pass

    def _cheapest_linear(self, m: int, k: int, n: int, dtype: str, shape: SourceShape, pn_fix: int,
                         cuts: tuple[int, ...], partials: str, k_rounds: str | None = None):
        """choose_linear at each K cut of `cuts` (0: a free one), the cheapest by choose_linear's own key (bytes over
        the budgets, then cycles; the first on a tie)."""
        return min((choose_linear(self.chip, m, k, n, dtype, self.pm_max, self.temp_fraction, shape, self.perm_fraction,
                                  pn_fix=pn_fix, pk_fix=c, partials=partials, k_rounds=k_rounds or self.thrift)
                    for c in cuts), key=lambda s: (s.over, s.cycles))

    def _noting_lean(self, choose: Callable[[str], tuple]) -> tuple:
        """choose(k_rounds) -> strategies, at this lowering's thrift; when free K rounds were taken, what lean ones
        would save on a tile goes into lean_saves."""
        got = choose(self.thrift)
        if self.thrift == "free" and any(s.kchunk for s in got):
            lean = choose("lean")
            self.lean_saves = max(self.lean_saves, *(a.bytes_per_tile - b.bytes_per_tile for a, b in zip(got, lean)))
        return got

    def _linear_rounds(self, node, col0: int, st, src, m: int, k: int, n: int, share: dict | None):
        """The Linear as planned (st): its tiles, weights, and round after round the operand gather and the products
        (a generator yielding after each round; its tiles and weights are placed when it is first resumed). `share`:
        a fused projection's parts lowered apart on one gathered operand (the first part's tiles, x buffer,
        partials and receive buffers; the later parts gather nothing)."""
        x, w, out = node.inputs[0], node.inputs[1], node.outputs[0]
        fp8 = node.op == "LinearFp8"  # inputs (x codes, w codes, w scale, bias): the quarter->half AMP path
        nb = 3 if fp8 else 2
        b = node.inputs[nb] if len(node.inputs) > nb and node.inputs[nb] else None
        xt, wt = self.types[x], self.types[w]
        mcuts, ncuts, kcuts = even_cuts(m, st.pm), even_cuts(n, st.pn), even_cuts(k, st.pk)
        pm, pn, pk = len(mcuts) - 1, len(ncuts) - 1, len(kcuts) - 1
        # tile of (i, j, l) at index (i * pn + j) * pk + l
        if share is not None and share["tl"] is not None:  # a later part of a projection apart: the first's tiles
            tl = share["tl"]
        else:
            tl = self._stream_tiles(pm, pn * pk) if st.stream else self.take_tiles(pm * pn * pk)
        gi = np.repeat(np.arange(pm), pn * pk)
        gj = np.tile(np.repeat(np.arange(pn), pk), pm)
        gl = np.tile(np.arange(pk), pm * pn)
        nj, kl = ncuts[gj + 1] - ncuts[gj], kcuts[gl + 1] - kcuts[gl]
        home = (gi == 0) if st.stream else np.ones(len(tl), bool)
        src_i = gj * pk + gl  # the tile of the same (j, l) in row group 0

        def place(v, dtype, r0, r1, c0, c1):
            return self._weight_operand(f"{v}@{out}", v, dtype, tl, home, src_i, r0, r1, c0, c1)

        wbuf, wrel = place(w, wt.dtype, kcuts[gl], kcuts[gl + 1], col0 + ncuts[gj], col0 + ncuts[gj + 1])
        bias = place(b, self.types[b].dtype, 0, 1, col0 + ncuts[gj], col0 + ncuts[gj + 1]) if b is not None else None
        # The FP8 weight's scale (QUARTER metadata) is a one-byte operand next to each weight block.
        meta = place(node.inputs[2], "int8", 0, 1, 0, 1) if fp8 else None
        isz = np.dtype(xt.dtype).itemsize
        mi = mcuts[gi + 1] - mcuts[gi]
        chunk = cdiv(int(mi.max()), st.serial)
        kc = st.kchunk or int(kl.max())  # columns of x a K round gathers (all of the tile's K slice: one round)
        gather = share is None or share["xbuf"] is None  # (a later part reads the first part's gathered x)
        xbuf = self.new_buffer(f"{x}@{out}", "buffers", tl, chunk * np.minimum(kl, kc) * isz) if gather else \
            share["xbuf"]
        if share is not None:
            share["tl"], share["xbuf"] = tl, xbuf
        if pk == 1:
            yield from self._linear_direct(node, st, src, tl, gi, mcuts, ncuts, nj, k, chunk, xbuf, wbuf, wrel, bias,
                                           meta, gather, kc)
        else:
            yield from self._linear_split_k(node, st, src, tl, gi, gj, gl, mcuts, ncuts, kcuts, nj, kl, chunk, xbuf,
                                            wbuf, wrel, bias, meta, gather, share, kc)
        self.strategies[node.name or out] = str(st) + (" half partials" if _partials(node) == "half" else "")
        if pk > 1:
            self.split_sums[node.outputs[0]] = ("k", tuple(int(c) for c in kcuts))

    def _fused_apart(self, node, st, m: int, k: int, shape: SourceShape, cuts: tuple[int, ...]) -> bool:
        """A fused projection (passes/fuse_qkv.py) whose parts, each planned alone, cost fewer cycles than the whole:
        lower each part as a Linear of its own over its weight columns, straight into its Split output (the Split
        then moves nothing). The whole wins when its one gather and wider blocks pay (ViT-B/16 fp16 batch 8); under a
        tight operand budget its wider output cut into more rounds than the parts' (SigLIP so400m fp8 batch 8: 12
        against 2). The parts have equal shapes, so they make the same choice: the same K cuts, which the matched
        reference follows as the whole node's (split_sums). Parts that attention does not read per head are always
        made apart: the whole one's free column cuts need not fall on the Split's points, whose re-layout its price
        leaves out. True when lowered so."""
        out = node.outputs[0]
        users = self.consumers.get(out, [])
        if len(users) != 1 or users[0].op != "Split" or out in self.graph.outputs:
            return False
        parts = users[0].outputs
        widths = {self.types[o].shape[-1] for o in parts}
        if not _last_axis(users[0], self.types) or len(widths) != 1:
            return False
        n = widths.pop()
        headed = all(o in self.head_parts for o in parts)
        dtype = self.types[node.inputs[0]].dtype
        one = self._cheapest_linear(m, k, n, dtype, shape, self.head_parts.get(parts[0], 0), cuts, _partials(node))
        # The parts can share one gathered x: the first part gathers each round's rows on its tiles, the others run
        # on the same tiles and read them (BERT-base fp16 batch 16 gathered its layer input three times a layer).
        # Each part's weights then sit on those tiles too, all at once. Lean, only when their blocks together are no
        # bigger than the weight-block budget or the whole projection's own block (the unevenness the budget
        # bounds); free, whenever the memory plan finds room (BERT-base fp16 batch 128: 5,900 -> 6,043 seq/s).
        isz = np.dtype(self.types[node.inputs[1]].dtype).itemsize
        together = len(parts) * (k * n * isz // (one.pn * one.pk))
        bounded = together <= max(weight_block_budget(self.chip, self.temp_fraction),
                                  k * n * len(parts) * isz // (st.pn * st.pk))
        # (not in K rounds: the parts' partials would take turns in one buffer between a round's chunks)
        shared = not one.kchunk and share_gather(bounded, self.thrift)
        if shared and not bounded:  # apart, a tile would hold one part's block at a time
            self.lean_saves = max(self.lean_saves, together - together // len(parts))
        apart = len(parts) * one.cycles - (len(parts) - 1) * operand_gather_cycles(self.chip, m, k, dtype, one) \
            if shared else len(parts) * one.cycles
        if headed and (one.over, apart) >= (st.over, st.cycles):
            return False
        name = node.name or out
        first = len(self.steps)
        share = self._shared_x = {"tl": None, "xbuf": None} if shared else None
        try:
            for j, value in enumerate(parts):
                self._lower_linear(Node(node.op, list(node.inputs), [value], dict(node.attrs), f"{name}.{j}"), j * n)
        finally:
            self._shared_x = None
        # Round by round: the first part gathers round u's rows of x, every part computes on them, then round u + 1
        # (each round's rows overwrite the last's). Parts that chose otherwise ran through on their own already.
        pending = share.get("rounds", []) if share is not None else []
        while pending:
            pending = [r for r in pending if next(r, StopIteration) is not StopIteration]
        for step in self.steps[first:]:  # attributed to the fused node's output, as its steps when made whole
            if step.origin is not None and step.origin.value in parts:
                step.origin = dataclasses.replace(step.origin, value=out)
        cuts = {self.split_sums.pop(v, None) for v in parts}
        assert len(cuts) == 1, cuts  # equal parts, equal choices
        cut = cuts.pop()
        if cut is not None:
            self.split_sums[out] = cut
        self.strategies[name] = (f"{len(parts)} projections apart{' on one gathered operand' if shared else ''} "
                                 f"(~{apart} cycles against ~{st.cycles} as one)")
        return True

    def _weight_operand(self, name: str, const: str, dtype: str, tl, home, src_i, r0, r1, c0, c1):
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

    def _panel_parts(self, value: str) -> int:
        """Column parts for a matmul output that a residual Add reads, under a memory budget (0: free choice).

        Then the residual stream, the LayerNorms kept in place on it and every matmul around it share one cut of the
        model width into PANEL_PARTS column blocks: the Adds' re-layouts and the matmuls' K-slice gathers move
        whole blocks, and the exchange code stops growing with the rows (SigLIP so400m at batch 4: the LayerNorms'
        and residual Adds' re-layouts were 33 KB of code a tile)."""
        if self.perm_fraction is None:
            return 0
        users = self.consumers.get(value, [])
        return PANEL_PARTS if any(c.op in ("Add", "Sub") and len([i for i in c.inputs if i]) == 2 for c in users) else 0

    @staticmethod
    def _is_panels(lay: Layout) -> bool:
        return lay.even_col_parts == PANEL_PARTS

    def _through_elementwise(self, value: str) -> str:
        """The value that `value` is a chain of one-input element-wise ops of (itself when it is not)."""
        while True:
            p = self.producers.get(value)
            if p is None or not _unary(p):
                return value
            value = p.inputs[0]

    def _next_matmul(self, value: str):
        """The matmul (constant 2-D weight) that reads `value` as its x through a chain of one-input element-wise ops
        with no other readers (an MLP's fc1 -> Gelu -> [quantize] -> fc2), or None."""
        while True:
            users = self.consumers.get(value, [])
            if len(users) != 1 or value in self.graph.outputs:
                return None
            c = users[0]
            if c.op in MATMULS:
                w = c.inputs[1]
                ok = c.inputs[0] == value and w in self.graph.constants and len(self.types[w].shape) == 2
                return c if ok and c.name else None
            if not _unary(c):
                return None
            value = c.outputs[0]

    def _matmul_codelet(self, node, meta, live, has_bias: int, acc: bool = False) -> tuple[str, list, list]:
        """(codelet, params, extra operands after x and w): the FP8 path adds the weight-scale operand; half partials
        add the AMP's group (codelets/matmul.py); `acc`: a later K round, which adds into the partials so far."""
        if meta is None:
            group = int(node.attrs.get("group", 0)) if _partials(node) == "half" else 0
            assert group or not acc, "K rounds need half partials"
            return "matmul", [has_bias] + ([group] if group else []) + ([1] if acc else []), []
        a, (x, w) = node.attrs, node.inputs[:2]
        params = [has_bias, format_id(fp8_format(self.types[x].dtype)), format_id(fp8_format(self.types[w].dtype)),
                  int(a["x_scale"]), int(a["group"])]  # x_scale: column 3 (plan/replay.PER_LAYER_PARAMS)
        return "matmul_fp8", params + ([1] if acc else []), [(meta[0][live], meta[1][live], 1, 1)]

    def _linear_direct(self, node, st, src, tl, gi, mcuts, ncuts, nj, k, chunk, xbuf, wbuf, wrel, bias,
                       meta=None, gather: bool = True, kc: int = 0) -> None:
        """Whole K on each tile; in K rounds of kc columns (st.kchunk) the half partials build up in the output's
        own bytes and the last round adds the bias."""
        x, w, out = node.inputs[0], node.inputs[1], node.outputs[0]
        xt, wt, ot = self.types[x], self.types[w], self.types[out]
        isz, wsz, osz = (np.dtype(t.dtype).itemsize for t in (xt, wt, ot))
        pm, pn = len(mcuts) - 1, len(ncuts) - 1
        lay = self.alloc_layout(out + "@mm", mcuts[-1], ncuts[-1], ot.dtype, mcuts, ncuts, tl.reshape(pm, pn))
        orel = lay.rel.reshape(-1)
        kc = kc or k
        ks = cdiv(k, kc)
        for u in range(st.serial):
            r0 = np.minimum(mcuts[gi] + u * chunk, mcuts[gi + 1])
            r1 = np.minimum(r0 + chunk, mcuts[gi + 1])
            live = r1 > r0
            rows = (r1 - r0)[live]
            res = (lay.buf, orel[live] + (r0 - mcuts[gi])[live] * nj[live] * osz, rows, nj[live])
            for v in range(ks):
                c0, c1 = v * kc, min(k, (v + 1) * kc)
                if gather:
                    self.exchange(gather_rects(src, r0[live], r1[live], c0, c1, tl[live], xbuf, 0, (c1 - c0) * isz))
                last = v == ks - 1
                codelet, params, extra = self._matmul_codelet(node, meta, live, int(bias is not None and last), v > 0)
                ops = [(xbuf, 0, rows, c1 - c0), (wbuf[live], wrel[live] + c0 * nj[live] * wsz, c1 - c0, nj[live])]
                ops += extra
                if bias and last:
                    ops.append((bias[0][live], bias[1][live], 1, nj[live]))
                ops += [res] * (1 + (v > 0))  # a later round reads the partials so far, then writes them
                dtypes = (xt.dtype, wt.dtype) + (("int8",) if meta else ()) + ((ot.dtype,) if bias and last else ()) \
                    + (ot.dtype,) * (1 + (v > 0))
                self.compute([self.group(codelet, dtypes, tl[live], params, ops)], out,
                             part=_round_label(u, st.serial, v, ks))
            yield
        self.set_output(out, lay)

    def _linear_split_k(self, node, st, src, tl, gi, gj, gl, mcuts, ncuts, kcuts, nj, kl, chunk, xbuf, wbuf, wrel,
                        bias, meta=None, gather: bool = True, share: dict | None = None, kc: int = 0):
        """K split over pk tiles: each computes a float32 partial; the owner of each row slice sums them (+ bias).
        A generator: it yields after each round (the caller runs it through, or interleaves a fused projection's
        parts round by round). gather False: a fused projection's first part gathers x into xbuf in every round;
        with `share`, the parts also use one partials and one receive buffer (they are used one part after the
        other). In K rounds of kc columns (st.kchunk) each tile's partials build up over its slice's rounds before
        the reduce."""
        x, w, out = node.inputs[0], node.inputs[1], node.outputs[0]
        xt, wt, ot = self.types[x], self.types[w], self.types[out]
        isz, wsz = np.dtype(xt.dtype).itemsize, np.dtype(wt.dtype).itemsize
        pm, pn, pk = len(mcuts) - 1, len(ncuts) - 1, len(kcuts) - 1
        kc = kc or int(kl.max())
        ks = cdiv(int(kl.max()), kc)
        nt = len(tl)
        # Output row blocks: for each i, round u and owner l, a slice of the round's rows (empty slices dropped).
        blocks_ = []  # (i, u, l, r0, r1)
        for i in range(pm):
            for u in range(st.serial):
                a0 = min(int(mcuts[i]) + u * chunk, int(mcuts[i + 1]))
                a1 = min(a0 + chunk, int(mcuts[i + 1]))
                sc = _split(a1 - a0, pk) + a0
                for l_ in range(pk):
                    if sc[l_ + 1] > sc[l_]:
                        blocks_.append((i, u, l_, int(sc[l_]), int(sc[l_ + 1])))
        bi = np.array([bb[0] for bb in blocks_])
        bl = np.array([bb[2] for bb in blocks_])
        row_cuts = np.array([bb[3] for bb in blocks_] + [int(mcuts[-1])], I64)
        owner = ((bi[:, None] * pn + np.arange(pn)[None, :]) * pk + bl[:, None])  # index into tl, per (block, j)
        lay = self.alloc_layout(out + "@mm", int(mcuts[-1]), int(ncuts[-1]), ot.dtype, row_cuts, ncuts, tl[owner])
        block_of = np.full((pm, st.serial, pk), -1, I64)  # (i, u, l) -> its row block
        for r, bb in enumerate(blocks_):
            block_of[bb[0], bb[1], bb[2]] = r
        sub_max = cdiv(chunk, pk)
        nj_max = int(nj.max())
        # The quarter -> half AMP's partials are half values already (numerics/fp8.amp_fp8_matmul): kept as half, they
        # take half the bytes and exchange. With half partials (passes/precision.with_partials) the half matmuls' are
        # half too, and the owners sum them in half; otherwise partials are float32 and summed in float32.
        half = _partials(node) == "half"
        pdt = "float16" if meta is not None or half else "float32"
        psz = np.dtype(pdt).itemsize
        slot = sub_max * nj_max * psz
        if share is not None and "pbuf" in share:
            pbuf, rbuf = share["pbuf"], share["rbuf"]
        else:
            pbuf = self.new_buffer(f"{out}@partial", "buffers", tl, chunk * nj * psz)
            rbuf = self.new_buffer(f"{out}@recv", "buffers", tl, (pk - 1) * slot)
            if share is not None:
                share["pbuf"], share["rbuf"] = pbuf, rbuf
        idx = np.arange(nt)
        for u in range(st.serial):
            r0 = np.minimum(mcuts[gi] + u * chunk, mcuts[gi + 1])
            r1 = np.minimum(r0 + chunk, mcuts[gi + 1])
            live = r1 > r0
            if not live.any():
                yield
                continue
            for v in range(ks):
                a0 = kcuts[gl] + v * kc
                a1 = np.minimum(a0 + kc, kcuts[gl + 1])
                lv = live & (a1 > a0)  # (a tile's K slice may be a round shorter than the widest)
                cols = (a1 - a0)[lv]
                if gather:
                    self.exchange(gather_rects(src, r0[lv], r1[lv], a0[lv], a1[lv], tl[lv], xbuf, 0, cols * isz))
                rows = (r1 - r0)[lv]
                codelet, params, extra = self._matmul_codelet(node, meta, lv, 0, v > 0)
                if meta is None:  # (the FP8 AMP writes its half partials itself)
                    assert half or ks == 1, "K rounds need half partials"
                    codelet, params = "matmul_partial", ([int(node.attrs["group"])] if half else []) + [1] * (v > 0)
                ops = [(xbuf, 0, rows, cols), (wbuf[lv], wrel[lv] + v * kc * nj[lv] * wsz, cols, nj[lv]), *extra]
                ops += [(pbuf, 0, rows, nj[lv])] * (1 + (v > 0))  # a later round reads the partials so far
                dts = (xt.dtype, wt.dtype) + (("int8",) if meta else ()) + (pdt,) * (1 + (v > 0))
                self.compute([self.group(codelet, dts, tl[lv], params, ops)], out, "partials",
                             _round_label(u, st.serial, v, ks))
            # Reduce-scatter: the slice owned by l goes from every other (i, j, l') to (i, j, l).
            rows_all = r1 - r0
            snd = np.repeat(idx, pk)
            own = np.tile(np.arange(pk), nt)
            lp = gl[snd]
            s0, s1 = _cut(rows_all[snd], pk, own), _cut(rows_all[snd], pk, own + 1)
            keep = (own != lp) & live[snd] & (s1 > s0)
            snd, own, lp, s0, s1 = snd[keep], own[keep], lp[keep], s0[keep], s1[keep]
            if len(snd):
                recv = snd - lp + own  # the same (i, j), owner l
                slot_i = np.where(lp < own, lp, lp - 1)
                nb_ = (s1 - s0) * nj[snd] * psz
                # Slots packed at the slice's own size: the received partials are one [(pk - 1) * sub, nj] matrix,
                # one operand of the reduce vertex (a vertex field per partial made its state grow with pk).
                self.exchange(make_transfers(tl[snd], pbuf, s0 * nj[snd] * psz, 1, nb_, nb_, tl[recv], rbuf,
                                             slot_i * nb_, nb_))
            # Owners sum their own slice of the partial with the received ones.
            c0, c1 = _cut(rows_all, pk, gl), _cut(rows_all, pk, gl + 1)
            o_idx = idx[live & (c1 > c0)]
            if not len(o_idx):
                yield
                continue
            s0, sub = c0[o_idx], (c1 - c0)[o_idx]
            rb = block_of[gi[o_idx], u, gl[o_idx]]
            orel = lay.rel[rb, gj[o_idx]]
            njo = nj[o_idx]
            ops = [(pbuf, s0 * njo * psz, sub, njo), (rbuf, 0, (pk - 1) * sub, njo)]
            if bias:
                ops.append((bias[0][o_idx], bias[1][o_idx], 1, njo))
            ops.append((lay.buf, orel, sub, njo))
            dtypes = (pdt, pdt) + ((ot.dtype,) if bias else ()) + (ot.dtype,)
            params = np.zeros((len(o_idx), 4 if half else 2), I64)  # (pk, bias[, half, own part index])
            params[:, 0], params[:, 1] = pk, int(bias is not None)
            if half:
                params[:, 2], params[:, 3] = 1, gl[o_idx]
            self.compute([self.group("reduce_partials", dtypes, tl[o_idx], params, ops)], out,
                         "reduce", f" ({u + 1}/{st.serial})" if st.serial > 1 else "")
            yield
        self.set_output(out, lay)

    _lower_matmul = _lower_linear
    _lower_linearfp8 = _lower_linear

    def _lower_batched_matmul(self, node) -> None:
        a, b = node.inputs
        out = node.outputs[0]
        at, bt, ot = self.types[a], self.types[b], self.types[out]
        if len(at.shape) < 2 or len(bt.shape) < 2:
            raise TremulaError(f"MatMul {node.name}: 1-D operands are not supported by the planner")
        m, k = at.shape[-2:]
        n = bt.shape[-1]
        lead = tuple(ot.shape[:-2])
        nb = int(np.prod(lead, dtype=I64))
        ai = np.broadcast_to(np.arange(int(np.prod(at.shape[:-2], dtype=I64))).reshape(at.shape[:-2]), lead).reshape(-1)
        bi = np.broadcast_to(np.arange(int(np.prod(bt.shape[:-2], dtype=I64))).reshape(bt.shape[:-2]), lead).reshape(-1)
        sa = self.layout_of(a)
        sb = self.layout_of(b)
        sa = reshape_free(sa, sa.rows * sa.cols // k, k) or sa
        sb = reshape_free(sb, sb.rows * sb.cols // n, n) or sb
        units = np.arange(nb, dtype=I64)
        tiles_u = units % self.T
        used = np.unique(tiles_u)
        isz = np.dtype(at.dtype).itemsize
        abuf = self.new_buffer(f"{a}@{out}", "buffers", used, m * k * isz)
        bbuf = self.new_buffer(f"{b}@{out}", "buffers", used, k * n * isz)
        lay = self.alloc_layout(out + "@bmm", nb * m, n, ot.dtype, np.arange(nb + 1) * m, [0, n], tiles_u[:, None])
        for rnd in range(cdiv(nb, self.T)):
            us = units[rnd * self.T: (rnd + 1) * self.T]
            tl = tiles_u[us]
            self.exchange(SymTransfers.concat([
                self._rect_gather(sa, ai[us] * m, ai[us] * m + m, k, tl, abuf),
                self._rect_gather(sb, bi[us] * k, bi[us] * k + k, n, tl, bbuf)]))
            ops = [(abuf, 0, m, k), (bbuf, 0, k, n), (lay.buf, lay.rel[us, 0], m, n)]
            self.compute([self.group("matmul", (at.dtype, bt.dtype, ot.dtype), tl, [0], ops)], out)
        self.set_output(out, lay)
        self.strategies[node.name or out] = f"batched matmul, {nb} products over {len(used)} tiles"

    def _rect_gather(self, src: Layout, r0, r1, cols: int, tl, buf: int) -> SymTransfers:
        """Rows r0:r1 (all columns) of a matrix with `cols` columns into `buf` at offset 0 on tiles tl."""
        if src.cols == cols:
            return gather_rects(src, r0, r1, 0, cols, tl, buf, 0, cols * src.itemsize)
        isz = src.itemsize
        elems = np.concatenate([np.arange(s * cols, e * cols, dtype=I64) for s, e in zip(r0, r1)])
        dt = np.concatenate([np.full((e - s) * cols, t, I64) for s, e, t in zip(r0, r1, tl)])
        dr = np.concatenate([np.arange((e - s) * cols, dtype=I64) * isz for s, e in zip(r0, r1)])
        return gather_elems(src, elems, dt, buf, dr)

    def _as_matrix(self, value: str, cols: int) -> Layout:
        lay = self.layout_of(value)
        if lay.cols == cols:
            return lay
        free = reshape_free(lay, lay.rows * lay.cols // cols, cols)
        if free is not None:
            return free
        return self._move_elems(f"{value}@mat", [lay], np.arange(lay.rows * lay.cols, dtype=I64),
                                lay.rows * lay.cols // cols, cols, lay.dtype)


def _round_label(u: int, serial: int, v: int, ks: int) -> str:
    """A matmul step's round in its label: row round u of serial, K round v of ks (nothing for one round)."""
    rows = f"{u + 1}/{serial}" if serial > 1 else ""
    k = f"K {v + 1}/{ks}" if ks > 1 else ""
    return f" ({rows}{', ' if rows and k else ''}{k})" if rows or k else ""


def share_gather(bounded: bool, thrift: str) -> bool:
    """Whether a fused projection's parts lowered apart share one gathered operand (Lowerer._fused_apart): always
    when the plan takes its choices free, only within the weight-block budget (`bounded`) when lean. (A seam: a test
    makes every part gather its own.)"""
    return bounded or thrift == "free"


def _partials(node) -> str:
    """What a matmul node accumulates in: "half" when passes/precision.with_partials marked it, else "float"."""
    return "half" if node.attrs.get("partials") == "half" else "float"


def _last_axis(split, types) -> bool:
    """A Split of its input's last axis (the columns of its 2-D view)."""
    rank = len(types[split.inputs[0]].shape)
    return rank > 0 and _norm_axis(split.attrs.get("axis", 0), rank) == rank - 1


def _unary(node) -> bool:
    """A one-input element-wise op: it keeps its input's layout block for block."""
    return node.op in ELEMENTWISE and sum(map(bool, node.inputs)) == 1


def _merge_runs(tl: np.ndarray, ops: list[tuple], dtypes: tuple[str, ...]) -> tuple[np.ndarray, list[tuple]]:
    """One element-wise vertex per run of blocks that sit back to back on one tile in every operand (a matmul's
    row slices of one tile, say), seen as one [1, n] row: a vertex per block made SigLIP so400m's Gelu and FP8 casts
    keep ~19 KB of vertex state on a tile at batch 8 (now ~11 KB). Operands broadcast within a block (a bias row)
    leave the blocks as they are."""
    n = len(tl)
    arr = [tuple(np.broadcast_to(np.asarray(x, I64), (n,)) for x in o) for o in ops]
    out_rows, out_cols = arr[-1][2], arr[-1][3]
    if n < 2 or any(not (np.array_equal(r, out_rows) and np.array_equal(c, out_cols)) for _, _, r, c in arr):
        return tl, ops
    size = out_rows * out_cols
    order = np.lexsort((np.arange(n), tl))
    t_s = tl[order]
    joined = np.zeros(n, bool)  # block order[k] continues the run of order[k - 1]
    joined[1:] = t_s[1:] == t_s[:-1]
    for (buf, rel, _, _), dt in zip(arr, dtypes):
        b_s, r_s = buf[order], rel[order]
        joined[1:] &= (b_s[1:] == b_s[:-1]) & (r_s[1:] == r_s[:-1] + size[order][:-1] * np.dtype(dt).itemsize)
    if not joined.any():
        return tl, ops
    run = np.cumsum(~joined) - 1
    firsts = order[~joined]
    total = np.bincount(run, weights=size[order]).astype(I64)
    one = np.ones(len(firsts), I64)
    return tl[firsts], [(buf[firsts], rel[firsts], one, total) for buf, rel, _, _ in arr]


def _split(rows: int, parts: int) -> np.ndarray:
    """parts+1 cuts of range(rows) into nearly equal slices, empty slices at the end when rows < parts."""
    base, extra = divmod(rows, parts)
    sizes = base + (np.arange(parts) < extra)
    return np.concatenate([[0], np.cumsum(sizes)]).astype(I64)


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


def _cut(rows, parts: int, l_):
    """Cut l_ of _split(rows, parts), vectorised over rows (and l_)."""
    base, extra = np.divmod(np.asarray(rows, I64), parts)
    return l_ * base + np.minimum(l_, extra)


def perm_free(node, axes: tuple[int, ...], rank: int) -> bool:
    """True when a row op's result needs no moving back (softmax over the last axis, LayerNorm)."""
    return node.op == "LayerNorm" or (node.op == "Softmax" and axes == (rank - 1,))

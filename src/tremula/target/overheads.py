"""Per-tile memory that is not tensor data: codelet code, vertex state and exchange code (documented estimates).

These are software facts of the Poplar toolchain, not of a chip, so they live here and not in a chip file. None is
published as a number; each estimate below states its basis, and the memory report shows them as their own categories
so their weight in a "does not fit" verdict is visible.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tremula.sorting import lex_order, positions_in_runs

# Code bytes per distinct codelet on a tile. Basis: a Poplar vertex is a few hundred instructions of 4 or 8 bytes
# (poplibs' hand-written assembly for ConvPartial1x1 runs to ~1000 lines incl. the supervisor and worker paths; an
# element-wise popops vertex ~100-250 lines). Code must live in the non-interleaved region (ref §2).
CODE_BYTES = {
    "matmul": 4096, "matmul_partial": 4096, "reduce_partials": 1024, "attention": 6144, "layernorm": 2048,
    "softmax": 1536, "reduce": 1024, "unary": 1024, "binary": 1024, "where": 768, "embed": 768,
    "matmul_fp8": 4096, "fp8_cast": 1024,  # the quarter AMP path and the float->quarter cast (codelets/fp8.py)
    "attention_partial": 6144, "attention_combine": 1024,  # attention with keys split over tiles
    "layernorm_moments": 1024, "layernorm_apply": 2048,  # LayerNorm over column blocks (lower_rows._layernorm_blocks)
}
# Codelets that only some programs use: the planner's up-front bound on code (context.tile_room) leaves them out
# unless the graph needs them; the memory plan always counts exactly the codelets a tile runs.
OPTIONAL_CODELETS = {"matmul_fp8": "fp8", "fp8_cast": "fp8", "attention_partial": "key_split",
                     "attention_combine": "key_split", "layernorm_moments": "ln_blocks", "layernorm_apply": "ln_blocks"}
# Fixed per-tile runtime: supervisor control program, sync and stream handling.
BASE_CODE_BYTES = 2048
# Vertex state: Poplar stores one 32-bit pointer + one 32-bit size per operand field and one word per scalar field.
VERTEX_HEADER_BYTES = 8
BYTES_PER_OPERAND = 8
BYTES_PER_PARAM = 4
PATCH_WORD_BYTES = 4  # one vertex field a shared layer's call rewrites (program.FieldPatch): a 32-bit pointer or scalar
# Exchange code without a chip: 16 bytes per transfer on each tile taking part (sender and every receiver), about
# a send and a receive of the chip model below with a pointer reset each. With a chip, its [exchange_code] table
# (the encoding model of ipu-stack-facts §1.2, validated there at -14 .. +17.5 % on encoded rows) prices them.
EXCHANGE_BYTES_PER_TRANSFER = 16
# A shared layer's step (a Call, program.py) on each tile: one supervisor call of the template step's code (IPU
# supervisor instructions are 32-bit); on tiles that send from weights, SETZI + a base-register write (8 B; timed
# together in ipu-stack-facts §1.4); on tiles whose vertex fields it rewrites, the patch vertex's own state (a copy
# vertex: header + source and destination operands) beside the 4-byte rewritten words themselves.
CALL_BYTES = 4
BASE_SET_BYTES = 8
PATCH_VERTEX_BYTES = VERTEX_HEADER_BYTES + 2 * BYTES_PER_OPERAND


def strided(rows, row_bytes, stride) -> np.ndarray:
    """Whether a side of a transfer has rows that are not back to back in its memory (its pointer moves per row)."""
    return (np.asarray(rows, np.int64) > 1) & (np.asarray(stride, np.int64) != np.asarray(row_bytes, np.int64))


def side_instructions(rows, row_bytes, stride) -> np.ndarray:
    """Instructions one side of a transfer runs in the planner's up-front estimate (strategies.permanent_bytes): one
    set-up plus one per row when its rows are not back to back in its memory (a strided side re-points per row)."""
    return 1 + np.where(strided(rows, row_bytes, stride), np.asarray(rows, np.int64), 0)


# The encoding model of ipu-stack-facts §1.2 (constants in the chip file's [exchange_code] table). The memory plan
# prices whole transfers with it (_send_bytes, _receive_bytes), the timetables the chunks they run (chunk_code_bytes).


def _run_bytes(enc, nbytes) -> np.ndarray:
    """One send of a contiguous run of nbytes: send_bytes carrying its first send_words words, plus continue_bytes per
    further continue_words words (send's and sendoff's count fields, ipu-stack-facts §1.1)."""
    words = -(-np.asarray(nbytes, np.int64) // 4)
    return enc.send_bytes + enc.continue_bytes * (-(-np.maximum(words - enc.send_words, 0) // enc.continue_words))


def send_code_bytes(enc, row_bytes, stride, offset, nbytes) -> np.ndarray:
    """Sender code for bytes [offset, offset + nbytes) of a rows x row_bytes pattern (in row order) whose source rows
    lie `stride` bytes apart: one send per contiguous run - the whole range, or where the rows it touches are strided,
    each row segment (first partial row, full middle rows, last partial row), as the exchange has no constant-stride
    mode (ipu-stack-facts §1.1). A multicast is sent once."""
    rb, a, n, stride = np.broadcast_arrays(np.maximum(np.asarray(row_bytes, np.int64), 1),
                                           np.asarray(offset, np.int64), np.asarray(nbytes, np.int64),
                                           np.asarray(stride, np.int64))
    b = a + n
    r0, r1 = a // rb, (b - 1) // rb
    rows = r1 - r0 + 1
    out = np.array(_run_bytes(enc, n), np.int64)
    per = np.flatnonzero(strided(rows, rb, stride))  # (the rest are one run: priced so above, without the rows)
    if per.size:
        rb, a, b, r0, r1, rows = (x.reshape(-1)[per] for x in (rb, a, b, r0, r1, rows))
        out.reshape(-1)[per] = _run_bytes(enc, (r0 + 1) * rb - a) + np.maximum(rows - 2, 0) * _run_bytes(enc, rb) + \
            _run_bytes(enc, b - r1 * rb)
    return out


def _send_bytes(enc, rows, row_bytes, stride) -> np.ndarray:
    """A transfer's sender code: send_code_bytes of its whole payload."""
    return send_code_bytes(enc, row_bytes, stride, 0, np.asarray(rows, np.int64) * np.asarray(row_bytes, np.int64))


def _receives_in_order(enc, tile, buf, start, end, further_rows) -> np.ndarray:
    """Receiver code of receives listed in the order their tiles take them (each tile's together): one receive each,
    a pointer reset per further row of a strided destination (`further_rows`: no constant-stride mode), and one more
    when a receive does not start where its tile's previous receive ended (`end` -1: ends nowhere); a tile's first
    receive sets its pointer with the receive itself."""
    out = enc.receive_bytes + enc.pointer_reset_bytes * np.asarray(further_rows, np.int64)
    reset = np.zeros(len(tile), bool)
    reset[1:] = (tile[1:] == tile[:-1]) & ~((buf[1:] == buf[:-1]) & (start[1:] == end[:-1]))
    return out + enc.pointer_reset_bytes * reset


def _receive_bytes(enc, d_tile, d_buf, d_rel, nbytes, rows, row_bytes, stride) -> np.ndarray:
    """Each destination entry's receiver code (_receives_in_order), its tile's receives taken in address order; the
    plan judges contiguity only between unstrided entries (a strided one ends nowhere)."""
    d_tile, d_buf, d_rel = (np.asarray(x, np.int64) for x in (d_tile, d_buf, d_rel))
    rows = np.asarray(rows, np.int64)
    per_row = strided(rows, row_bytes, stride)
    if per_row.all():  # none continues another: a reset for each but one receive of a tile, in any order (the
        # per-tile sums the callers take are those of address order; bert-base's embedding re-layout, 1.1 M entries)
        first = np.zeros(len(d_tile), bool)  # each tile's first entry: the least index of each tile id (tile ids
        if len(d_tile):  # are small: no sort, as np.unique's return_index makes)
            at = np.full(int(d_tile.max()) + 1, len(d_tile), np.int64)
            np.minimum.at(at, d_tile, np.arange(len(d_tile), dtype=np.int64))
            first[at[at < len(d_tile)]] = True
        return enc.receive_bytes + enc.pointer_reset_bytes * (rows - 1 + ~first)
    end = np.where(per_row, -1, d_rel + np.asarray(nbytes, np.int64))
    o = lex_order((d_rel, d_buf, d_tile))
    out = np.empty(len(d_tile), np.int64)
    out[o] = _receives_in_order(enc, d_tile[o], d_buf[o], d_rel[o], end[o], np.where(per_row, rows - 1, 0)[o])
    return out


def chunk_code_bytes(enc, t, tr, offset, nbytes, start, tiles: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(send, receive, phase) exchange code bytes per tile of a timetable's chunks: chunk k moves bytes [offset[k],
    offset[k] + nbytes[k]) of transfer tr[k] of TransferTable `t` (its rows x row_bytes pattern in row order) from
    cycle start[k]. The memory plan's model applied to what each chunk touches: its sender sends each contiguous run
    of it (send_code_bytes); every destination entry receives it, a tile's receives taken in time order (by start
    cycle, ties in chunk order) with their exact addresses; every tile that sends or receives runs a phase entry and
    return. A timetable that moves each transfer whole, its receives in address order, costs what reserved_bytes
    reserves for that step."""
    tr, offset, nbytes = (np.asarray(x, np.int64) for x in (tr, offset, nbytes))
    rb = np.asarray(t.row_bytes, np.int64)[tr]
    src = np.asarray(t.src_tile, np.int64)[tr]
    send = np.bincount(src, weights=send_code_bytes(enc, rb, np.asarray(t.src_stride, np.int64)[tr], offset, nbytes),
                       minlength=tiles).astype(np.int64)
    # One receive per (chunk, destination entry), chunks in time order.
    k = np.argsort(np.asarray(start, np.int64), kind="stable")
    dst_start = np.asarray(t.dst_start, np.int64)
    lo, cnt = dst_start[tr[k]], np.diff(dst_start)[tr[k]]
    c = np.repeat(k, cnt)
    j = np.repeat(lo, cnt) + positions_in_runs(cnt)
    d_tile, d_addr, d_stride = (np.asarray(x, np.int64)[j] for x in (t.d_tile, t.d_addr, t.d_stride))
    first, last, rbc = offset[c], offset[c] + nbytes[c] - 1, rb[c]
    at = d_addr + (first // rbc) * d_stride + first % rbc
    end = d_addr + (last // rbc) * d_stride + last % rbc + 1
    rows = last // rbc - first // rbc + 1
    further = np.where(strided(rows, rbc, d_stride), rows - 1, 0)
    o = np.argsort(d_tile, kind="stable")  # each tile's receives together, still in time order
    per = _receives_in_order(enc, d_tile[o], np.zeros(len(o), np.int64), at[o], end[o], further[o])
    recv = np.bincount(d_tile[o], weights=per, minlength=tiles).astype(np.int64)
    taking_part = np.zeros(tiles, bool)
    taking_part[src] = True
    taking_part[d_tile] = True
    return send, recv, enc.phase_bytes_per_tile * taking_part.astype(np.int64)


def _destinations(t) -> tuple[np.ndarray, ...]:
    """Per destination entry of a transfer table: (tile, buffer, offset, bytes, rows, row bytes, stride); a Program's
    addresses are absolute (one "buffer"), a plan's are a buffer and an offset in it."""
    ndst = np.diff(t.dst_start)
    rows, rb = np.repeat(np.asarray(t.rows, np.int64), ndst), np.repeat(np.asarray(t.row_bytes, np.int64), ndst)
    d_buf = t.d_buf if hasattr(t, "d_buf") else np.zeros(len(t.d_tile), np.int64)
    d_rel = t.d_rel if hasattr(t, "d_rel") else t.d_addr
    return t.d_tile, d_buf, d_rel, rows * rb, rows, rb, t.d_stride


def transfer_code_bytes(t, chip) -> tuple[np.ndarray, np.ndarray]:
    """Exchange code bytes of a transfer table (SymTransfers or TransferTable): (per transfer on its sender, per
    destination entry on its receiver), by the chip's encoding model (chip file [exchange_code], ipu-stack-facts
    §1.2), or the flat chip-less estimate without a chip. reserved_bytes adds the per-phase entry/return bytes and
    judges receive contiguity over a whole step's tables."""
    if chip is None:
        send = np.full(len(t.src_tile), EXCHANGE_BYTES_PER_TRANSFER, np.int64)
        return send, np.repeat(send, np.diff(t.dst_start))
    enc = chip.exchange_code
    return _send_bytes(enc, t.rows, t.row_bytes, t.src_stride), _receive_bytes(enc, *_destinations(t))


def _call(k: int, s, tiles: int, sharing) -> tuple[np.ndarray, np.ndarray] | None:
    """(vertex fields rewritten, tiles whose weight base is set) per tile when step k is a shared layer's call: a
    Program step's own Call, or a plan step that `sharing` makes one; None for a step with code of its own."""
    if getattr(s, "call", None) is not None:
        return s.patch_words(tiles), s.base_tiles(tiles)
    if sharing is not None and k in sharing.calls:
        return sharing.call_words[k], sharing.call_base[k]
    return None


def _based(k: int, i: int, t, sharing, is_weight) -> np.ndarray | None:
    """bool per transfer of a template's table: sources read relative to the weight base; None for other tables."""
    if getattr(t, "based", None) is not None:
        return t.based
    if sharing is not None and (k, i) in sharing.template_tables:
        return is_weight[t.src_buf]
    return None


def _groups(s) -> list:
    """A step's vertex groups: a Program Step's compute sets or a plan SymStep's groups."""
    return s.compute if hasattr(s, "compute") else s.groups


def _tables(s) -> list:
    """A step's transfer tables: a Program Step's one exchange or a plan SymStep's tables."""
    return [s.exchange] if hasattr(s, "exchange") else s.transfers


def _step_exchange_code(k: int, tables, tiles: int, chip, sharing, is_weight) -> np.ndarray:
    """Exchange code bytes per tile of step k's own transfer tables (reserved_bytes)."""
    instr = getattr(chip, "exchange_instruction_bytes", None)
    enc = getattr(chip, "exchange_code", None)
    excode = np.zeros(tiles, np.int64)
    for i, t in enumerate(tables):
        based = _based(k, i, t, sharing, is_weight)
        if enc is not None and based is None:  # (the receives are priced per step below)
            excode += _kept(t, ("sends", enc, tiles), lambda t=t: np.bincount(
                t.src_tile, weights=_send_bytes(enc, t.rows, t.row_bytes, t.src_stride), minlength=tiles))
            continue
        send, recv = (_send_bytes(enc, t.rows, t.row_bytes, t.src_stride), None) if enc is not None \
            else transfer_code_bytes(t, chip)
        if based is not None:  # a template's weight-sourced send adds the layer's weight base
            send = send + (instr or EXCHANGE_BYTES_PER_TRANSFER // 4) * based
        excode += np.bincount(t.src_tile, weights=send, minlength=tiles).astype(np.int64)
        if enc is None:
            excode += np.bincount(t.d_tile, weights=recv, minlength=tiles).astype(np.int64)
    if enc is not None and tables:
        # One phase: a tile's receives from all of the step's tables follow each other, so contiguity (and the
        # free pointer set of its first receive) is judged over all of them together.
        def receives() -> np.ndarray:
            dests = [np.concatenate([np.asarray(d, np.int64) for d in col]) for col in zip(*map(_destinations, tables))]
            return np.bincount(dests[0], weights=_receive_bytes(enc, *dests), minlength=tiles).astype(np.int64)

        excode += _kept(tables[0], ("receives", enc, tiles), receives) if len(tables) == 1 else receives()
        in_phase = np.zeros(tiles, bool)
        for t in tables:
            in_phase[t.src_tile] = True
            in_phase[t.d_tile] = True
        excode += enc.phase_bytes_per_tile * in_phase
    return excode


def _kept(t, key: tuple, make: Callable[[], np.ndarray]) -> np.ndarray:
    """make() as int64, kept on a plan's transfer table where it keeps what is derived from it (SymTransfers.memo: a
    re-layout made once serves several lowerings); a Program's table computes it each time."""
    memo = getattr(t, "memo", None)
    return memo(key, lambda: make().astype(np.int64)) if memo is not None else make().astype(np.int64)


def exchange_code_bytes(tiles: int, steps, chip=None) -> np.ndarray:
    """The exchange code bytes per tile reserved_bytes gives `steps` without shared layers, step by step: the sum
    over disjoint runs of steps is the whole's (the Lowerer counts it as it goes: lower_ops.CodeOverflow)."""
    excode = np.zeros(tiles, np.int64)
    for k, s in enumerate(steps):
        excode += _step_exchange_code(k, _tables(s), tiles, chip, None, None)
    return excode


def reserved_bytes(tiles: int, steps, chip=None, sharing=None, is_weight=None,
                   exchange_code: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """code, vertex_state and exchange_code bytes per tile for a list of steps (Program Steps or SymSteps).

    Code is the codelets a tile runs, the fixed runtime and, with a chip, each step's control code on every tile;
    exchange code is each transfer's send and receive code plus, per step, the phase entry and return on every tile
    that takes part. With `sharing` (plan/share.py; SymSteps only), the vertex groups and transfer tables of layers
    that run their template's code are not counted again (nor are the control and phase code of steps made only of
    them); their per-layer tables of rewritten vertex fields are, and each weight-sourced transfer of a template costs
    its sender one more instruction (adding the layer's weight base). `exchange_code`: the steps' exchange code
    already counted (exchange_code_bytes, without sharing), taken instead of counted again."""
    enc = getattr(chip, "exchange_code", None)
    code_sets: dict[str, np.ndarray] = {}
    vstate = np.zeros(tiles, np.int64)
    assert exchange_code is None or sharing is None
    excode = np.zeros(tiles, np.int64) if exchange_code is None else exchange_code.astype(np.int64)
    own_steps = 0  # steps whose control code is the tiles' own (not a template layer's)
    ctrl = np.zeros(tiles, np.int64)  # the calls' control code
    for k, s in enumerate(steps):
        call = _call(k, s, tiles, sharing)
        if call is not None:  # a shared layer's step: its call and patch only; the code is its template's
            words, base = call
            ctrl += CALL_BYTES + BASE_SET_BYTES * base
            vstate += words * PATCH_WORD_BYTES + PATCH_VERTEX_BYTES * (words > 0)
            for g in _groups(s):
                code_sets.setdefault(g.codelet, np.zeros(tiles, bool))[g.tiles] = True
            continue
        own_steps += 1
        for g in _groups(s):
            mark = code_sets.setdefault(g.codelet, np.zeros(tiles, bool))
            mark[g.tiles] = True
            per = VERTEX_HEADER_BYTES + BYTES_PER_OPERAND * len(g.dtypes) + BYTES_PER_PARAM * g.params.shape[1]
            vstate += np.bincount(g.tiles, minlength=tiles).astype(np.int64) * per
        if exchange_code is None:
            excode += _step_exchange_code(k, _tables(s), tiles, chip, sharing, is_weight)
    code = np.full(tiles, BASE_CODE_BYTES + (enc.control_bytes_per_step * own_steps if enc is not None else 0),
                   np.int64) + ctrl
    for name, mark in code_sets.items():
        code += mark * CODE_BYTES.get(name, 1024)
    return {"code": code, "vertex_state": vstate, "exchange_code": excode}

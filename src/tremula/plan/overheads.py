"""Per-tile memory that is not tensor data: codelet code, vertex state and exchange code (documented estimates).

These are software facts of the Poplar toolchain, not of a chip, so they live here and not in a chip file. None is
published as a number; each estimate below states its basis, and the memory report shows them as their own categories
so their weight in a "does not fit" verdict is visible.
"""

from __future__ import annotations

import numpy as np

# Code bytes per distinct codelet on a tile. Basis: a Poplar vertex is a few hundred instructions of 4 or 8 bytes
# (poplibs' hand-written assembly for ConvPartial1x1 runs to ~1000 lines incl. the supervisor and worker paths; an
# element-wise popops vertex ~100-250 lines). Code must live in the non-interleaved region (ref §2).
CODE_BYTES = {
    "matmul": 4096, "matmul_partial": 4096, "reduce_partials": 1024, "attention": 6144, "layernorm": 2048,
    "softmax": 1536, "reduce": 1024, "unary": 1024, "binary": 1024, "where": 768, "embed": 768,
    "matmul_fp8": 4096, "fp8_cast": 1024,  # the quarter AMP path and the float->quarter cast (codelets/fp8.py)
    "attention_partial": 6144, "attention_combine": 1024,  # attention with keys split over tiles
    "layernorm_moments": 1024, "layernorm_apply": 2048,  # LayerNorm over column blocks (lower_ops._layernorm_blocks)
}
# Codelets that only some programs use: the planner's up-front bound on code (lower_ops.Lowerer) leaves them out
# unless the graph needs them; the memory plan always counts exactly the codelets a tile runs.
OPTIONAL_CODELETS = {"matmul_fp8": "fp8", "fp8_cast": "fp8", "attention_partial": "key_split",
                     "attention_combine": "key_split", "layernorm_moments": "ln_blocks", "layernorm_apply": "ln_blocks"}
# Fixed per-tile runtime: supervisor control program, sync and stream handling.
BASE_CODE_BYTES = 2048
# Vertex state: Poplar stores one 32-bit pointer + one 32-bit size per operand field and one word per scalar field.
VERTEX_HEADER_BYTES = 8
BYTES_PER_OPERAND = 8
BYTES_PER_PARAM = 4
# Exchange code without a chip: a send or a receive-mux selection is one 32-bit instruction; a 2-D pattern adds a
# loop setup of a few instructions, so 16 bytes per transfer on each tile taking part (sender and every receiver).
# With a chip, its `exchange_instruction_bytes` (chip file) prices instructions (see side_instructions).
EXCHANGE_BYTES_PER_TRANSFER = 16


def side_instructions(rows, row_bytes, stride) -> np.ndarray:
    """Exchange instructions one side of a transfer runs: one set-up (the sender's first address; the receiver's mux
    select and incoming pointer) plus one per row when its rows are not back to back in its memory. A contiguous
    side streams every row through the one pointer, which advances by itself; a strided side re-points per row.
    An estimate [I]: no public source gives exchange code sizes."""
    rows = np.asarray(rows, np.int64)
    strided = (rows > 1) & (np.asarray(stride, np.int64) != np.asarray(row_bytes, np.int64))
    return 1 + np.where(strided, rows, 0)


def transfer_code_bytes(t, instr: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Exchange code bytes of a transfer table (SymTransfers or TransferTable): (per transfer on its sender, per
    destination entry on its receiver). instr: bytes per instruction, or None for the chip-less flat estimate."""
    ndst = np.diff(t.dst_start)
    if instr is None:
        send = np.full(len(t.src_tile), EXCHANGE_BYTES_PER_TRANSFER, np.int64)
        return send, np.repeat(send, ndst)
    send = instr * side_instructions(t.rows, t.row_bytes, t.src_stride)
    return send, instr * side_instructions(np.repeat(t.rows, ndst), np.repeat(t.row_bytes, ndst), t.d_stride)


def reserved_bytes(tiles: int, steps, chip=None, sharing=None, is_weight=None) -> dict[str, np.ndarray]:
    """code, vertex_state and exchange_code bytes per tile for a list of steps (Program Steps or SymSteps).

    With `sharing` (plan/share.py; SymSteps only), the vertex groups and transfer tables of layers that run their
    template's code are not counted again; their per-layer tables of rewritten vertex fields are, and each
    weight-sourced transfer of a template costs its sender one more instruction (adding the layer's weight base)."""
    instr = getattr(chip, "exchange_instruction_bytes", None)
    code_sets: dict[str, np.ndarray] = {}
    vstate = np.zeros(tiles, np.int64)
    excode = np.zeros(tiles, np.int64)
    for k, s in enumerate(steps):
        groups = s.compute if hasattr(s, "compute") else s.groups
        for i, g in enumerate(groups):
            mark = code_sets.setdefault(g.codelet, np.zeros(tiles, bool))
            mark[g.tiles] = True
            if sharing is not None and (k, i) in sharing.replica_groups:
                continue
            per = VERTEX_HEADER_BYTES + BYTES_PER_OPERAND * len(g.dtypes) + BYTES_PER_PARAM * g.params.shape[1]
            vstate += np.bincount(g.tiles, minlength=tiles).astype(np.int64) * per
        tables = [s.exchange] if hasattr(s, "exchange") else s.transfers
        for i, t in enumerate(tables):
            if sharing is not None and (k, i) in sharing.replica_tables:
                continue
            send, recv = transfer_code_bytes(t, instr)
            if sharing is not None and (k, i) in sharing.template_tables:
                send = send + (instr or EXCHANGE_BYTES_PER_TRANSFER // 4) * is_weight[t.src_buf]
            excode += np.bincount(t.src_tile, weights=send, minlength=tiles).astype(np.int64)
            excode += np.bincount(t.d_tile, weights=recv, minlength=tiles).astype(np.int64)
    if sharing is not None:
        vstate += sharing.patch_bytes
    code = np.full(tiles, BASE_CODE_BYTES, np.int64)
    for name, mark in code_sets.items():
        code += mark * CODE_BYTES.get(name, 1024)
    return {"code": code, "vertex_state": vstate, "exchange_code": excode}

"""An exchange's traffic pattern up to the names of its tiles: the key under which a schedule is reused.

A schedule depends on which transfers share a send port or a receive port, on their sizes, on the bus groups of
the receive ports and - only to break ties - on the order of the tiles; not on which tiles those are. The layers of a
transformer place their activations and weights at other tile offsets, so the same traffic arrives under other tile
numbers each layer. Renaming the tiles by rank (the k-th smallest tile in use becomes k) makes those steps one pattern:

- senders and receivers are renamed separately: a tile's send port and its receive port are independent resources of
  the model (timetable.py), so nothing ties a sender's name to a receiver's;
- receivers are renamed a whole bus group at a time, each tile keeping its place in its group, so the shared-bus model
  (ports of one group see one bus) is the same before and after; a last, partial group keeps its number;
- ranks keep the tiles' order, and the one place where the scheduler looks at tile numbers themselves (the
  ring-distance tie-break between flows) reads the step's own numbers through send_name / recv_name; timetable.py
  keys a schedule by this pattern AND the resulting order of its flows, so every step gets exactly the timetable that
  scheduling it afresh would give (the flows of a pattern are still computed once);
- only bytes per transfer enter the key (rows x row bytes): the exchange code, which counts rows, is recomputed for
  each table from its own rows.

Measured on bert-base (c600, fp16, batch 1): 285 exchanges, 227 distinct as given, 109 patterns up to tile names,
167 (pattern, order) pairs to place.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from tremula.program import TransferTable
from tremula.target.chip import Chip

I64 = np.int64


@dataclass(frozen=True)
class Pattern:
    table: TransferTable  # the step's table with tiles renamed (addresses, rows and strides untouched)
    key: tuple  # hashable: the renamed traffic, bytes per transfer and the chip's exchange constants
    send_name: np.ndarray  # int64 [tiles]: renamed sender -> the step's own tile
    recv_name: np.ndarray  # int64 [tiles]: renamed receive tile -> the step's own tile


def _ranks(values: np.ndarray, size: int, keep: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(new label of each value 0..size-1, original value of each new label): the rank among the values present, so
    the order of the tiles (which breaks the scheduler's ties) is kept. `keep` (a partial last bus group, the largest
    value) keeps its own number, which stays above every rank."""
    present = np.zeros(size, bool)
    present[values] = True
    seen = np.flatnonzero(present)  # = np.unique(values): tile numbers are small, no sort needed
    if keep is not None:
        seen = seen[seen != keep]
    label = np.full(size, -1, I64)
    label[seen] = np.arange(len(seen), dtype=I64)
    back = np.arange(size, dtype=I64)
    back[: len(seen)] = seen
    if keep is not None:
        label[keep] = keep
    return label, back


def canonical_pattern(table: TransferTable, chip: Chip, min_piece_cycles: int) -> Pattern:
    """The table with senders and receive bus groups renamed by rank, and its cache key."""
    T = chip.tiles
    P = max(1, chip.tiles_per_shared_exchange_bus)
    src = np.asarray(table.src_tile, I64)
    d_tile = np.asarray(table.d_tile, I64)
    G = -(-T // P)
    partial = G - 1 if T % P else None
    s_label, s_back = _ranks(src, T)
    if len(d_tile):
        g_label, g_back = _ranks(d_tile // P, G, partial)
    else:
        g_label = g_back = np.arange(G, dtype=I64)
    c_src = s_label[src]
    c_dst = g_label[d_tile // P] * P + d_tile % P
    canon = TransferTable(c_src.astype(np.int32), table.src_addr, table.rows, table.row_bytes, table.src_stride,
                          table.dst_start, c_dst.astype(np.int32), table.d_addr, table.d_stride)
    h = hashlib.blake2b(digest_size=20)
    nbytes = np.asarray(table.rows, I64) * np.asarray(table.row_bytes, I64)
    for a in (c_src, nbytes, table.dst_start, c_dst):
        h.update(np.ascontiguousarray(a, I64).tobytes())
        h.update(b"|")
    key = (h.digest(), T, chip.exchange_send_bytes_per_cycle_per_tile, chip.exchange_recv_bytes_per_cycle_per_tile,
           chip.tiles_per_shared_exchange_bus, chip.exchange_fixed_cycles, min_piece_cycles)
    tiles = np.arange(T, dtype=I64)
    return Pattern(canon, key, s_back, g_back[tiles // P] * P + tiles % P)

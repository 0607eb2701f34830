"""Why a plan does not fit: what fills the fullest tile at its peak, by name. The "does not fit" error quotes it, so a
user sees which buffers and which ops' exchanges took the memory, not only the totals by category."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from tremula.target.overheads import transfer_code_bytes


def fold(name: str) -> str:
    """Layer numbers and uniquifying suffixes out, so repeated layers add up under one name."""
    return re.sub(r"_\d+(?=$|@|\.)", "", re.sub(r"\.\d+\.", ".#.", name))


def _top(c: Counter, n: int) -> str:
    return ", ".join(f"{k} {v:,} B" for k, v in c.most_common(n))


def fullest_tile(state, mp, live, chip, top: int = 3) -> str:
    """One sentence: the largest live buffers at the fullest tile's peak, and the ops whose exchanges put the most
    code and whose weights put the most bytes on that tile (repeated layers folded together)."""
    t, when = mp.fullest_tile, mp.peak_time
    buffers: Counter = Counter()
    for b, spec in enumerate(state.bufs):
        if spec.category != "weights" and live.first[b] <= when <= live.last[b]:
            k = np.flatnonzero(spec.tiles == t)
            if len(k):
                buffers[fold(spec.name)] += int(spec.sizes[k[0]])
    code: Counter = Counter()
    sharing = getattr(state, "sharing", None)
    replicas = sharing.replica_tables if sharing is not None else set()
    for k, s in enumerate(state.steps):
        for i, (tr, owner) in enumerate(zip(s.transfers, s.owners)):
            if (k, i) in replicas:  # runs its template layer's code
                continue
            send, recv = transfer_code_bytes(tr, chip)
            here = int(send[tr.src_tile == t].sum() + recv[tr.d_tile == t].sum())
            if here:
                code[fold(owner)] += here
    weights: Counter = Counter()
    streaming = getattr(state, "streaming", None)
    for c in state.consts:
        if streaming is not None and streaming.arrive[c.buf] >= 0 and not live.first[c.buf] <= when <= \
                live.last[c.buf]:
            continue  # a streamed layer's weights that are not on the chip then (plan/stream.py)
        mine = c.tiles == t
        if mine.any():
            nbytes = (c.r1 - c.r0) * (c.c1 - c.c0) * np.dtype(c.dtype).itemsize
            weights[fold(c.name)] += int(nbytes[mine].sum())
    parts = []
    if buffers:
        parts.append(f"live there: {_top(buffers, top)}")
    if code:
        parts.append(f"exchange code there from {_top(code, top)}")
    if weights:
        parts.append(f"weights there: {_top(weights, top)}")
    return "; ".join(parts)

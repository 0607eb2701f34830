"""The global memory plan: every buffer's address on every tile it lives on, from liveness over the whole program.

Weights are always live (streamed ones from their arrival to their last reader) and packed first, per tile; above
them, activations and temporary buffers get one offset (the same on each of their tiles, relative to the tile's
weight end) first-fit among the buffers whose live ranges overlap (times are half-steps: 2k = compute of step k,
2k+1 = its exchange). Code, vertex state and exchange code sit at the top of each tile's SRAM; instructions (code and
exchange code) must also fit the chip's code region (the only memory that can fetch them: ipu-stack-facts §3), or
the plan does not fit. Offsets are aligned to the chip's operand alignment (ALIGN without a chip).

Layers that share code (plan/share.py) need each class of corresponding buffers at one offset. Their classes are
first-fit in folded time (half-steps modulo the run's period, from the template layer's start): two classes that are
live at the same moment of any layer then never share bytes. The run's classes together form one region, placed among
the other buffers as a single buffer live from the first to the last moment any of them is.

A matmul's left operand and output must not share a memory element (plan/elements.py). Given the pairs, the first fit
moves a buffer up past its partner's last element on every tile where they meet (exact: each tile's own weight end
fixes where its elements fall). Inside one run the region's base is not yet known when its classes are folded, so
partner classes are kept a whole (interleaved) element apart, which separates them wherever the region lands.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tremula.plan.elements import element_end, share_element

ALIGN = 8  # 64-bit loads/stores need 8-byte aligned operands (ref §2: 64-bit data path); a chip may ask more
INSTRUCTION_CATEGORIES = ("code", "exchange_code")  # what must sit in the code region
CATEGORIES = ("weights", "activations", "code", "vertex_state", "exchange_code", "buffers")


def align(n: np.ndarray | int, to: int = ALIGN):
    return (n + to - 1) // to * to


@dataclass
class MemoryPlan:
    offset: np.ndarray  # [n_bufs] activations/buffers: offset above the tile's weights; weights: unused
    act_base: np.ndarray  # [tiles] where a tile's activation region starts (the end of its weights)
    weight_addr: np.ndarray  # [n_weight_bufs, tiles] address of each weight buffer on each tile (-1: not there)
    weight_row: np.ndarray  # [n_bufs] row of weight_addr for weight buffers, -1 for others
    tile_used: np.ndarray  # [tiles] bytes from 0 to the highest buffer end, plus the reserved bytes at the top
    fits: bool
    fullest_tile: int
    peak_time: int  # half-step at which the fullest tile holds the most live bytes
    by_category: dict[str, int]  # live bytes on the fullest tile at peak_time, per category
    code_region_used: np.ndarray | None = None  # [tiles] instruction bytes (code + exchange code)
    code_region_bytes: int | None = None  # what the chip's code region holds

    def code_overflow(self) -> tuple[int, int] | None:
        """(tile, instruction bytes) of the tile whose instructions overflow the code region most, else None."""
        if self.code_region_used is None or self.code_region_bytes is None:
            return None
        t = int(np.argmax(self.code_region_used))
        return (t, int(self.code_region_used[t])) if self.code_region_used[t] > self.code_region_bytes else None

    @property
    def peak_bytes(self) -> int:
        return int(self.tile_used.max())

    def resolve(self, bufs: np.ndarray, tiles: np.ndarray) -> np.ndarray:
        """Tile address of buffer bufs[i] on tiles[i] (same shapes)."""
        bufs, tiles = np.broadcast_arrays(np.asarray(bufs, np.int64), np.asarray(tiles, np.int64))
        row = self.weight_row[bufs]
        w = row >= 0
        out = self.act_base[tiles] + self.offset[bufs]
        if w.any():
            out = np.where(w, self.weight_addr[np.maximum(row, 0), tiles], out)
        return out


def lowest_gap(spans, size: int, start: int = 0) -> int:
    """The lowest offset from `start` where `size` bytes fit between the sorted (offset, end, ...) spans taken."""
    pos = start
    for off, end, *_ in spans:
        if end <= pos:
            continue
        if off - pos >= size:
            break
        pos = max(pos, end)
    return pos


def first_fit(sizes: np.ndarray, first: np.ndarray, last: np.ndarray, bump=None, largest: bool = False) -> np.ndarray:
    """Offsets such that two buffers whose [first, last] ranges intersect never share bytes, each placed at the lowest
    offset clear of the placed buffers it meets in time: in order of their first moment (largest first among equals),
    or, with `largest`, largest first (earliest first among equals). `bump(b, pos, offset, placed)`, when given,
    returns the lowest offset at or above pos that b's placement rules (memory elements) allow against the buffers
    already placed; the search goes on from there."""
    n = len(sizes)
    offset = np.zeros(n, np.int64)
    placed = np.zeros(n, bool)
    order = np.lexsort((first, -sizes)) if largest else np.lexsort((-sizes, first))
    pf, pl, po, pe = (np.zeros(n, np.int64) for _ in range(4))  # placed buffers' first, last, offset, end
    k = 0
    for b in order.tolist():
        f, la, size = int(first[b]), int(last[b]), int(sizes[b])
        meet = (pf[:k] <= la) & (pl[:k] >= f)
        o, e = po[:k][meet], pe[:k][meet]
        srt = np.argsort(o, kind="stable")
        spans = list(zip(o[srt].tolist(), e[srt].tolist()))
        pos = lowest_gap(spans, size)
        while bump is not None and (nxt := bump(b, pos, offset, placed)) > pos:
            pos = lowest_gap(spans, size, nxt)
        offset[b] = pos
        placed[b] = True
        pf[k], pl[k], po[k], pe[k] = f, la, pos, pos + size
        k += 1
    return offset


def fold_fit(sizes: np.ndarray, occ: np.ndarray, apart: np.ndarray | None = None, gap: int = 0,
             largest: bool = False) -> np.ndarray:
    """Offsets such that two classes whose folded occupancies occ[c] ([period] bool) intersect never share bytes,
    and classes marked apart[c, d] keep `gap` bytes between them; placed in order of their first folded moment, or
    largest first (first_fit's orders)."""
    n = len(sizes)
    offset = np.zeros(n, np.int64)
    start = np.where(occ.any(axis=1), occ.argmax(axis=1), 0)
    placed: list[int] = []
    for c in (np.lexsort((start, -sizes)) if largest else np.lexsort((-sizes, start))).tolist():
        p = np.array(placed, np.int64)
        p = p[(occ[p] & occ[c]).any(axis=1)]  # placed classes live at some same folded moment
        g = gap * apart[c, p] if apart is not None else np.zeros(len(p), np.int64)
        offset[c] = lowest_gap(sorted(zip((offset[p] - g).tolist(), (offset[p] + sizes[p] + g).tolist())),
                               int(sizes[c]))
        placed.append(c)
    return offset


def _fold_run(run, maxsize: np.ndarray, first: np.ndarray, last: np.ndarray, partners: dict,
              gap: int, largest: bool) -> tuple[np.ndarray, int]:
    """Offset of each member of a run's classes inside the run's region, and the region's size (classes holding a
    matmul's left operand and output `gap` apart)."""
    n_cls = int(run.cls.max()) + 1
    cls_of = dict(zip(run.members.tolist(), run.cls.tolist()))
    apart = np.zeros((n_cls, n_cls), np.int64)
    for b, c in cls_of.items():
        for p, _ in partners.get(b, ()):
            if p in cls_of:
                apart[c, cls_of[p]] = apart[cls_of[p], c] = 1
    sizes = np.zeros(n_cls, np.int64)
    np.maximum.at(sizes, run.cls, maxsize[run.members])
    occ = np.zeros((n_cls, run.period), bool)
    for b, c in zip(run.members.tolist(), run.cls.tolist()):
        f, last_ = int(first[b]), int(last[b])
        if last_ - f + 1 >= run.period:
            occ[c] = True
        else:
            occ[c, (np.arange(f, last_ + 1) - run.start) % run.period] = True
    off = fold_fit(sizes, occ, apart, gap, largest)
    return off[run.cls], int((off + sizes).max())


def plan_memory(cats: list[str], tiles_of: list[np.ndarray], sizes_of: list[np.ndarray], first: np.ndarray,
                last: np.ndarray, n_tiles: int, reserved: dict[str, np.ndarray], sram: int,
                runs=(), alignment: int = ALIGN, code_region: int | None = None, apart=(),
                elements=None, alias: np.ndarray | None = None, orders: tuple[bool, ...] = (False,)) -> MemoryPlan:
    """`apart`: (buffer, buffer, tiles) that must not share a memory element on those tiles, with `elements` (the
    chip) giving the element geometry. `alias[b]` >= 0: weight buffer b takes the addresses of that earlier weight
    buffer (streamed weights taking turns in one slot, plan/stream.py; their live ranges never meet)."""
    n = len(cats)
    partners: dict[int, list[tuple[int, np.ndarray]]] = {}
    if elements is not None:
        for a, b, t in apart:
            partners.setdefault(int(a), []).append((int(b), t))
            partners.setdefault(int(b), []).append((int(a), t))
    is_w = np.array([c == "weights" for c in cats], bool)
    # Weights: always live, packed per tile in placement order.
    w_idx = np.flatnonzero(is_w)
    weight_row = np.full(n, -1, np.int64)
    weight_row[w_idx] = np.arange(len(w_idx))
    weight_addr = np.full((len(w_idx), n_tiles), -1, np.int64)
    cursor = np.zeros(n_tiles, np.int64)
    for r, b in enumerate(w_idx.tolist()):
        t = tiles_of[b]
        if alias is not None and alias[b] >= 0:
            weight_addr[r, t] = weight_addr[weight_row[alias[b]], t]
            continue
        weight_addr[r, t] = cursor[t]
        cursor[t] += align(sizes_of[b], alignment)
    act_base = align(cursor, alignment)
    # Activations and temporaries: one offset above each tile's weights, first fit over live ranges.
    maxsize = np.array([align(int(s.max()), alignment) if len(s) else 0 for s in sizes_of], np.int64)
    # `orders`: the orders of placement (first_fit's `largest`) to make, the lower peak kept. Neither packs every plan
    # tighter (SigLIP so400m fp8 b8's fullest tile: 63.5 KiB free below its high-water mark by first moments, 21.9 KiB
    # largest first; BERT-base fp16 b128 the other way), and the budget search (pipeline.plan_graph) keeps the first
    # plan that fits, so a tighter packing there can pass over a faster plan: only the growth (pipeline._grown), which
    # keeps the fastest, asks for both.
    counts = np.array([len(t) for t in tiles_of], np.int64)
    all_t = np.concatenate(tiles_of).astype(np.int64) if n else np.zeros(0, np.int64)
    all_s = np.concatenate(sizes_of).astype(np.int64) if n else np.zeros(0, np.int64)
    all_b = np.repeat(np.arange(n), counts)
    act = ~is_w[all_b]
    gap = elements.interleaved_element_bytes if elements is not None else 0
    in_run = np.zeros(n, bool)
    for run in runs:
        in_run[run.members] = True
    a_idx = np.flatnonzero(~is_w & ~in_run)
    # Each first-fit item (a buffer, or a run's region); where each of its buffers sits inside it depends on the order
    item_of = np.full(n, -1, np.int64)
    item_of[a_idx] = np.arange(len(a_idx))
    for r, run in enumerate(runs):
        item_of[run.members] = len(a_idx) + r
    members = [[int(b)] for b in a_idx] + [run.members.tolist() for run in runs]
    r_first = np.array([int(first[run.members].min()) for run in runs], np.int64)
    r_last = np.array([int(last[run.members].max()) for run in runs], np.int64)

    def place(largest: bool):
        offset = np.zeros(n, np.int64)
        rel_of = np.zeros(n, np.int64)
        folded, r_size = [], np.zeros(len(runs), np.int64)
        for r, run in enumerate(runs):
            off, r_size[r] = _fold_run(run, maxsize, first, last, partners, gap, largest)
            folded.append(off)
            rel_of[run.members] = off

        def bump(i: int, pos: int, offset: np.ndarray, placed: np.ndarray) -> int:
            """Lowest offset >= pos at which item i's buffers share no element with their placed partners."""
            nxt = pos
            for m in members[i]:
                for p, tiles in partners.get(m, ()):
                    if item_of[p] == i:  # the same run: its fold already keeps them apart
                        continue
                    if is_w[p]:
                        lo_p = weight_addr[weight_row[p], tiles]
                        tiles, lo_p = tiles[lo_p >= 0], lo_p[lo_p >= 0]
                    elif placed[item_of[p]]:
                        lo_p = act_base[tiles] + offset[item_of[p]] + rel_of[p]
                    else:
                        continue
                    if not (maxsize[m] and maxsize[p] and len(tiles)):
                        continue
                    lo_m = act_base[tiles] + pos + rel_of[m]
                    bad = share_element(lo_m, lo_m + maxsize[m], lo_p, lo_p + maxsize[p], elements)
                    if bad.any():  # above the partner's last element on each tile where they meet
                        need = element_end(lo_p[bad] + maxsize[p] - 1, elements) - act_base[tiles[bad]] - rel_of[m]
                        nxt = max(nxt, int(align(int(need.max()), alignment)))
            return nxt

        off = first_fit(np.concatenate([maxsize[a_idx], r_size]), np.concatenate([first[a_idx], r_first]),
                        np.concatenate([last[a_idx], r_last]), bump if partners else None, largest)
        offset[a_idx] = off[: len(a_idx)]
        for run, base, member_off in zip(runs, off[len(a_idx):].tolist(), folded):
            offset[run.members] = base + member_off
        # Highest byte used on each tile.
        hw = act_base.copy()
        np.maximum.at(hw, all_t[act], act_base[all_t[act]] + offset[all_b[act]] + all_s[act])
        used = hw + sum(reserved.values())
        return offset, used

    offset, used = min((place(largest) for largest in orders), key=lambda p: int(p[1].max()))
    fullest = int(np.argmax(used))
    # Live bytes by category on the fullest tile over time.
    on = all_t == fullest
    bidx, bsize = all_b[on], all_s[on]
    by_cat = {c: 0 for c in CATEGORIES}
    peak_time = 0
    if len(bidx):
        times = np.unique(np.concatenate([first[bidx], last[bidx]]))
        live = (first[bidx][None, :] <= times[:, None]) & (last[bidx][None, :] >= times[:, None])
        tot = live.astype(np.int64) @ bsize
        ti = int(np.argmax(tot))
        peak_time = int(times[ti])
        for b, sz in zip(bidx[live[ti]].tolist(), bsize[live[ti]].tolist()):
            by_cat[cats[b]] += int(sz)
    for k, v in reserved.items():
        by_cat[k] = int(v[fullest])
    instructions = sum(reserved.get(c, 0) for c in INSTRUCTION_CATEGORIES) + np.zeros(n_tiles, np.int64)
    fits = bool(used.max() <= sram) and (code_region is None or bool(instructions.max() <= code_region))
    return MemoryPlan(offset, act_base, weight_addr, weight_row, used, fits, fullest, peak_time, by_cat,
                      instructions, code_region)

"""Layers whose lowered steps are identical share one copy of their vertex state and exchange code.

A run of layers (found by structure, ir/layers.py) shares when every layer's vertex groups and transfers are
those of a template layer, item by item: the same codelets, tiles, shapes, offsets, transfer patterns, at a constant
step distance, with buffers that map one-to-one onto the template's. Then the layer can run the template's code, as
an outlined function (a Poplar `Call`), if
- every non-weight buffer sits where its template counterpart sits (the memory plan gives each class of such buffers
  one offset: plan/memory.py), and
- its weights sit at the template's weight addresses plus one distance per tile and layer (checked on the memory plan
  by `check_weight_strides`): the exchange code then takes the layer's weight base from a register, one extra
  instruction per weight-sourced transfer on its sender, and vertices that point at weights, or whose parameters
  differ between layers (FP8 activation scales), get those fields rewritten before each call from a table of
  4 bytes per field and layer (counted as vertex state).
Layers that do not match are not shared and keep their own code; matching is checked, never assumed. In the Program,
each step of a shared layer is a `Call` of its template step (program.py) holding only those fields and the per-tile
weight base: the simulator runs the template's code with them applied, and the timing charges rewriting them
(cost_terms.call_cycles).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tremula.plan.replay import renamed
from tremula.plan.state import LoweringState
from tremula.target.overheads import PATCH_WORD_BYTES

I64 = np.int64


@dataclass
class Run:
    start: int  # half-step of the template layer's first step: the origin of the fold
    period: int  # half-steps from one layer of the run to the next
    members: np.ndarray  # buffer ids that belong to a class of this run
    cls: np.ndarray  # class (0..) of each member; members of one class get one offset


@dataclass
class Sharing:
    runs: list[Run] = field(default_factory=list)
    replica_groups: set = field(default_factory=set)  # (step, group index) whose code is its template's
    replica_tables: set = field(default_factory=set)  # (step, transfer table index) likewise
    template_tables: set = field(default_factory=set)  # tables that replicas reuse (they read a weight base)
    weight_pairs: list = field(default_factory=list)  # (replica weight bufs, template weight bufs) per shared layer
    patch_bytes: np.ndarray | None = None  # [tiles] the per-layer tables of rewritten vertex fields
    shared_layers: int = 0  # layers that run a template's code
    calls: dict = field(default_factory=dict)  # step -> the template step whose code it runs (the Program's Calls)
    call_words: dict = field(default_factory=dict)  # step -> int64 [tiles] vertex fields its call rewrites
    call_base: dict = field(default_factory=dict)  # step -> bool [tiles] tiles whose weight base its call sets


def _entries(state: LoweringState) -> dict[tuple[str, int], list[tuple[int, int, int]]]:
    """(step, kind 0 = vertex group / 1 = transfer table, index) of every item, by the layer of its owner."""
    out: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    for k, s in enumerate(state.steps):
        for i, o in enumerate(s.group_owners):
            key = state.layers.get(o)
            if key is not None:
                out.setdefault(key, []).append((k, 0, i))
        for i, o in enumerate(s.owners):
            key = state.layers.get(o)
            if key is not None:
                out.setdefault(key, []).append((k, 1, i))
    return out


_GROUP_SAME = ("tiles", "rels", "shapes")
_TABLE_SAME = ("src_tile", "src_rel", "rows", "row_bytes", "src_stride", "dst_start", "d_tile", "d_rel", "d_stride")


def patch_columns(ga, gb, is_w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(operand fields, parameter fields) a layer's group gb rewrites in its template's group ga before each call:
    pointers to weights (they move with the layer) and parameters that differ (FP8 scales)."""
    return _weight_columns(ga, is_w), _param_columns(ga, gb)


def _weight_columns(ga, is_w: np.ndarray) -> np.ndarray:
    """The operand fields of template group ga that point at weights (the same for every layer that calls it)."""
    return np.flatnonzero(is_w[ga.bufs].any(axis=0))


def _param_columns(ga, gb) -> np.ndarray:
    """The parameter fields where group gb differs from its template's ga (none when a replay shares the array)."""
    return np.zeros(0, I64) if ga.params is gb.params else np.flatnonzero((ga.params != gb.params).any(axis=0))


def _same(x: np.ndarray, y: np.ndarray) -> bool:
    return x is y or np.array_equal(x, y)  # (a layer copied from its template shares its arrays: plan/replay.py)


def _match(state: LoweringState, a: list, b: list, is_w: np.ndarray, hint: _Renaming | None = None):
    """Compare layer b's items with template a's: (step shift, buffer pairs [n, 2] as (b, a) in order of b) or None
    when they differ. hint: how a replay renamed the template's ids into b's, checked on every id before it is
    used (_hinted_pairs)."""
    if len(a) != len(b) or not a:
        return None
    shift = b[0][0] - a[0][0]
    named = []  # (the buffer ids an item of layer b names, the template's in the same places)
    for (ka, kind, ia), (kb, kind_b, ib) in zip(a, b):
        if kind != kind_b or kb - ka != shift:
            return None
        if kind == 0:
            ga, gb = state.steps[ka].groups[ia], state.steps[kb].groups[ib]
            if (ga.codelet, ga.dtypes) != (gb.codelet, gb.dtypes) or ga.params.shape != gb.params.shape or \
                    any(not _same(getattr(ga, f), getattr(gb, f)) for f in _GROUP_SAME) or \
                    ga.bufs.shape != gb.bufs.shape:
                return None
            named.append((gb.bufs, ga.bufs))
        else:
            ta, tb = state.steps[ka].transfers[ia], state.steps[kb].transfers[ib]
            if len(ta) != len(tb) or len(ta.d_tile) != len(tb.d_tile) or \
                    any(not _same(getattr(ta, f), getattr(tb, f)) for f in _TABLE_SAME):
                return None
            named += [(tb.src_buf, ta.src_buf), (tb.d_buf, ta.d_buf)]
    pairs = _hinted_pairs(hint, named) if hint is not None else None
    if pairs is None:
        pairs = _pairs(state, named)
    if pairs is None:
        return None
    # and each buffer like its counterpart: same kind, tiles and bytes
    for pb, pa in pairs.tolist():
        sa, sb = state.bufs[pa], state.bufs[pb]
        if is_w[pa] != is_w[pb] or not (_same(sa.tiles, sb.tiles) and _same(sa.sizes, sb.sizes)):
            return None
    return shift, pairs


def _pairs(state: LoweringState, named: list) -> np.ndarray | None:
    """The (b, a) buffer pairs of the places `named` pairs up, in order of b, when they pair one-to-one; else None."""
    # The pairs must be one-to-one. b -> a is a function when, after writing every pair into a table indexed by b
    # (of repeated b's, one write wins), reading the table back gives every a; it is one-to-one when the a's of the
    # distinct b's differ. No sort: a layer's items name a few hundred buffers in a million places.
    fwd = np.full(len(state.bufs), -1, I64)
    for mine, theirs in named:
        fwd[mine] = theirs
    if any((fwd[mine] != theirs).any() for mine, theirs in named):
        return None
    bs = np.flatnonzero(fwd >= 0)
    pairs = np.stack([bs, fwd[bs]], axis=1)
    if len(np.unique(pairs[:, 1])) != len(pairs):
        return None
    return pairs


class _Renaming:
    """A replayed layer's renaming of its template's buffer ids (plan/replay.py's `replayed`), over every id (-1:
    none), whether it is one-to-one where defined, and the template's ids its items name (found once a template, for
    all the layers replayed from it)."""

    def __init__(self, bmap: np.ndarray, n_bufs: int, named_ids: Callable[[], np.ndarray]):
        self.to = np.full(n_bufs, -1, I64)
        self.to[: len(bmap)] = bmap
        onto = self.to[self.to >= 0]
        self.one_to_one = len(np.unique(onto)) == len(onto)
        self.named_ids = named_ids
        self._as: dict[np.dtype, np.ndarray] = {np.dtype(I64): self.to}

    def of(self, ids: np.ndarray) -> np.ndarray:
        """The renamings of `ids`, as the replay renamed them (in their dtype when it holds them)."""
        return renamed(self._as, ids)


def _hinted_pairs(hint: _Renaming, named: list) -> np.ndarray | None:
    """_pairs by a replay's renaming: when every id b names is the renaming of the template's id in its place (each
    place checked) and the renaming is one-to-one, the pairs are the template's named ids with their renamings, in
    order of b; None when that does not hold (the caller pairs them the long way). One gather a place, where
    _pairs scatters, gathers and compares."""
    if not hint.one_to_one or any(not np.array_equal(hint.of(theirs), mine) for mine, theirs in named):
        return None
    ids = hint.named_ids()
    pairs = np.stack([hint.to[ids], ids], axis=1)
    return pairs[np.argsort(pairs[:, 0], kind="stable")]


def find_sharing(state: LoweringState) -> Sharing:
    """The layers that can run their template's code, and what the memory plan must do for them."""
    sh = Sharing(patch_bytes=np.zeros(state.T, I64))
    is_w = np.array([b.category == "weights" for b in state.bufs], bool)
    entries = _entries(state)
    prefixes: dict[str, list[int]] = {}
    for p, i in entries:
        prefixes.setdefault(p, []).append(i)
    owned = np.full(len(state.bufs), -1, I64)  # run that a buffer's class belongs to
    replayed = getattr(state, "replayed", {})
    for p, idx in prefixes.items():
        k = 0
        while k < len(idx):
            tmpl = entries[(p, idx[k])]
            matched = []  # (layer's entries, pairs)
            period = None
            named_ids = functools.cache(lambda t=tmpl: _named_ids(state, t))  # (once a template, when asked)
            for j in idx[k + 1:]:
                mine = entries[(p, j)]
                r = replayed.get((p, j))
                hint = _Renaming(r[1], len(state.bufs), named_ids) if r is not None and r[0] == (p, idx[k]) else None
                r = _match(state, tmpl, mine, is_w, hint)
                if r is None or (period is None and r[0] <= 0) or \
                        (period is not None and r[0] != period * (len(matched) + 1)):
                    break
                period = period or r[0]
                matched.append((mine, r[1]))
            k += 1 + len(matched)
            if matched:
                _add_run(sh, state, tmpl, period, matched, is_w, owned)
    _whole_steps(sh, state, is_w)
    return sh


def _named_ids(state: LoweringState, items: list) -> np.ndarray:
    """Every buffer id a layer's items name (its vertex groups' operands, its tables' sources and destinations)."""
    seen = np.zeros(len(state.bufs), bool)
    for k, kind, i in items:
        if kind == 0:
            seen[state.steps[k].groups[i].bufs] = True
        else:
            t = state.steps[k].transfers[i]
            seen[t.src_buf] = True
            seen[t.d_buf] = True
    return np.flatnonzero(seen)


def _whole_steps(sh: Sharing, state: LoweringState, is_w: np.ndarray) -> None:
    """Keep the sharing the Program can hold: a step runs its template's code (a Call) only when every one of its
    vertex groups and transfer tables is a replica of the item at the same index of one template step, which has
    code of its own; anything else keeps its own code. Patch bytes and weight-based tables follow the calls kept."""
    steps = {k for k, _ in sh.replica_groups} | {k for k, _ in sh.replica_tables}
    calls = {}
    for k in sorted(steps):
        s = state.steps[k]
        t = sh.calls.get(k)
        ok = t is not None and t >= 0 and t not in steps and \
            all((k, i) in sh.replica_groups for i in range(len(s.groups))) and \
            all((k, i) in sh.replica_tables for i in range(len(s.transfers))) and \
            (len(s.groups), len(s.transfers)) == (len(state.steps[t].groups), len(state.steps[t].transfers))
        if ok:
            calls[k] = t
    sh.calls = calls
    if not calls:
        sh.shared_layers = 0
    sh.replica_groups = {(k, i) for k in calls for i in range(len(state.steps[k].groups))}
    sh.replica_tables = {(k, i) for k in calls for i in range(len(state.steps[k].transfers))}
    sh.template_tables = {(t, i) for t in set(calls.values()) for i in range(len(state.steps[t].transfers))}
    sh.patch_bytes = np.zeros(state.T, I64)
    sh.call_words, sh.call_base = {}, {}
    of_template: dict[int, tuple] = {}  # what a call's words and base take from its template step alone
    for k, t in calls.items():
        if t not in of_template:
            groups = state.steps[t].groups
            base = np.zeros(state.T, bool)
            for tt in state.steps[t].transfers:
                base[tt.src_tile[is_w[tt.src_buf]]] = True
            of_template[t] = ([np.bincount(ga.tiles, minlength=state.T).astype(I64) for ga in groups],
                              [len(_weight_columns(ga, is_w)) for ga in groups], base)
        counts, weight_fields, base = of_template[t]
        words = np.zeros(state.T, I64)
        for ga, gb, n, w in zip(state.steps[t].groups, state.steps[k].groups, counts, weight_fields):
            fields = w + len(_param_columns(ga, gb))  # patch_columns' count, the weights' part taken once a template
            if fields:
                words += n * fields
        sh.call_words[k], sh.call_base[k] = words, base
        sh.patch_bytes += words * PATCH_WORD_BYTES


def _add_run(sh: Sharing, state: LoweringState, tmpl: list, period: int, matched: list, is_w: np.ndarray,
             owned: np.ndarray) -> None:
    run_id = len(sh.runs)
    act = [m[1][(~is_w[m[1][:, 0]]) & (m[1][:, 0] != m[1][:, 1])] for m in matched]
    links = np.concatenate(act) if act else np.zeros((0, 2), I64)
    if len(links) and (owned[links.reshape(-1)] >= 0).any():
        return  # its buffers already share a slot with another run's: leave this run unshared
    # classes: connected components of the pairs (union-find)
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for b, a in links.tolist():
        rb, ra = find(b), find(a)
        if rb != ra:
            parent[rb] = ra
    members = np.array(sorted(parent), I64)
    roots = np.array([find(int(m)) for m in members], I64)
    _, cls = np.unique(roots, return_inverse=True)
    owned[members] = run_id
    sh.runs.append(Run(2 * tmpl[0][0], 2 * period, members, cls.astype(I64).reshape(-1)))
    for mine, pairs in matched:
        sh.shared_layers += 1
        for (k, kind, i), (ka, _, ia) in zip(mine, tmpl):
            (sh.replica_groups if kind == 0 else sh.replica_tables).add((k, i))
            # a step maps to one template step, item for item, or it is not a call (_whole_steps)
            if i != ia or sh.calls.setdefault(k, ka) != ka:
                sh.calls[k] = -1
        w = is_w[pairs[:, 0]]
        sh.weight_pairs.append((pairs[w, 0], pairs[w, 1]))
    sh.template_tables.update((k, i) for k, kind, i in tmpl if kind == 1)


def check_weight_strides(sh: Sharing, mp) -> str:
    """'' when every shared layer's weights sit at its template's weight addresses plus one distance per tile (what
    a base register can add); else what breaks that."""
    for rep, tmp in sh.weight_pairs:
        if not len(rep):
            continue
        rows_r, rows_t = mp.weight_row[rep], mp.weight_row[tmp]
        ar, at = mp.weight_addr[rows_r], mp.weight_addr[rows_t]
        on = ar >= 0
        if not np.array_equal(on, at >= 0):
            return "a shared layer's weights are on other tiles than its template's"
        d = np.where(on, ar - at, 0)
        lo = np.where(on, d, np.iinfo(I64).max).min(axis=0)
        hi = np.where(on, d, np.iinfo(I64).min).max(axis=0)
        if ((lo != hi) & on.any(axis=0)).any():
            return "a shared layer's weights are not at one distance from its template's on some tile"
    return ""

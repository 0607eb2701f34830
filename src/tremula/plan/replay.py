"""Lowering a repeated layer once: each identical layer after it gets the template layer's steps, buffers and choices,
renamed, instead of being lowered again (issue #14, "plan a layer once").

In shared-layer mode (plan/layers.py) every layer of a run starts from the same placement state, reads its carried
input in the same layout and leaves its output in that layout, so lowering layer i repeats the template's choices
item for item: the same vertex groups, transfers and buffer shapes, over the layer's own buffers, constants and value
names, with its own FP8 scales in the vertex parameters that hold them (PER_LAYER_PARAMS). Replaying is therefore
what lowering would make, at a fraction of the time (SigLIP so400m: 27 layers, one lowered). A test lowers every layer
and compares the two states whole (tests/unit/test_layer_replay.py), and plan/share.py still proves the layers
identical before they share code. A layer is lowered for real whenever a condition the copy rests on does not hold
(`_maps`): its nodes' attributes differ other than in a parameter listed below, a value it reads from outside the
layer sits in other blocks than the template's did, or the template touched state a copy cannot rename.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tremula.ir.layers import LayerKey, node_key
from tremula.plan.exchange import SymTransfers
from tremula.plan.state import BufSpec, SymConst, SymGroup, SymStep

I64 = np.int64
# Vertex parameters that take a node attribute which may differ from layer to layer (ir/layers.PER_LAYER_ATTRS), by
# codelet: (column, attribute). The lowering writes them from these attributes (lower_elementwise.lower_elementwise for
# fp8_cast, lower_linear._matmul_codelet for matmul_fp8); a per-layer attribute found anywhere else stops the replay.
PER_LAYER_PARAMS = {"fp8_cast": ((1, "scale"), (3, "seed")), "matmul_fp8": ((3, "x_scale"),)}
_DICTS = ("layouts", "strategies", "split_sums", "paired")  # the Lowerer's per-name choices a layer adds to


@dataclass
class _Template:
    key: LayerKey
    t0: int  # first step (the empty one the layer started on) ...
    t1: int  # ... and one past its last, its carried output's re-layout included
    b0: int  # buffers [b0, b1) and constants [c0, c1) the layer made
    b1: int
    c0: int
    c1: int
    before: dict  # name of each of _DICTS -> that dict as it was when the layer started
    added: dict  # name of each of _DICTS -> the entries the layer added or changed
    placed: np.ndarray  # weight bytes per tile the layer placed
    end: dict  # placement state when the layer ended
    refs: np.ndarray  # every buffer id the layer's steps name
    owners: set  # every node its steps' items are attributed to
    covered: dict  # node key -> per-layer attributes its vertex parameters hold (PER_LAYER_PARAMS)


def _differs(x, y) -> bool:
    try:
        return bool(x != y)
    except ValueError:  # arrays
        return not np.array_equal(x, y)


def renamed(bmaps: dict, ids: np.ndarray) -> np.ndarray:
    """Buffer ids renamed by the map (template id -> the layer's, -1 for none), in the ids' own dtype when it is a
    signed one that holds every id the map gives (-1 stays -1): bmaps holds the map in each dtype asked for (made
    from its int64 one), so a table's million ids are gathered once, not gathered and then converted; int64 otherwise
    (a wrapped id could equal another, and plan/share.py proves layers identical through this)."""
    m = bmaps.get(ids.dtype)
    if m is None:
        full = bmaps[np.dtype(I64)]
        fits = ids.dtype.kind == "i" and np.iinfo(ids.dtype).max >= int(full.max(initial=0))
        m = bmaps[ids.dtype] = full.astype(ids.dtype) if fits else full
    return m[ids]


def _rename_key(d: str, k: str, nmap: dict, vmap: dict) -> str | None:
    """Layer i's name for an entry the template added to dict `d`: strategies and pairs are keyed by node (a fused
    projection's parts by node + ".<part>"), the rest by value."""
    if d in ("strategies", "paired"):
        if k in nmap:
            return nmap[k]
        head, dot, part = k.rpartition(".")
        if dot and head in nmap and part.isdigit():
            return f"{nmap[head]}.{part}"
    return vmap.get(k)


class LayerReplay:
    """Mixin for the Lowerer (with SharedLayers): record a run's first layer as it is lowered, replay it for the
    layers after it."""

    replay = True

    def _init_replay(self) -> None:
        self._templates: dict[str, _Template | None] = {}  # run -> its template (None: cannot be replayed)
        self._recording: dict | None = None
        self._replayed = False
        self.replay_misses: dict[LayerKey, str] = {}  # layer -> why it was lowered instead of copied
        # layer -> (its template, template buffer id -> the layer's, -1 for none): how the copy renamed its ids,
        # a hint plan/share.py checks against every id before it trusts it
        self.replayed: dict[LayerKey, tuple[LayerKey, np.ndarray]] = {}

    def _record_start(self, key: LayerKey) -> None:
        """At the start of a layer whose run has no template yet (the layer starts on an empty step)."""
        if not self.replay or key[0] in self._templates:
            return
        if not self.steps or self.steps[-1].groups or self.steps[-1].transfers:
            self._templates[key[0]] = None
            return
        self._recording = {"key": key, "t0": len(self.steps) - 1, "b0": len(self.bufs), "c0": len(self.consts),
                           "before": {d: dict(getattr(self, d)) for d in _DICTS}, "placed": self.placed.copy()}

    def _record_end(self) -> None:
        """When the layer being recorded has ended (its carried output pinned): keep it as its run's template."""
        r, self._recording = self._recording, None
        if r is None:
            return
        key = r["key"]
        added, ok = {}, self.shared_x is None
        for d in _DICTS:
            now, before = getattr(self, d), r["before"][d]
            ok = ok and all(k in now for k in before)  # an entry the layer removed cannot be renamed
            added[d] = {k: v for k, v in now.items() if before.get(k) is not v}
        steps = self.steps[r["t0"]:]
        refs = [np.zeros(0, I64)]
        covered: dict[str, set] = {}
        owners = {o for s in steps for o in (*s.owners, *s.group_owners)} | \
            {s.origin.node for s in steps if s.origin is not None}
        for s in steps:
            for g, o in zip(s.groups, s.group_owners):
                refs.append(np.unique(g.bufs))
                covered.setdefault(o, set()).update(a for _, a in PER_LAYER_PARAMS.get(g.codelet, ()))
            for t in s.transfers:
                refs += [np.unique(t.src_buf), np.unique(t.d_buf)]
        end = {"cursor": self.cursor, "row_cursor": self.row_cursor, "wload": self.wload.copy(),
               "spread": dataclasses.replace(self._spread, used=self._spread.used.copy()) if self._spread else None,
               "ex_written": set(self._ex_written), "carry_owner": self._carry_owner}
        self._templates[key[0]] = _Template(
            key, r["t0"], len(self.steps), r["b0"], len(self.bufs), r["c0"], len(self.consts), r["before"], added,
            self.placed - r["placed"], end, np.unique(np.concatenate(refs)).astype(I64), owners, covered) \
            if ok else None

    # ------------------------------------------------------------------------------------------------ replay
    def _miss(self, key: LayerKey, why: str) -> None:
        self.replay_misses[key] = why
        return None

    def _maps(self, t: _Template, key: LayerKey):
        """(node keys, values, buffer ids) of the template mapped to layer `key`'s, or None when a copy would not be
        what lowering makes."""
        nodes0, nodes = self._layer_nodes(t.key), self._layer_nodes(key)
        if len(nodes0) != len(nodes):
            return self._miss(key, 'the layers have different numbers of nodes')
        nmap: dict[str, str] = {}
        vmap: dict[str, str] = {}
        made = set()
        for a, b in zip(nodes0, nodes):
            if a.op != b.op or len(a.inputs) != len(b.inputs) or len(a.outputs) != len(b.outputs):
                return self._miss(key, 'a node differs in op or arity')
            nmap[node_key(a)] = node_key(b)
            for x, y in zip(a.inputs + a.outputs, b.inputs + b.outputs):
                if vmap.setdefault(x, y) != y:
                    return self._miss(key, 'a value maps to two')
            made.update(a.outputs)
            # only the per-layer parameters may differ, and only where the copy rewrites them
            diff = {k for k in a.attrs.keys() | b.attrs.keys() if _differs(a.attrs.get(k), b.attrs.get(k))}
            if diff and (not diff <= t.covered.get(node_key(a), set()) or a.attrs.get("rounding") == "stochastic"):
                return self._miss(key, 'a node attribute differs outside the per-layer parameters')
        bmap = np.full(t.b1, -1, I64)
        bmap[t.b0:t.b1] = len(self.bufs) + np.arange(t.b1 - t.b0, dtype=I64)
        for v0, vi in vmap.items():
            lay0 = t.before["layouts"].get(v0)
            if v0 in made or lay0 is None:
                continue
            lay = self.layouts.get(vi)  # read from before the layer: where it is now must be where it was then
            if lay is None or not (lay.same_blocks(lay0) and np.array_equal(lay.rel, lay0.rel)) or \
                    (bmap[lay0.buf] >= 0 and bmap[lay0.buf] != lay.buf):
                return self._miss(key, 'a value read from before the layer sits in other blocks')
            bmap[lay0.buf] = lay.buf
        if (bmap[t.refs] < 0).any() or not t.owners <= nmap.keys() or t.end["carry_owner"] not in nmap or \
                any(vmap.get(c.name, c.name) == c.name for c in self.consts[t.c0:t.c1]):
            return self._miss(key, 'a buffer, owner or constant of the template has no counterpart')
        for d in _DICTS:  # every name the layer adds to must be one of its own, and renamed
            for k in t.added[d]:
                m = _rename_key(d, k, nmap, vmap)
                if m is None or m == k:
                    return self._miss(key, 'a name the template added is not renamed')
        return nmap, vmap, bmap

    def _replay(self, key: LayerKey) -> bool:
        """Copy the run's template for layer `key` (which _enter has just started): True when it did."""
        t = self._templates.get(key[0]) if self.replay else None
        empty = bool(self.steps) and not (self.steps[-1].groups or self.steps[-1].transfers)
        maps = self._maps(t, key) if t is not None and empty else None
        if maps is None:
            return False
        nmap, vmap, bmap = maps
        self.replayed[key] = (t.key, bmap)
        nodes = {node_key(n): n for n in self._layer_nodes(key)}

        def rename(name: str) -> str:  # a buffer's name: value and node names joined by "@"
            return "@".join(vmap.get(p, nmap.get(p, p)) for p in name.split("@"))

        for spec in self.bufs[t.b0:t.b1]:
            buf = len(self.bufs)
            self.bufs.append(BufSpec(rename(spec.name), spec.category, spec.tiles, spec.sizes))
            if spec.category == "weights":
                self.weight_layer[buf] = key
        for c in self.consts[t.c0:t.c1]:
            self.consts.append(SymConst(vmap[c.name], c.tiles, int(bmap[c.buf]), c.rels, c.r0, c.r1, c.c0, c.c1,
                                        c.dtype))
        bmaps = {np.dtype(I64): bmap}
        copies = [self._replay_step(s, nmap, vmap, bmaps, nodes) for s in self.steps[t.t0:t.t1]]
        self.steps[-1:] = copies  # the layer's first step is the empty one _enter opened
        for d in _DICTS:
            target = getattr(self, d)
            for k, v in t.added[d].items():
                target[_rename_key(d, k, nmap, vmap)] = dataclasses.replace(v, buf=int(bmap[v.buf])) \
                    if d == "layouts" else v
        e = t.end
        self.cursor, self.row_cursor, self.wload = e["cursor"], e["row_cursor"], e["wload"].copy()
        self.placed = self.placed + t.placed
        self._spread = dataclasses.replace(e["spread"], used=e["spread"].used.copy()) if e["spread"] else None
        self._ex_written = {int(bmap[b]) for b in e["ex_written"]}
        self._carry, self._carry_owner = None, nmap[e["carry_owner"]]  # the copy holds the output's re-layout
        return True

    @staticmethod
    def _replay_step(s: SymStep, nmap, vmap, bmaps, nodes) -> SymStep:
        bmap = bmaps[np.dtype(I64)]
        groups = []
        for g, o in zip(s.groups, s.group_owners):
            params = g.params
            cols = PER_LAYER_PARAMS.get(g.codelet, ())
            if cols:
                attrs = nodes[nmap[o]].attrs
                params = params.copy()
                for col, a in cols:
                    params[:, col] = int(attrs[a])
            groups.append(SymGroup(g.codelet, g.dtypes, g.tiles, params, bmap[g.bufs], g.rels, g.shapes))
        transfers = [SymTransfers(x.src_tile, renamed(bmaps, x.src_buf), x.src_rel, x.rows, x.row_bytes, x.src_stride,
                                  x.dst_start, x.d_tile, renamed(bmaps, x.d_buf), x.d_rel, x.d_stride)
                     for x in s.transfers]
        origin, label = s.origin, s.label
        if origin is not None:  # a compute step's label is "<op> <value>[ <phase>][ (<round>)]"
            words = label.split(" ", 2)
            if len(words) > 1:
                words[1] = vmap.get(words[1], words[1])
            label = " ".join(words)
            origin = dataclasses.replace(origin, node=nmap[origin.node], value=vmap.get(origin.value, origin.value))
        return SymStep(groups, transfers, label, origin, [nmap[o] for o in s.owners],
                       [nmap[o] for o in s.group_owners])


"""Size limits checked before any work: a lower bound on the bytes a model needs, against the chip and the host.

The bound reads types and shapes only (nothing is allocated): every constant of the canonical graph is stored on the
chip once, and when a node runs its inputs are all live at once, and so are its outputs. So no plan can need less
than weights + the largest such set; code, vertex state, exchange buffers and copies only add to it. A batch whose
bound exceeds the chip's SRAM (tiles x SRAM per tile) cannot fit, and is refused in milliseconds instead of being
planned; the same bound, extrapolated linearly in the batch, caps the batch search. The host's bound counts the same
values at their host element sizes (the reference interpreter and checks hold them in float32) against a fixed share
of physical memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tremula.errors import NoFit
from tremula.ir.graph import Graph, TensorType
from tremula.ir.layers import find_layers, node_key
from tremula.plan.stream import MIN_RUN

# The share of physical RAM one model may take on the host: planning holds per-vertex tables, a check holds the
# graph's values, the reference's and the simulator's copy of every tile's SRAM, so half the machine is the most a
# single value set may take before the rest of the work has room.
HOST_FRACTION = 0.5
# Bytes per element on the chip, at least: a float is stored at the compile's precision (FP8 operands are one byte),
# anything else (ids, masks) at one byte or more.
_CHIP_FLOAT_BYTES = {"float32": 4, "float16": 2, "fp8": 1}
UNBOUNDED = 1 << 40  # "no batch limit from the bound" (no value grows with the batch)


def host_memory_budget() -> int | None:
    """HOST_FRACTION of this machine's physical memory, or None where the OS does not say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * HOST_FRACTION)
    except (ValueError, OSError, AttributeError):
        return None


def _bytes(n: float) -> str:
    for scale, unit in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Need:
    """The least a graph needs at one batch, for one memory (chip or host)."""

    batch: int | None
    weights: int  # every constant, stored once
    live: int  # the largest set of values that must be live together
    where: str  # the node at which that set is live
    per_node: dict[str, int] = field(default_factory=dict, repr=False)  # each node's live bytes, to extrapolate

    @property
    def total(self) -> int:
        return self.weights + self.live


def stored_itemsize(t: TensorType, dtype: str | None) -> int:
    """The fewest bytes an element of `t` takes on the chip at compile dtype `dtype` (None: on the host)."""
    if dtype is None:  # the host: what NumPy holds
        return t.itemsize
    if t.dtype.startswith("float"):
        return min(t.itemsize, _CHIP_FLOAT_BYTES[dtype])
    return 1


def needs(graph: Graph, dtype: str | None, batch: int | None = None, stream: bool = False) -> Need:
    """The bound for `graph` (canonical: fused ops never hold their intermediates) on the chip at compile dtype
    `dtype` ("float32", "float16", "fp8"), or on the host when dtype is None. Only types are read. `stream` (the
    chip): the weights of runs of repeated layers may be streamed from host memory (plan/stream.py), which leaves
    two layers' weights of each run on the chip."""
    size = {n: t.size * stored_itemsize(t, dtype) for n, t in graph.types.items()}
    weights = sum(size[c] for c in graph.constants)
    if stream and dtype is not None:
        weights -= streamable_bytes(graph, size)
    per_node: dict[str, int] = {}
    best, where = 0, ""
    for n in graph.nodes:
        ins = {i for i in n.inputs if i and i not in graph.constants}
        live = max(sum(size[i] for i in ins), sum(size[o] for o in n.outputs))
        label = n.name or n.outputs[0]
        per_node[label] = max(per_node.get(label, 0), live)
        if live > best:
            best, where = live, label
    return Need(batch, weights, best, where, per_node)


def streamable_bytes(graph: Graph, size: dict[str, int]) -> int:
    """Bytes of constants streaming can keep off the chip: in each run of MIN_RUN or more repeated layers
    (ir/layers.py), every layer's own constants but the two largest layers'."""
    layers = find_layers(graph)
    owners: dict[str, set] = {}
    for n in graph.nodes:
        for v in n.inputs:
            if v in graph.constants:
                owners.setdefault(v, set()).add(layers.get(node_key(n)))
    per_layer: dict[tuple, int] = {}
    for v, keys in owners.items():
        if len(keys) == 1 and None not in keys:  # read by one layer only
            (key,) = keys
            per_layer[key] = per_layer.get(key, 0) + size[v]
    runs: dict[str, list[int]] = {}
    for (run, _), nbytes in per_layer.items():
        runs.setdefault(run, []).append(nbytes)
    return sum(sum(b) - sum(sorted(b)[-2:]) for b in runs.values() if len(b) >= MIN_RUN)


def largest_batch(p: Need, q: Need, cap: int) -> int:
    """The largest batch whose bound stays within `cap`, each node's need taken linear in the batch between the two
    measured batches p and q (exact for graphs whose values carry the batch on one dim). 0: not even batch 1."""
    assert p.batch is not None and q.batch is not None and q.batch > p.batch
    db = q.batch - p.batch
    dw = q.weights - p.weights
    best = UNBOUNDED
    for name, lp in p.per_node.items():
        lq = q.per_node.get(name)
        if lq is None:  # a node at one batch only: it cannot tighten the bound
            continue
        a, slope = p.weights + lp, dw + lq - lp  # need(b) = a + (b - p.batch) * slope / db
        if slope <= 0:
            if min(a, q.weights + lq) > cap:
                return 0
            continue
        best = min(best, p.batch + (cap - a) * db // slope)
    if p.total > cap and best >= p.batch:  # the batch-free part alone overflows
        best = p.batch - 1
    return max(best, 0)


class TooBig(NoFit):
    """The model cannot fit at this batch by the lower bound: refused before any planning."""

    def __init__(self, message: str, need: Need, cap: int, max_batch: int | None):
        super().__init__(message)
        self.need, self.cap, self.max_batch = need, cap, max_batch


def chip_capacity(chip) -> int:
    return int(chip.tiles) * int(chip.sram_bytes_per_tile)


def refusal(need: Need, cap: int, what: str, max_batch: int | None, memory: str, samples: bool = False) -> TooBig:
    """The one-line answer for a need over `cap`: what (e.g. "vit-base at batch 8") needs, where, and the largest
    batch the bound allows."""
    if max_batch is None:
        hint = ""
    elif max_batch == 0:
        hint = "; even batch 1 is over it (use a smaller precision or a chip with more memory)"
    elif samples:
        hint = f"; by this bound give at most {max_batch:,} samples"
    else:
        hint = (f"; by this bound no batch above {max_batch} can fit (--batch auto searches up to it for the "
                "largest that does)")
    msg = (f"{what} needs at least {_bytes(need.total)} ({_bytes(need.weights)} of weights and "
           f"{_bytes(need.live)} of values live together at {need.where!r}), more than {memory} "
           f"({_bytes(cap)}){hint}")
    return TooBig(msg, need, cap, max_batch)

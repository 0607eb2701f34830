"""Weights streamed from host memory: which layers, the double buffer they take turns in, and when each arrives.

A model whose weights do not fit on the chip can keep the weights of a run of identical layers (ir/layers.py) in host
memory and stream each layer's in over the host link on every forward. Only layers that share code (plan/layers.py:
every layer's weights spread over all tiles the same way) are streamed, so that one layer's weights can take the
place of another's byte for byte:

- the last k layers of each run of at least three are streamed (k is the planner's choice: pipeline.plan_graph
  streams the fewest that make the plan fit, since every streamed byte costs host-link time);
- streamed layers take turns in two slots: the first two streamed layers get weight addresses of their own, and
  every later one the addresses of the layer two before it (`alias`), so the chip holds two streamed layers' weights
  and not k;
- layer j's weights arrive before the compute of the first step of layer j - 1 (or of layer j when it is the run's
  first): by then layer j - 2, whose slot it takes, has read its weights for the last time, and layer j's weights are
  in place one whole layer before it needs them (double buffering). The liveness proves the first point on every
  plan: a streamed buffer must be dead before the buffer that takes its addresses arrives, else nothing is streamed.

The Program holds each streamed block as a ConstImage with the step it arrives at (program.py); the simulator writes
it there and, in check mode, forgets a streamed buffer's bytes once its last reader has run, so a block that never
arrives is read as unwritten. The host link carries the streamed bytes on every forward, in series with the compute:
with no tiles set aside for I/O (tremula plans every tile for compute), tiles receive host data only in exchange
phases, as they receive the inputs (compiler.CompileResult.throughput_cycles). Poplar's overlapped I/O, where I/O
tiles receive the next layer's weights while the others compute, is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tremula.ir.layers import LayerKey

I64 = np.int64
MIN_RUN = 3  # layers: streaming two layers into two slots saves nothing


@dataclass
class Streaming:
    """Which weight buffers are streamed: arrive[b] is the step before whose compute buffer b's stream arrives (-1:
    resident), alias[b] the buffer whose addresses it takes (-1: addresses of its own)."""

    layers: list[LayerKey]
    arrive: np.ndarray  # int64 [n_bufs]
    alias: np.ndarray  # int64 [n_bufs]

    @property
    def any(self) -> bool:
        return bool((self.arrive >= 0).any())


def streamable_runs(state) -> dict[str, list[int]]:
    """run -> its layer indices (ascending), for runs of at least MIN_RUN layers that hold weights of their own."""
    runs: dict[str, set[int]] = {}
    for run, j in getattr(state, "weight_layer", {}).values():
        runs.setdefault(run, set()).add(j)
    return {r: sorted(js) for r, js in runs.items() if len(js) >= MIN_RUN}


def trailing_layers(state, k: int) -> list[LayerKey]:
    """The last k layers of every streamable run (all of them when k is larger than the run, none when k is 0)."""
    return [(r, j) for r, js in streamable_runs(state).items() for j in js[-k:]] if k else []


def layer_first_steps(state) -> dict[LayerKey, int]:
    """The first step of each layer: the first step holding one of its vertex groups or transfers."""
    first: dict[LayerKey, int] = {}
    for k, s in enumerate(state.steps):
        for o in (*s.group_owners, *s.owners):
            key = state.layers.get(o)
            if key is not None and key not in first:
                first[key] = k
    return first


def plan_streaming(state, layers: list[LayerKey]) -> Streaming | str:
    """The Streaming of `layers`, or why it cannot be done (the liveness checks the rest: finalize.liveness)."""
    n = len(state.bufs)
    arrive, alias = np.full(n, -1, I64), np.full(n, -1, I64)
    want = set(layers)
    if not want:
        return Streaming([], arrive, alias)
    by_layer: dict[LayerKey, list[int]] = {}
    for b, key in sorted(state.weight_layer.items()):
        by_layer.setdefault(key, []).append(b)
    first = layer_first_steps(state)
    for key in sorted(want):
        run, j = key
        if key not in by_layer or key not in first:
            return f"layer {j} of {run} has no weights or no steps"
        prev = (run, j - 1) if (run, j - 1) in first else key
        arrive[by_layer[key]] = first[prev]
        two = (run, j - 2)
        if two in want:
            mine, theirs = by_layer[key], by_layer.get(two, [])
            if len(mine) != len(theirs):
                return f"layer {j} of {run} has other weight buffers than layer {j - 2}"
            for b, a in zip(mine, theirs):
                sb, sa = state.bufs[b], state.bufs[a]
                if not (np.array_equal(sb.tiles, sa.tiles) and np.array_equal(sb.sizes, sa.sizes)):
                    return f"layer {j} of {run} stores its weights unlike layer {j - 2}"
            alias[mine] = theirs
    return Streaming(sorted(want), arrive, alias)

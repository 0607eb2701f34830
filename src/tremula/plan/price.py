"""A plan's cycles and host bytes from its lowering state, priced as its Program will be, without making the Program.

A batch search prices every plan that fits but compiles one of them: making the Program (resolving every address,
widening every table) took longer than pricing it (BERT-base fp16 at batch 140: 6.0 s against 1.5 s). The price
reads no address: target/step_cost.price_step charges a step's vertices by codelet, parameters and shapes, a shared
layer's call by the fields it rewrites and the tiles whose weight base it sets, and the exchange by bytes per tile.
to_program keeps every step of the state, and a Call gives back exactly its own step's groups and transfers
(finalize._calls checks it), so each state step is priced here through the same function, seen as a Program step.
The compile that makes the Program of the plan chosen checks the two prices equal (compiler.py).
"""

from __future__ import annotations

from tremula.plan.exchange import SymTransfers
from tremula.plan.layout import blocks
from tremula.target.step_cost import step_cycles


class _StateStep:
    """A lowering-state step with the fields target/step_cost reads of a Program step."""

    def __init__(self, step, k: int, sharing):
        self.compute = step.groups
        self.exchange = SymTransfers.concat(step.transfers)
        on = sharing is not None and k in sharing.calls
        self.call = k if on else None
        self._words = sharing.call_words[k] if on else None
        self._base = sharing.call_base[k] if on else None

    def patch_words(self, tiles: int):
        return self._words

    def base_tiles(self, tiles: int):
        return self._base


def state_cycles(state, chip) -> tuple[int, int, int] | None:
    """(compute, exchange, sync) cycles of one forward, as pipeline.priced_program charges the Program; None when
    weights stream from host memory (their bytes are counted from the Program's constants)."""
    if getattr(state, "streaming", None) is not None:
        return None
    comp = exch = sync = 0
    for c, e, y in _step_prices(state, chip):
        comp, exch, sync = comp + c, exch + e, sync + y
    return comp, exch, sync


def node_cycles(state, chip) -> dict[str, int]:
    """Cycles of one forward by the node whose compute opens each step (steps that only exchange are left out),
    as the profile attributes them (report/profile.py)."""
    out: dict[str, int] = {}
    for s, price in zip(state.steps, _step_prices(state, chip)):
        if s.origin is not None:
            out[s.origin.node] = out.get(s.origin.node, 0) + sum(price)
    return out


def _step_prices(state, chip) -> list[tuple[int, int, int]]:
    """Each step's (compute, exchange, sync) cycles, kept on the state for the sharing and chip they were priced
    with: a compile prices the plan it keeps several times (the growth, the roles of the op growth, the compile)."""
    sharing = getattr(state, "sharing", None)
    kept = getattr(state, "_step_prices", None)
    if kept is not None and kept[0] is sharing and kept[1] is chip:
        return kept[2]
    memo: dict = {}
    prices = [step_cycles(chip, _StateStep(s, k, sharing), memo) for k, s in enumerate(state.steps)]
    state._step_prices = (sharing, chip, prices)
    return prices


def host_bytes(state) -> tuple[int, int]:
    """(bytes in, bytes out) of the host streams, as program.host_stream_bytes counts the Program's: each block of
    an input or output layout once."""

    def total(streams) -> int:
        n = 0
        for s in streams:
            _, _, r0, r1, c0, c1 = blocks(s.layout)
            ok = (r1 > r0) & (c1 > c0)
            n += int(((r1 - r0) * (c1 - c0))[ok].sum()) * s.layout.itemsize
        return n

    return total(state.host_in), total(state.host_out)

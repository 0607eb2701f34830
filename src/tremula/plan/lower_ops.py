"""Lower each Graph node onto the tiles: the driver walks the graph in order and hands each node to its op's
lowering rule (RULES: one row per op family, or per op that has a rule of its own), which chooses its layout and
strategy, emits the exchanges that bring its operands and the compute sets of its codelets, all through the lowering
context (plan/context.py). The result is a LoweringState with symbolic addresses (see plan/state.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tremula.errors import TremulaError
from tremula.ir.graph import Graph, Node
from tremula.ir.ops import OPS
from tremula.plan.context import LoweringContext
from tremula.plan.layout import view2d
from tremula.plan.lower_attention import lower_attention
from tremula.plan.lower_elementwise import lower_elementwise
from tremula.plan.lower_gather import lower_gather
from tremula.plan.lower_linear import lower_linear
from tremula.plan.lower_matmul import lower_matmul
from tremula.plan.lower_move import lower_move
from tremula.plan.lower_rows import lower_rows
from tremula.plan.state import LoweringState, SymStream
from tremula.target.overheads import exchange_code_bytes

Rule = Callable[[LoweringContext, Node], None]

# The rule of each op family of ir/ops.py's LOWERINGS, and of each op whose row says it has one of its own ("own"):
# a rule is a function of (context, node) that leaves the node's outputs in context.layouts.
RULES: dict[str, Rule] = {
    "elementwise": lower_elementwise,
    "move": lower_move,
    "rows": lower_rows,
    "Gather": lower_gather,
    "Linear": lower_linear,
    "LinearFp8": lower_linear,
    "MatMul": lower_matmul,
    "Attention": lower_attention,
}


def rule_of(op: str) -> Rule:
    """The lowering rule of `op`, from its row in ir/ops.py."""
    family = OPS[op].lower
    return RULES[op if family == "own" else family]


class CodeOverflow(TremulaError):
    """A lowering stopped early (Lowerer's code_limit): the exchange code of the steps it had made already overflowed
    a tile's code region, which the rest of the graph's steps can only add to (every step keeps its own code when
    layers do not share it), so the plan cannot fit."""

    def __init__(self, tile: int, nbytes: int, limit: int, node: int, nodes: int):
        super().__init__(f"exchange code of {nbytes:,} B on tile {tile} after {node} of {nodes} nodes, over the "
                         f"{limit:,} B code region")
        self.tile, self.nbytes, self.limit, self.node = tile, nbytes, limit, node


def supported(graph: Graph) -> list[str]:
    """Ops in the graph this planner cannot place (each op once)."""
    bad = []
    for n in graph.nodes:
        if not (n.op in OPS and OPS[n.op].lower) and n.op not in bad:
            bad.append(n.op)
    return bad


class Lowerer(LoweringContext):
    """The lowering of one graph: its context, walked node by node (lower)."""

    def lower(self) -> LoweringState:
        g = self.graph
        bad = supported(g)
        if bad:
            raise TremulaError(f"the planner cannot place op(s) {', '.join(bad)}; run the passes first or file an "
                               f"issue")
        for name in g.inputs:
            t = self.types[name]
            rows, cols = view2d(t.shape)
            lay = self.row_layout(name, rows, cols, t.dtype)
            self.layouts[name] = lay
            self.host_in.append(SymStream(name, lay))
        for i, node in enumerate(g.nodes):
            if self.progress:
                self.progress("plan", i, len(g.nodes))
            if node.outputs[0] in self.head_skip:  # a head split or merge attention reads or writes in place
                continue
            self.owner, self.op = node.name or node.outputs[0], node.op
            if self.share_layers and self._enter(self.owner):
                continue  # its layer is a copy of its run's first (plan/replay.py)
            self.temp_fraction = self.fraction(node)  # what the node's strategies read
            rule_of(node.op)(self, node)
            self.temp_fraction = self.plan_fraction
            if self.code_limit is not None:
                self._check_code(i + 1)
        if self.share_layers:
            self._enter("")  # end the last run of layers
        for o in g.outputs:
            self.host_out.append(SymStream(o, self.layout_of(o)))
        if self.code_limit is not None:  # the last step's code too: what the memory plan reserves, counted once
            self._check_code(len(g.nodes), len(self.steps))
            self.exchange_code = self._excode
        return self

    def _check_code(self, done: int, closed: int | None = None) -> None:
        """Add the exchange code of the steps closed since the last call (all but the last step, which may still
        take transfers, unless `closed` says how many are), as the memory plan reserves it
        (target/overheads.exchange_code_bytes); raise CodeOverflow when a tile's total is over code_limit."""
        closed = len(self.steps) - 1 if closed is None else closed
        if closed <= self._code_seen:
            return
        self._excode += exchange_code_bytes(self.T, self.steps[self._code_seen:closed], self.chip)
        self._code_seen = closed
        t = int(np.argmax(self._excode))
        if self._excode[t] > self.code_limit:
            raise CodeOverflow(t, int(self._excode[t]), self.code_limit, done, len(self.graph.nodes))

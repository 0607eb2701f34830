"""The Plan: what planning a graph makes, as one value (pipeline.plan_graph's result; issue #14, "the Plan as a
value"): the graph as planned, its lowering, its memory plan, the liveness that memory plan was made from, and the
bytes code, vertex state and exchange code reserve on each tile. A Program is made from it (finalize.to_program)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tremula.ir.graph import Graph
from tremula.plan.finalize import Liveness
from tremula.plan.memory import MemoryPlan
from tremula.plan.state import LoweringState


@dataclass
class Plan:
    graph: Graph  # as planned: in the plan's precision, each layer's vectors its own (pipeline._planned_graph)
    state: LoweringState  # the lowering: layouts, strategies, steps over symbolic addresses (plan/lower_ops.py)
    memory: MemoryPlan
    liveness: Liveness
    reserved: dict[str, np.ndarray]  # "code", "vertex_state", "exchange_code": bytes per tile

    @property
    def fits(self) -> bool:
        return self.memory.fits

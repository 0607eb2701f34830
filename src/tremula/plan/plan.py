"""The Plan: what planning a graph makes, as one value (pipeline.plan_graph's result; issue #14, "the Plan as a
value"): the graph as planned, its lowering, its memory plan, the liveness that memory plan was made from, and the
bytes code, vertex state and exchange code reserve on each tile. A Program is made from it (finalize.to_program).
Its Recipe is the few choices it was lowered with, from which it is made again (pipeline.from_recipe)."""

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


@dataclass(frozen=True)
class Recipe:
    """The choices a plan was lowered with (pipeline.plan_graph's): lowered again from them, the lowering is the
    same and so is the plan. A few values where a plan is gigabytes: a plan made in another process comes back as
    this (batch_search's growths beside the search)."""

    budget: tuple[float, float | None, bool, str]  # operand fraction, permanent fraction, shared layers, thrift
    level_weights: bool  # shared layers' storage levelled (plan/layers.spread_caps)
    op_scale: tuple[tuple[str, float], ...]  # roles' own operand budgets (pipeline._grown_ops)
    both_orders: bool  # how its memory plan packed the buffers (finalize.memory_plan)


def recipe_of(state: LoweringState) -> Recipe | None:
    """The Recipe of a lowering (with its memory plan made), or None when its weights stream: which layers stream
    was chosen from its bytes, not from the choices here."""
    if getattr(state, "streaming", None) is not None:
        return None
    return Recipe((state.plan_fraction, state.perm_fraction, state.share_layers, state.thrift), state.level_weights,
                  tuple(dict(state.op_scale).items()), state.both_orders)

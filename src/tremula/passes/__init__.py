"""Graph passes: constant folding, dead-code elimination and the fusions a tile machine cares about."""

from __future__ import annotations

from tremula.errors import TremulaError
from tremula.ir.graph import Graph
from tremula.ir.interp import infer_types
from tremula.ir.ops import rule
from tremula.passes.dce import eliminate_dead_code
from tremula.passes.fold import fold_constants
from tremula.passes.fuse_attention import fuse_attention
from tremula.passes.fuse_gelu import fuse_gelu
from tremula.passes.fuse_heads import fuse_heads
from tremula.passes.fuse_layernorm import fuse_layernorm
from tremula.passes.fuse_linear import fuse_linear
from tremula.passes.fuse_patchify import fuse_patchify
from tremula.passes.fuse_qkv import fuse_qkv

# Order: folding first removes the Identity/Cast/shape-arithmetic noise that would hide patterns. Patchify runs
# before Linear because it makes its own Linear from the Conv weight. Each other fusion claims nodes the others never
# take (a GELU's x and a LayerNorm's input are read, not claimed, so the Linear that makes them still fuses), and
# Linear comes last so that no constant-operand MatMul of another pattern is taken first. A final fold merges the
# transposes that peeling attention's kᵀ leaves back to back, and DCE drops the old interiors' constants. Projections
# of one input are fused last, once every Linear exists; then attention's head split and merge are put in the form the
# planner reads, which needs the Linears (and their Splits) made.
FUSIONS = (fuse_patchify, fuse_layernorm, fuse_gelu, fuse_attention, fuse_linear, fuse_qkv, fuse_heads)


def canonicalize(graph: Graph) -> Graph:
    """The full pipeline: fold, clean, fuse, fold again, clean; returns a new, type-checked graph.

    Raises TremulaError if shape arithmetic is left that depends on run-time values (the chip cannot run it).
    """
    g = eliminate_dead_code(fold_constants(graph))
    for fuse in FUSIONS:
        g = fuse(g)
    g = eliminate_dead_code(fold_constants(g))
    left = sorted({n.op for n in g.nodes if rule(n.op).host_only})
    if left:
        raise TremulaError(f"shape arithmetic ({', '.join(left)}) depends on run-time input values; "
                           "export the model with static shapes and constant sizes")
    return infer_types(g)


__all__ = [
    "canonicalize",
    "eliminate_dead_code",
    "fold_constants",
    "fuse_attention",
    "fuse_gelu",
    "fuse_heads",
    "fuse_layernorm",
    "fuse_linear",
    "fuse_patchify",
    "fuse_qkv",
]

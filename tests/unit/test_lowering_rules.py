"""The lowering's rule table (plan/lower_ops.RULES) and its rules' contract: every op the planner places has one rule,
and a rule reads and writes only what the lowering context (plan/context.py) makes when it is built, so rules keep no
state of their own between nodes."""

import ast
import inspect

import pytest

from tremula.ir.ops import LOWERINGS, OPS
from tremula.frontends import load_model
from tremula.pipeline import canonical
from tremula.plan import (
    lower_attention,
    lower_elementwise,
    lower_gather,
    lower_linear,
    lower_matmul,
    lower_move,
    lower_rows,
)
from tremula.plan.lower_ops import RULES, Lowerer, rule_of, supported
from tremula.target.chip import load_chip

RULE_MODULES = (lower_elementwise, lower_rows, lower_move, lower_gather, lower_linear, lower_matmul, lower_attention)


def test_every_op_the_planner_places_has_its_rule():
    for name, d in OPS.items():
        if d.lower:
            assert callable(rule_of(name)), name
    # each row of the table is a family of ir/ops.py or an op whose row says it has a rule of its own: no stale rows
    owns = {name for name, d in OPS.items() if d.lower == "own"}
    assert set(RULES) == (set(LOWERINGS) - {"own", ""}) | owns


def test_a_family_takes_its_rule_from_the_ops_row():
    assert rule_of("Identity") is lower_move.lower_move  # (an element-wise op whose row plans it as a move)
    assert rule_of("Add") is lower_elementwise.lower_elementwise
    assert rule_of("Softmax") is lower_rows.lower_rows
    assert rule_of("LinearFp8") is rule_of("Linear") is lower_linear.lower_linear
    assert rule_of("MatMul") is lower_matmul.lower_matmul  # (a Linear when its right operand is a 2-D constant)


def test_ops_without_a_lowering_are_refused():
    class G:
        nodes = [type("N", (), {"op": op})() for op in ("Conv", "Add", "Conv", "Shape")]

    assert supported(G()) == ["Conv", "Shape"]
    with pytest.raises(KeyError):
        rule_of("Conv")


def _context_uses(module) -> tuple[set[str], set[str]]:
    """(attributes read, attributes written) on a rule's context (the parameter `cx`) in `module`."""
    reads, writes = set(), set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "cx":
            (writes if isinstance(node.ctx, ast.Store) else reads).add(node.attr)
    return reads, writes


@pytest.mark.parametrize("module", RULE_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_a_rule_touches_only_what_the_context_makes(module):
    cx = Lowerer(canonical(load_model("bert-tiny", batch=2)), load_chip("c600"))  # built, not yet lowered
    made = set(vars(cx)) | {a for a in dir(type(cx)) if not a.startswith("__")}
    reads, writes = _context_uses(module)
    assert reads, "the rules of the module name their context cx"
    assert not (reads | writes) - made, "read or written on the context but not made by it"
    assert not {a for a in reads | writes if a.startswith("_")}, "a rule uses the context's own internals"
    assert writes <= set(vars(cx)), "a rule writes only the context's state, never its methods"

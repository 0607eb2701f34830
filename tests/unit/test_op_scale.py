"""Lowerer(op_scale=...): one role of a run's layers (ir/layers.layer_roles) planned at its own operand budget, in
every layer of the run, while the ops before it keep the plan-wide one (pipeline._grown_ops tries such budgets)."""

from tremula.frontends import load_model
from tremula.ir.layers import layer_roles
from tremula.pipeline import canonical, lower_precision
from tremula.plan.layers import untie_layer_vectors
from tremula.plan.lower_ops import Lowerer
from tremula.target.chip import load_chip


def test_a_roles_budget_changes_that_op_in_every_layer_and_not_the_ops_before_it():
    chip = load_chip("examples/chips/tiny16.toml")
    g = untie_layer_vectors(lower_precision(canonical(load_model("bert-tiny", batch=2)), "float16", chip, None,
                                            "half"))
    roles = layer_roles(g)
    fc1 = next(r for r in set(roles.values()) if r.endswith("intermediate.dense"))
    plain = Lowerer(g, chip, temp_fraction=0.002).lower().strategies
    scaled = Lowerer(g, chip, temp_fraction=0.002, op_scale={fc1: 100.0}).lower().strategies
    mine = [k for k in plain if roles.get(k) == fc1]
    assert len(mine) == 2  # bert-tiny's two layers
    assert all(scaled[k] != plain[k] and scaled[k] == scaled[mine[0]] for k in mine)
    assert "serial=1 " in scaled[mine[0]] and "serial=16" in plain[mine[0]]  # one round where it had 16
    # the attention half of each layer comes before fc1 and keeps its plan
    before = [k for k in plain if "attention" in k]
    assert before and all(scaled[k] == plain[k] for k in before)

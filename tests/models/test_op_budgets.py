"""A plan whose ops take budgets of their own (pipeline._grown_ops, Lowerer op_scale) still computes what the model
does: one role of vit-tiny's layers is forced onto a quarter of the plan-wide operand budget on a chip where that
budget binds, and the Program must check against the reference."""

from pathlib import Path

from tremula import pipeline
from tremula.check import check_model
from tremula.compiler import compile_model
from tremula.ir.layers import layer_roles
from tremula.plan.plan import Plan
from tremula.target.chip import load_chip

TINY16 = Path(__file__).resolve().parents[2] / "examples" / "chips" / "tiny16.toml"


def test_a_role_planned_on_its_own_budget_checks(tmp_path, monkeypatch):
    path = tmp_path / "tiny16-80k.toml"  # tiny16 with 80 KiB tiles: vit-tiny at batch 8 fits near full
    path.write_text(TINY16.read_text().replace("sram_bytes_per_tile = 65536", "sram_bytes_per_tile = 81920"))
    chip = load_chip(str(path))
    plain = compile_model("vit-tiny", chip, 8, "fp32")
    forced_roles = []

    def forced(lower, chip, plan, roles, steps, unchanged_at):  # the growth: one role at a quarter of the budget
        role = next(r for r in roles if r.endswith("layer.0.output.dense"))  # fc2
        forced_roles.append(role)
        state = lower({role: 0.25})
        grown = Plan(plan.graph, state, *pipeline.memory_plan(state, chip, both_orders=True))
        assert grown.fits
        return grown

    monkeypatch.setattr(pipeline, "_grown_ops", forced)
    res = compile_model("vit-tiny", chip, 8, "fp32")
    role = layer_roles(res.graph)
    mine = [k for k in res.strategies if forced_roles and role.get(k) == forced_roles[0]]
    assert len(mine) == 2  # vit-tiny's two layers
    assert all(res.strategies[k] != plain.strategies[k] for k in mine)
    others = [k for k in res.strategies if ".attention." in k]  # before it in each layer: unchanged
    assert others and all(res.strategies[k] == plain.strategies[k] for k in others)
    chk = check_model("vit-tiny", chip, 8, "fp32")
    assert chk.passed, chk.outputs

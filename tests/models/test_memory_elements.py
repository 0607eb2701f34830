"""Every matmul vertex of a compiled Program reads its left operand from other memory elements than it writes its
output to (plan/elements.py), in the default plan and in each plan the planner makes under pressure."""

import copy

import pytest
from test_mutations import PLAN_KINDS, _force, _is_kind

from tremula import compiler
from tremula.plan.elements import APART, conflicts
from tremula.target.chip import load_chip


def _matmul_vertices(program) -> int:
    return sum(len(g) for s in program.steps for g in s.compute if g.codelet in APART)


@pytest.mark.parametrize("model,dtype", [("bert-tiny", "fp16"), ("vit-tiny", "fp8"), ("gpt2-tiny", "fp32")])
def test_default_plans_keep_left_operand_and_output_apart(model, dtype):
    res = compiler.compile_model(model, "c600", 2, dtype)
    assert _matmul_vertices(res.program) > 0
    assert conflicts(res.program, load_chip("c600")) == 0


@pytest.mark.parametrize("kind,dtype", PLAN_KINDS)
def test_plans_under_pressure_keep_them_apart(monkeypatch, kind, dtype):
    chip, batch = _force(monkeypatch, kind, dtype)
    res = compiler.compile_model("bert-tiny" if kind != "attention in rounds" else "vit-tiny", chip, batch, dtype)
    assert _is_kind(res, kind)
    assert conflicts(res.program, load_chip(chip)) == 0


def test_an_output_moved_into_its_left_operands_element_is_counted():
    chip = load_chip("c600")
    p = copy.deepcopy(compiler.compile_model("bert-tiny", chip, 2, "fp16").program)
    g = next(g for s in p.steps for g in s.compute if g.codelet in APART)
    g.addrs[0, -1] = g.addrs[0, 0] + 1  # one vertex's output now starts inside its left operand's element
    assert conflicts(p, chip) == 1
    g.addrs[:, -1] = g.addrs[:, 0]
    assert conflicts(p, chip) == len(g)

"""A plan priced from its lowering state (plan/price.py) costs what its Program costs: every cycle and host byte."""

import pytest

from tremula.frontends import load_model
from tremula.pipeline import host_cycles, plan_graph, priced_program
from tremula.plan.price import host_bytes, state_cycles
from tremula.target.chip import load_chip

TINY16 = "examples/chips/tiny16.toml"


@pytest.mark.parametrize("model,batch,dtype,chip,shared", [
    ("bert-tiny", 4, "float16", "c600", False),
    ("bert-tiny", 4, "float16", "c600", True),  # shared layers: Calls with patched fields and weight bases
    ("siglip-tiny", 2, "fp8", "c600", True),
    ("vit-tiny", 8, "float16", TINY16, False),  # serial splits
    ("gpt2-tiny", 2, "float32", TINY16, True),
])
def test_the_state_prices_as_its_program(model, batch, dtype, chip, shared):
    chip = load_chip(chip)
    scales = None
    if dtype == "fp8":
        from tremula.batch_search import placeholder_scales

        scales = placeholder_scales(load_model(model))
    plan = plan_graph(load_model(model, batch), chip, dtype, scales=scales, shared_only=shared, partials="half",
                      weights="resident")
    state = plan.state
    assert bool(getattr(state, "sharing", None) and state.sharing.calls) == shared
    program, comp, exch, sync = priced_program(plan, chip, dtype, batch)
    assert state_cycles(state, chip) == (comp, exch, sync)
    b_in, b_out, _, _ = host_cycles(program, chip)
    assert host_bytes(state) == (b_in, b_out)

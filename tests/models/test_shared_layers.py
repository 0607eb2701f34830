"""Layers that run one template layer's code: the simulated answer is still the reference's, the code is counted
once, and sharing is refused where the layers' programs differ."""

import numpy as np
import pytest

from tremula import compiler, pipeline
from tremula.check import check_model
from tremula.frontends.zoo import _vision
from tremula.models.build import build_from_config
from tremula.models.configs import BertConfig
from tremula.models.weights import LazyWeights
from tremula.plan.finalize import memory_plan
from tremula.plan.lower_ops import Lowerer
from tremula.plan.share import check_weight_strides, find_sharing
from tremula.target.chip import load_chip

SHARED = ((0.12, None, True),)
UNSHARED = ((0.12, None, False),)


def siglip4(batch: int):
    """A SigLIP-shaped encoder with 4 layers (the zoo's tiny models have 2)."""
    return build_from_config("siglip", _vision("siglip", 32, 4, 4, 48, 32, 8, 1e-6, "gelu_tanh"), LazyWeights(),
                             batch=batch, name="siglip-tiny4")


def bert4(batch: int):
    """A BERT-shaped encoder with 4 layers: every layer also reads the attention mask."""
    return build_from_config("bert", BertConfig(100, 32, 4, 2, 64, 64, 16), LazyWeights(), batch=batch,
                             name="bert-tiny4")


@pytest.mark.parametrize("model,dtype,budget", [(siglip4, "fp8", (0.12, 0.4, True)), (siglip4, "fp16", SHARED[0]),
                                                (bert4, "fp16", SHARED[0]), ("vit-tiny", "fp8", SHARED[0])])
def test_shared_layers_answer_as_the_reference(monkeypatch, model, dtype, budget):
    monkeypatch.setattr(pipeline, "PLAN_BUDGETS", (budget,))
    res = check_model(model, "c600", 2, dtype)
    assert res.passed, res.outputs
    layers = 2 if model == "vit-tiny" else 4
    assert res.compile.shared_layers == layers - 1
    # the shared layers' steps are recorded in the Program, and their code is not counted again
    prog = res.compile.program
    assert len(prog.shared_steps) > 0
    if layers > 2:  # with 2 layers, streaming the weights can cost more exchange code than sharing saves
        monkeypatch.setattr(pipeline, "PLAN_BUDGETS", ((budget[0], budget[1], False),))
        plain = compiler.compile_model(model, "c600", 2, dtype).program
        for cat in ("vertex_state", "exchange_code"):
            assert prog.reserved_split[cat].sum() < plain.reserved_split[cat].sum()


def _lowered(chip="c600"):
    chip = load_chip(chip)
    g = pipeline.lower_precision(siglip4(2), "float16", chip, None)
    return Lowerer(g, chip, None, share_layers=True).lower(), chip


def test_a_layer_whose_transfers_differ_is_not_shared():
    state, chip = _lowered()
    assert find_sharing(state).shared_layers == 3
    # move one destination offset of one transfer table of layer 2: it no longer runs layer 0's exchange code
    for s in state.steps:
        for t, owner in zip(s.transfers, s.owners):
            if owner.startswith("encoder.layers.2.") and len(t.d_rel):
                t.d_rel = t.d_rel.copy()
                t.d_rel[0] += 8
                break
        else:
            continue
        break
    sh = find_sharing(state)
    assert sh.shared_layers < 3
    assert not any(k for k, _ in sh.replica_tables if any(o.startswith("encoder.layers.2.")
                                                          for o in state.steps[k].owners))


def test_shared_weights_sit_one_distance_per_tile_from_their_templates():
    state, chip = _lowered("examples/chips/tiny16.toml")  # 16 tiles: several weights of a layer on one tile
    mp, _, _ = memory_plan(state, chip)
    sh = state.sharing
    assert sh is not None and sh.shared_layers == 3
    assert check_weight_strides(sh, mp) == ""
    # classes of corresponding buffers share one offset; that is what lets the template's vertex state serve them
    for run in sh.runs:
        for c in np.unique(run.cls):
            assert len(np.unique(mp.offset[run.members[run.cls == c]])) == 1
    # one of two weights of a layer moved by 8 bytes on a tile breaks the rule, and the check says so
    rep, _ = sh.weight_pairs[0]
    on = mp.weight_addr[mp.weight_row[rep]] >= 0  # [weights of the layer, tiles]
    tile = int(np.flatnonzero(on.sum(axis=0) >= 2)[0])
    row = mp.weight_row[rep[np.flatnonzero(on[:, tile])[0]]]
    mp.weight_addr[row, tile] += 8
    assert check_weight_strides(sh, mp)


def test_unshared_plans_are_unchanged_by_the_layer_machinery(monkeypatch):
    """Without share_layers nothing is shared and no step is marked."""
    monkeypatch.setattr(pipeline, "PLAN_BUDGETS", UNSHARED)
    res = compiler.compile_model(siglip4, "c600", 2, "fp16")
    assert res.shared_layers == 0 and len(res.program.shared_steps) == 0


def _budgets_tried(monkeypatch) -> list[tuple]:
    """The (operand fraction, permanent fraction, shared) of every lowering the planner makes, in order (a budget
    planned again with lean K rounds, pipeline.plan_graph, is a lowering of the same budget)."""
    tried = []

    class Counting(Lowerer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            tried.append((self.temp_fraction, self.perm_fraction, self.share_layers))

    monkeypatch.setattr(pipeline, "Lowerer", Counting)
    return tried


def test_budgets_stop_after_the_shared_plan(monkeypatch, tmp_path):
    """With repeated layers, the planner tries the two fastest unshared budgets, then the shared ones, and no tighter
    budget after them (they change little once layers share, and cost host memory); the reported plan is the one with
    the lowest peak."""
    text = open("examples/chips/tiny16.toml").read().replace("sram_bytes_per_tile = 65536",
                                                             "sram_bytes_per_tile = 49152")
    chip = tmp_path / "tiny16-48k.toml"
    chip.write_text(text)
    tried = _budgets_tried(monkeypatch)
    res = compiler.compile_model(siglip4, str(chip), 8, "fp16", require_fit=False)
    assert not res.fits
    # (FREE is the fixed 0.12 on this chip, so each FREE budget equals the fixed one after it and is tried once, and
    # again with lean K rounds when the plan took any)
    budgets = list(dict.fromkeys(tried))
    assert budgets == [(0.12, None, False), (0.12, 0.4, False), (0.12, 0.4, True)]
    assert all(tried.count(b) <= 3 for b in budgets)  # free, lean and the best one lowered again at most


def test_shared_layers_are_tried_first_with_the_free_operand_budget(monkeypatch):
    """tiny16 at batch 8 fits no unshared plan; the first shared plan tried has the operand budget of what the tiles
    have left (FREE, above the fixed 0.12 here), as the first unshared one has, and the permanent budget."""
    tried = _budgets_tried(monkeypatch)
    compiler.compile_model(siglip4, "examples/chips/tiny16.toml", 8, "fp16", require_fit=False)
    free = tried[0][0]
    assert free > 0.12 and tried[0] == (free, None, False)
    assert [t for t in tried if t[2]][0] == (free, 0.4, True)


def test_the_profile_counts_shared_code_once(monkeypatch):
    """The report's memory per tile is what the memory plan counted (shared code once), and its comparison of
    exchange code leaves out the steps that run a template's code, on both sides."""
    from tremula.report import build_profile
    from tremula.timing import schedule_exchange
    from tremula.timing.program_schedule import schedule_program

    monkeypatch.setattr(pipeline, "PLAN_BUDGETS", SHARED)
    chip = load_chip("c600")
    res = compiler.compile_model(siglip4, chip, 2, "fp16")
    prog = res.program
    assert res.shared_layers == 3
    prof = build_profile(res, chip, exchanges=schedule_program(prog, chip))
    for cat in ("vertex_state", "exchange_code"):
        assert prof.tile_memory[cat] == prog.reserved_split[cat].tolist()
    shared = set(prog.shared_steps.tolist())
    expect = sum(schedule_exchange(s.exchange, chip).exchange_code_bytes(chip)
                 for k, s in enumerate(prog.steps) if len(s.exchange) and k not in shared)
    assert prof.exchange_code.timetable == expect.tolist()

"""Weights streamed from host memory (plan/stream.py): the Program holds each streamed block with the step it arrives
at, the simulator writes it there and forgets it after its last reader, so the answer is the reference's and a block
that is missing, late or early is caught; the host link is charged for every streamed byte."""

import copy
import dataclasses
import re

import numpy as np
import pytest

from tremula import pipeline
from tremula.check import check_model
from tremula.compiler import DoesNotFit, compile_model
from tremula.errors import TremulaError
from tremula.feeds import make_feeds
from tremula.frontends.zoo import _vision
from tremula.models.build import build_from_config
from tremula.models.weights import LazyWeights
from tremula.plan.finalize import StreamConflict, memory_plan
from tremula.plan.lower_ops import Lowerer
from tremula.plan.stream import Streaming, plan_streaming, trailing_layers
from tremula.program import load_program, save_program, streamed_weight_bytes
from tremula.sim.functional import SimCheckError, simulate
from tremula.target.chip import load_chip
from tremula.target.cost import host_transfer_cycles
from test_shared_layers import siglip4


@pytest.fixture(scope="module")
def streamed():
    """siglip4 at fp16 with every layer's weights streamed: the check passes and keeps what it compiled."""
    res = check_model(siglip4, "c600", 2, "fp16", weights="streamed")
    assert res.passed, res.outputs
    return res.compile


LAYER = re.compile(r"layers\.(\d+)\.")


def _by_layer(program) -> dict[int, list]:
    """layer index -> its streamed ConstImages (the zoo names a layer's constants `...layers.<j>....`)."""
    out: dict[int, list] = {}
    for c in program.consts:
        if c.step >= 0:
            out.setdefault(int(LAYER.search(c.name).group(1)), []).append(c)
    return out


def test_every_layer_streams_into_one_of_two_slots(streamed):
    p = streamed.program
    assert list(streamed.streamed_layers.values()) == [4] and streamed.shared_layers == 3
    layers = _by_layer(p)
    assert sorted(layers) == [0, 1, 2, 3]
    arrive = {j: {c.step for c in cs} for j, cs in layers.items()}
    assert all(len(a) == 1 for a in arrive.values())  # a layer arrives at one step
    a = [arrive[j].pop() for j in range(4)]
    assert a[0] == a[1] < a[2] < a[3]  # layers 0 and 1 before layer 0 runs, then each one layer ahead
    # a layer's blocks go where the layer two before it had its own; layers 0 and 1 have slots of their own
    where = {j: sorted((c.tile, c.addr, c.r1 - c.r0, c.c1 - c.c0) for c in cs) for j, cs in layers.items()}
    assert where[2] == where[0] and where[3] == where[1]
    assert {w[:2] for w in where[0]}.isdisjoint({w[:2] for w in where[1]})
    # no constant of a streamed layer is in the image loaded with the program
    assert {c.name for c in p.consts if c.step >= 0}.isdisjoint({c.name for c in p.consts if c.step < 0})


def test_streaming_holds_two_layers_of_weights_and_charges_the_host_link(streamed):
    resident = compile_model(siglip4, "c600", 2, "fp16", weights="resident")
    assert resident.streamed_bytes == 0 and not resident.streamed_layers
    p = streamed.program
    nbytes = streamed_weight_bytes(p.consts)
    assert nbytes == streamed.streamed_bytes > 0
    # every streamed constant's bytes once (one copy per block, fp16)
    names = {c.name for c in p.consts if c.step >= 0}
    assert nbytes == sum(int(np.prod(streamed.graph.types[n].shape)) * 2 for n in names)
    inputs = sum(s.nbytes for s in p.host_in)
    assert streamed.host_in_bytes == inputs + nbytes
    assert streamed.host_in_cycles == host_transfer_cycles(load_chip("c600"), inputs + nbytes)
    assert streamed.latency_cycles == streamed.host_in_cycles + streamed.cycles + streamed.host_out_cycles
    # the chip holds two of the four layers' weights: half the streamed bytes have addresses of their own
    own = {(c.tile, c.addr) for j, cs in _by_layer(p).items() for c in cs if j < 2}
    assert len(own) == len({(c.tile, c.addr) for c in p.consts if c.step >= 0})


def _run(res, program):
    feeds = make_feeds(res.graph, 0)
    return simulate(program, res.graph, feeds)


def test_a_missing_streamed_block_is_caught(streamed):
    p = copy.deepcopy(streamed.program)
    last_step = max(c.step for c in p.consts)
    drop = next(i for i, c in enumerate(p.consts) if c.step == last_step)  # the last layer's: its slot held layer 1's
    del p.consts[drop]
    with pytest.raises(SimCheckError, match="unwritten"):
        _run(streamed, p)


@pytest.mark.parametrize("when", ["late", "early"])
def test_a_streamed_layer_arriving_late_or_early_is_caught(streamed, when):
    """Late (layer 2 after its layer has run): its readers find its bytes unwritten. Early (layer 3 before layer 1,
    whose slot it takes, has run): layer 1 computes with layer 3's weights, and once layer 1 is done its slot is
    forgotten, so layer 3's readers find it unwritten too."""
    p = copy.deepcopy(streamed.program)
    layers = _by_layer(p)
    moved, to = (2, len(p.steps) - 1) if when == "late" else (3, layers[2][0].step)
    names = {c.name for c in layers[moved]}
    p.consts = [dataclasses.replace(c, step=to) if c.name in names else c for c in p.consts]
    with pytest.raises(SimCheckError, match="unwritten"):
        _run(streamed, p)


def test_streamed_program_saves_and_simulates_identically(streamed, tmp_path):
    path = tmp_path / "s.tpg"
    save_program(streamed.program, path)
    back = load_program(path)
    assert [c.step for c in back.consts] == [c.step for c in streamed.program.consts]
    a, b = _run(streamed, streamed.program), _run(streamed, back)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_a_stream_into_a_slot_still_read_is_refused():
    """The liveness proves each streamed layer's slot is free when the next one arrives: arriving at step 0 is not."""
    g = pipeline.lower_precision(siglip4(2), "float16", load_chip("c600"))
    state = Lowerer(g, load_chip("c600"), temp_fraction=0.12, share_layers=True).lower()
    ok = plan_streaming(state, trailing_layers(state, 4))
    assert isinstance(ok, Streaming) and ok.any
    memory_plan(state, load_chip("c600"), ok)  # as planned: fine
    early = Streaming(ok.layers, np.where(ok.arrive >= 0, 0, -1), ok.alias)
    with pytest.raises(StreamConflict):
        memory_plan(state, load_chip("c600"), early)


def test_streaming_needs_repeated_layers():
    with pytest.raises(TremulaError, match="no run of 3 or more identical layers"):
        compile_model("vit-tiny", "c600", 1, "fp16", weights="streamed")  # two layers: nothing to gain


def deep8(batch: int):
    """A SigLIP-shaped encoder with 8 wider layers: 8 x 98 KB of fp16 weights."""
    return build_from_config("siglip", _vision("siglip", 64, 8, 4, 256, 32, 8, 1e-6, "gelu_tanh"), LazyWeights(),
                             batch=batch, name="siglip-deep8")


def test_auto_streams_the_fewest_layers_that_fit():
    """On a chip too small for every weight, auto streams the last k layers with the smallest k that fits (the same
    lowering with one layer fewer streamed does not fit), and the check passes; resident does not fit."""
    chip = dataclasses.replace(load_chip("c600"), tiles=16, sram_bytes_per_tile=103_000)
    with pytest.raises(DoesNotFit):
        compile_model(deep8, chip, 1, "fp16", weights="resident")
    plan = pipeline.plan_graph(deep8(1), chip, "float16", partials="half")  # as compile_model
    state, mp = plan.state, plan.memory
    assert mp.fits
    k = len(state.streaming.layers)
    assert 3 <= k < 8 and state.streaming.layers == trailing_layers(state, k)
    fewer, _, _ = memory_plan(state, chip, plan_streaming(state, trailing_layers(state, k - 1)))
    assert not fewer.fits
    res = check_model(deep8, chip, 1, "fp16")
    assert res.passed, res.outputs
    assert list(res.compile.streamed_layers.values()) == [k]


def test_a_run_bound_by_the_host_link_says_so(streamed):
    from tremula.report.profile import build_profile

    chip = load_chip("c600")
    said = lambda res: [w for w in build_profile(res, chip, keep_tile_cycles=False).why if "host link takes" in w]
    assert not said(streamed)  # tiny layers: the chip's time dominates
    slow = dataclasses.replace(streamed, host_in_cycles=2 * streamed.cycles)  # as over a link a hundred times slower
    assert said(slow) and "bound by it" in said(slow)[0]


def test_batch_auto_streams_only_when_batch_1_needs_it():
    """--batch auto keeps every weight on the chip when batch 1 fits so: on a chip where batch 4 fits only by
    streaming (and runs slower than batch 2 resident), the search stops at 2; on one where batch 1 itself needs
    streaming, it streams."""
    roomy = dataclasses.replace(load_chip("c600"), tiles=16, sram_bytes_per_tile=110_000)
    assert compile_model(deep8, roomy, 4, "fp16").streamed_layers  # batch 4 alone: fits by streaming
    res = compile_model(deep8, roomy, "auto", "fp16")
    assert res.auto["largest"] == 2 and res.batch == 2 and not res.streamed_layers
    tight = dataclasses.replace(roomy, sram_bytes_per_tile=103_000)
    res = compile_model(deep8, tight, "auto", "fp16")
    assert res.fits and res.streamed_layers and res.auto["largest"] >= 1

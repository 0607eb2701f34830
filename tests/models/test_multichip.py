"""Models on several chips (multichip.py): pipelines of tiny models checked end to end through their Links, a dropped,
shortened or misrouted Link caught by the check, the fewest stages that fit chosen, replicas and the pipeline's
timing from the stages' own figures."""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path

import pytest

from tremula.check import check_system, compare
from tremula.compiler import compile_model
from tremula.errors import NoFit, TremulaError
from tremula.feeds import make_feeds
from tremula.ir.interp import run
from tremula.multichip import Link, SystemDoesNotFit, compile_system, simulate_system
from tremula.pipeline import canonical
from tremula.sim.functional import SimCheckError
from tremula.target.system import load_system

TINY16 = Path(__file__).parents[2] / "examples" / "chips" / "tiny16.toml"


@pytest.mark.parametrize("model, system, dtype, stages", [
    ("bert-tiny", "2xc600", "fp32", 2),
    ("vit-tiny", "2xc600", "fp16", 2),
    ("gpt2-tiny", "4xc600", "fp8", 3),
    ("siglip-tiny", "4xc600", "fp16", 4),
])
def test_pipelines_of_tiny_models_match_the_reference(model, system, dtype, stages):
    res = check_system(model, system, 2, dtype, stages=stages)
    assert res.passed, [(o.name, o.value) for o in res.outputs] + [(k, o.name, o.value) for k, o in res.matched]
    sysres = res.compile
    assert len(sysres.stages) == stages and len(sysres.program.links) >= stages - 1
    assert all(ln.src < ln.dst for ln in sysres.program.links)
    if dtype != "fp32":  # every stage's outputs were compared with its own matched reference
        assert {k for k, _ in res.matched} == set(range(stages))


def _run(res, feeds, links):
    program = dataclasses.replace(res.program, links=links)
    return simulate_system(program, [r.graph for r in res.stages], feeds)[0]


def test_a_dropped_or_shortened_link_is_caught():
    res = compile_system("bert-tiny", "2xc600", 2, "fp16", stages=2)
    feeds = make_feeds(canonical(res.source), 0)
    links = res.program.links
    assert len(links) == 2  # the residual stream and the attention mask
    with pytest.raises(SimCheckError, match="no link"):
        _run(res, feeds, links[1:])
    ln = links[0]
    shifted = dataclasses.replace(ln, src_offset=2, nbytes=ln.nbytes - 2)  # one half element later, one short
    with pytest.raises(SimCheckError, match="never arrived"):
        _run(res, feeds, [shifted, *links[1:]])
    with pytest.raises(SimCheckError, match="outside the value"):
        _run(res, feeds, [dataclasses.replace(ln, src_offset=2), *links[1:]])
    with pytest.raises(SimCheckError, match="two links write"):
        _run(res, feeds, [ln, dataclasses.replace(ln, nbytes=2), *links[1:]])


def test_a_misrouted_link_is_caught_by_the_outputs():
    """Two Links carry the residual stream's halves to the wrong halves: every byte arrives, once, so only the
    values can tell, and the check's comparison does."""
    res = compile_system("vit-tiny", "2xc600", 2, "fp32", stages=2)
    g = canonical(res.source)
    feeds = make_feeds(g, 0)
    ref = run(g, feeds)
    (ln,) = res.program.links
    half = ln.nbytes // 2
    assert half % 4 == 0
    good = [Link(ln.value, ln.src, ln.dst, ln.dtype, half), Link(ln.value, ln.src, ln.dst, ln.dtype, half, half, half)]
    bad = [Link(ln.value, ln.src, ln.dst, ln.dtype, half, 0, half), Link(ln.value, ln.src, ln.dst, ln.dtype, half, half,
                                                                         0)]
    assert all(compare(o, v, ref[o], "float32").passed for o, v in _run(res, feeds, good).items() if o in g.outputs)
    got = _run(res, feeds, bad)
    assert not all(compare(o, got[o], ref[o], "float32").passed for o in g.outputs)


def test_one_stage_on_one_chip_is_the_single_chip_compile_and_spare_chips_run_replicas():
    one = compile_model("bert-tiny", "c600", 2, "fp16")
    for name, replicas in (("1xc600", 1), ("4xc600", 4)):
        res = compile_system("bert-tiny", name, 2, "fp16")
        assert len(res.stages) == 1 and res.replicas == replicas and not res.program.links
        assert res.stages[0].cycles == one.cycles
        assert res.period_cycles == one.throughput_cycles == res.latency_cycles
        assert res.throughput == pytest.approx(replicas * 2 * load_system(name).chip.clock_hz / one.throughput_cycles)


def _tiny_system(tmp_path, chips: int) -> str:
    """A system of `chips` tiny16 chips (16 tiles x 64 KiB each), written from the 4xc600 file."""
    text = (resources.files("tremula") / "systems" / "4xc600.toml").read_text()
    path = tmp_path / f"{chips}xtiny16.toml"
    path.write_text(text.replace('chip = "c600"', f'chip = "{TINY16.as_posix()}"')
                    .replace("chips = 4", f"chips = {chips}").replace('name = "4xc600"', f'name = "{chips}xtiny16"'))
    return str(path)


def test_the_fewest_stages_that_fit_are_chosen(tmp_path):
    """On 16 tiles of 64 KiB, bert-tiny at batch 8 fits on no single chip but on a pipeline, whose stages divide the
    chips (replicas use them all); a system of too few chips says it does not fit."""
    with pytest.raises(NoFit):
        compile_model("bert-tiny", str(TINY16), 8, "fp32")
    res = compile_system("bert-tiny", _tiny_system(tmp_path, 4), 8, "fp32")
    assert len(res.stages) in (2, 4) and res.replicas == 4 // len(res.stages)
    for k in range(1, len(res.stages)):  # fewer stages that divide the chips do not fit
        if 4 % k:
            continue
        with pytest.raises(SystemDoesNotFit):
            compile_system("bert-tiny", _tiny_system(tmp_path, 4), 8, "fp32", stages=k)
    with pytest.raises(SystemDoesNotFit, match="does not fit on 1xtiny16"):
        compile_system("bert-tiny", _tiny_system(tmp_path, 1), 8, "fp32")


def test_the_pipeline_period_is_the_slowest_stage_plus_the_links():
    res = compile_system("gpt2-tiny", "4xc600", 2, "fp16", stages=3)
    assert res.period_cycles == max(res.stage_cycles) + res.link_cycles + res.sync_cycles
    assert res.latency_cycles == sum(res.stage_cycles) + 2 * (res.link_cycles + res.sync_cycles)
    for r, c in zip(res.stages, res.stage_cycles):
        assert r.cycles <= c <= r.cycles + r.host_in_cycles + r.host_out_cycles
    assert len(res.link_bytes) == 2 and all(b > 0 for b in res.link_bytes)
    assert res.link_cycles == max(res.system.link_cycles(b) for b in res.link_bytes)
    assert 0 < res.mfu < 1


@pytest.mark.parametrize("kwargs, needle", [
    (dict(system="9xc600"), "unknown system"),
    (dict(stages=3), "--stages must be from 1 to the system's 2 chips"),
])
def test_system_requests_refused(kwargs, needle):
    args = dict(model="bert-tiny", system="2xc600", batch=2, dtype="fp32") | kwargs
    with pytest.raises(TremulaError, match=needle):
        compile_system(**args)


def test_batch_auto_on_a_system_finds_the_largest_batch_and_compiles_the_fastest(tmp_path):
    """tiny16 chips: --batch auto keeps the stages batch 1 needs, doubles and bisects to the largest batch whose
    stages all fit (one more does not), and compiles the fastest of those it planned."""
    path = _tiny_system(tmp_path, 2)
    res = compile_system("bert-tiny", path, "auto", "fp32", stages=2)
    largest, rates = res.auto["largest"], res.auto["rates"]
    assert largest >= 2 and largest in rates and 1 in rates
    assert res.batch == max(rates, key=lambda b: (rates[b], b)) and res.throughput == rates[res.batch]
    with pytest.raises(SystemDoesNotFit):
        compile_system("bert-tiny", path, largest + 1, "fp32", stages=2)


def test_batch_auto_on_a_system_answers_a_fixed_batch_file_for_its_own_batch(tmp_path):
    """As on one chip (compiler.auto_batch_request): an ONNX file exported at batch 2 is not searched."""
    import onnx

    from tremula.export import export_onnx
    from tremula.frontends import load_model

    path = tmp_path / "vit.onnx"
    onnx.save(export_onnx(load_model("vit-tiny", batch=2)), str(path))
    with pytest.warns(Warning, match="fixed batch of 2"):
        res = compile_system(str(path), "2xc600", "auto", "fp16", stages=2)
    assert res.batch == 2 and res.auto is None


def test_stage_counts_that_divide_the_chips_are_tried_first(monkeypatch):
    """A model that fits in 3 stages but not in 2 gets 4 on a 4-chip system (3 would leave a chip idle), and 3 when
    4 does not fit either."""
    import tremula.multichip as mc

    tried: list[int] = []
    real_cuts, real_compile = mc.balanced_cuts, mc.compile_model

    def cuts(graph, k, dt):
        tried.append(k)
        return real_cuts(graph, k, dt)

    def compile_stage(graph, *a, **k):
        if tried[-1] < 3 or tried[-1] in fails:
            raise NoFit(f"{tried[-1]} stages: too big (forced)")
        return real_compile(graph, *a, **k)

    monkeypatch.setattr(mc, "balanced_cuts", cuts)
    monkeypatch.setattr(mc, "compile_model", compile_stage)
    fails: set[int] = set()
    res = compile_system("gpt2-tiny", "4xc600", 2, "fp16")
    assert tried == [1, 2, 4] and len(res.stages) == 4 and res.replicas == 1
    tried.clear()
    fails.add(4)
    res = compile_system("gpt2-tiny", "4xc600", 2, "fp16")
    assert tried == [1, 2, 4, 3] and len(res.stages) == 3 and res.replicas == 1

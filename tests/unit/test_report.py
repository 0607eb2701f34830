"""Profile, "why" and trace: built from a tiny compiled model and from hand-made Programs, checked for consistency."""

import json
from itertools import pairwise

import numpy as np
import pytest

from tremula.codelets import codelet
from tremula.compiler import compile_model
from tremula.frontends import load_model
from tremula.program import BufferTable, Program, Step, TransferTable
from tremula.report import build_profile, report_paths
from tremula.report.profile import CATEGORIES, OpRow, StepRow, live_bytes, tile_work
from tremula.report.trace import tile_group_bounds, trace_events, write_trace
from tremula.report.why import classify
from tremula.target.chip import load_chip
from tremula.target.step_cost import price_step, step_cycles


@pytest.fixture(scope="module")
def tiny():
    chip = load_chip("c600")
    graph = load_model("bert-tiny", batch=2)
    res = compile_model(graph, chip, batch=2, dtype="fp16")
    return chip, graph, res, build_profile(res, chip)


# ------------------------------------------------------------------------------------------------ profile


def test_summary_matches_compile_result(tiny):
    chip, _, res, prof = tiny
    s = prof.summary
    assert (s.cycles, s.compute_cycles, s.exchange_cycles, s.sync_cycles) == (
        res.cycles, res.compute_cycles, res.exchange_cycles, res.sync_cycles)
    # latency charges the host link in series with the forward (CompileResult.throughput_cycles), as the CLI does
    assert (s.host_in_cycles, s.host_out_cycles) == (res.host_in_cycles, res.host_out_cycles) and res.host_cycles > 0
    assert s.latency_s == pytest.approx(res.latency_cycles / chip.clock_hz)
    assert s.latency_s == pytest.approx((res.cycles + res.host_in_cycles + res.host_out_cycles) / chip.clock_hz)
    assert s.throughput == pytest.approx(2 / s.latency_s)
    assert s.mfu == pytest.approx(s.model_flops / s.latency_s / chip.peak_flops("fp16"))
    assert 0 < s.mfu < 1
    assert s.model == "bert-tiny" and s.fits


def test_per_tile_cycles_agree_with_step_cycles(tiny):
    chip, _, res, prof = tiny
    T = res.program.tiles
    for step, row in zip(res.program.steps, prof.steps):
        cyc = price_step(chip, step, T).tile_compute
        nv, amp, ideal = tile_work(chip, step, T)
        # each vertex priced on its own by its codelet's formula, summed per tile: what price_step charges
        naive = np.zeros(T, np.int64)
        for g in step.compute:
            for t, pr, sh in zip(g.tiles, g.params, g.shapes):
                naive[t] += codelet(g.codelet).cycles(chip, tuple(int(x) for x in pr),
                                                      [tuple(int(y) for y in s) for s in sh], g.dtypes)
        assert np.array_equal(cyc, naive)
        assert np.all(amp <= cyc) and np.all(ideal <= amp)
        comp, exch, sync = step_cycles(chip, step)
        assert int(cyc.max(initial=0)) == comp == row.compute
        assert (row.exchange, row.sync) == (exch, sync)
        assert int(nv.sum()) == sum(len(g) for g in step.compute) == row.vertices
        assert row.balance >= 1.0
        if row.tiles_used:
            assert row.mean_tile_cycles <= row.compute


def test_step_starts_are_cumulative(tiny):
    _, _, res, prof = tiny
    t = 0
    for r in prof.steps:
        assert r.start == t
        t += r.total
    assert t == res.cycles


def test_ops_partition_the_program(tiny):
    _, _, res, prof = tiny
    assert sorted(i for o in prof.ops for i in o.steps) == list(range(len(res.program.steps)))
    assert sum(o.cycles for o in prof.ops) == res.cycles
    assert sum(o.pct for o in prof.ops) == pytest.approx(100.0)
    assert sum(t.cycles for t in prof.op_types) == res.cycles
    # Nodes lowered to no step (reshapes folded into layouts) must do no arithmetic, else FLOPs would go missing.
    assert sum(o.flops for o in prof.ops) == prof.summary.model_flops
    assert all(0 <= o.utilisation <= 1 for o in prof.ops)
    names = {o.node for o in prof.ops}
    assert "encoder.layer.0.attention" in names
    attn = next(o for o in prof.ops if o.node == "encoder.layer.0.attention")
    assert attn.op == "Attention" and attn.flops > 0 and attn.tiles_used > 0
    # Its steps end with its own compute; any exchange-only steps charged to it come before.
    labels = [res.program.steps[i].label for i in attn.steps]
    assert labels[-1].startswith("Attention") and all(x == "exchange" for x in labels[:-1])


def test_memory_by_category_matches_memory_plan(tiny):
    _, _, res, prof = tiny
    t = res.fullest_tile
    assert {c: prof.tile_memory[c][t] for c in CATEGORIES} == {c: res.memory_by_category[c] for c in CATEGORIES}
    total = np.sum([prof.tile_memory[c] for c in CATEGORIES], axis=0)
    # Live bytes never exceed the tile's high-water mark (which also counts alignment and first-fit gaps).
    assert total.max() <= res.peak_tile_bytes
    assert max(r.live_peak_tile_bytes for r in prof.steps) <= res.peak_tile_bytes
    assert all(len(v) == res.program.tiles for v in prof.tile_memory.values())
    # The reserved split is recomputed from the steps: it must add up to what the Program stores.
    reserved = np.sum([prof.tile_memory[c] for c in ("code", "vertex_state", "exchange_code")], axis=0)
    assert np.array_equal(reserved, res.program.reserved_bytes)


def _table(first, last, tiles_of, sizes_of, cats):
    counts = [len(t) for t in tiles_of]
    return BufferTable([f"b{i}" for i in range(len(cats))], list(cats), np.array(first, np.int64),
                       np.array(last, np.int64), np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                       np.concatenate(tiles_of).astype(np.int32), np.zeros(sum(counts), np.int64),
                       np.concatenate(sizes_of).astype(np.int64))


def test_live_bytes_by_half_step():
    # 3 steps, 2 tiles. A weight (always live), an activation live at half-steps 0..2 on both tiles, a buffer
    # live at half-step 3 only on tile 1.
    bt = _table([-1, 0, 3], [7, 2, 3], [np.array([0]), np.array([0, 1]), np.array([1])],
                [np.array([100]), np.array([10, 20]), np.array([5])], ["weights", "activations", "buffers"])
    steps = [Step([], TransferTable.empty(), "exchange") for _ in range(3)]
    prog = Program("x", 2, 1000, "float32", 1, steps, [], [], [], bt, {}, np.zeros(2, np.int64))
    live = live_bytes(prog)

    def hs(t):  # row of half-step t
        return t + 1

    assert live["weights"][hs(-1), 0] == 100 and live["weights"][hs(6), 0] == 100 and live["weights"][hs(6), 1] == 0
    assert [int(live["activations"][hs(t), 1]) for t in range(-1, 5)] == [0, 20, 20, 20, 0, 0]
    assert [int(live["buffers"][hs(t), 1]) for t in range(-1, 6)] == [0, 0, 0, 0, 5, 0, 0]


def test_steps_carry_their_origin_as_data(tiny):
    """Every compute step names its node, op, value and phase; the profile attributes steps by them, not by labels."""
    _, graph, res, prof = tiny
    nodes = {(n.name or n.outputs[0], n.op) for n in res.graph.nodes}  # (node names need not be unique)
    computes = [s for s in res.program.steps if s.compute]
    assert computes and all(s.origin is not None for s in computes)
    for s in computes:
        assert (s.origin.node, s.origin.op) in nodes and s.label.startswith(f"{s.origin.op} {s.origin.value}")
    assert {s.origin.phase for s in computes} <= {"", "partials", "reduce", "moments", "combine"}
    assert all(s.origin is None for s in res.program.steps if not s.compute and s.call is None)
    by_index = {r.index: r for r in prof.steps}
    assert all(by_index[k].op == s.origin.op for k, s in enumerate(res.program.steps) if s.origin is not None)


# ------------------------------------------------------------------------------------------------ why


def _step(i, **kw):
    base = {"index": i, "label": "X n", "node": "n", "op": "X", "start": 0, "compute": 1000, "sync": 118,
            "exchange": 0, "tiles_used": 1000, "vertices": 1000, "mean_tile_cycles": 1000.0, "balance": 1.0,
            "busiest_tile": 0, "amp_cycles": 0, "amp_ideal_cycles": 0.0, "exchange_bytes": 0, "max_tile_sent": 0,
            "max_tile_received": 0, "live_peak_tile_bytes": 0, "live_total_bytes": 0, "codelets": ("unary",)}
    base.update(kw)
    return StepRow(**base)


def _op(steps):
    return OpRow("n", "X", [s.index for s in steps], sum(s.compute for s in steps), sum(s.sync for s in steps),
                 sum(s.exchange for s in steps), 0.0, 0, 0.0, 1000, sum(s.exchange_bytes for s in steps), 0, 0)


@pytest.mark.parametrize("steps,kind", [
    ([_step(0, compute=100, exchange=2000, exchange_bytes=8000, max_tile_sent=7600)], "exchange"),
    ([_step(i, compute=10) for i in range(5)], "sync"),
    ([_step(0, compute=3000, mean_tile_cycles=1000.0, balance=3.0)], "imbalance"),
    ([_step(0, compute=3000, amp_cycles=2900, amp_ideal_cycles=300.0, codelets=("matmul",))], "vertex_overhead"),
    ([_step(0, compute=3000, tiles_used=10)], "low_tile_usage"),
    ([_step(0, compute=3000, amp_cycles=2900, amp_ideal_cycles=2400.0, codelets=("matmul",))], "compute"),
    ([_step(0, compute=3000, amp_cycles=900, amp_ideal_cycles=800.0, codelets=("attention",))], "vector"),
])
def test_classify(steps, kind):
    chip = load_chip("c600")
    f = classify(_op(steps), steps, chip, 1472)
    assert f.kind == kind
    assert "n (X," in f.sentence and any(ch.isdigit() for ch in f.sentence)


def test_why_on_tiny_names_costliest_op(tiny):
    _, _, _, prof = tiny
    assert len(prof.why) >= 2
    assert prof.ops[0].node in prof.why[1]
    # The two identical encoder layers are named once, with a count, not twice.
    assert "Same in 1 more like it" in prof.why[1]
    named = f"{prof.ops[1].node} ("  # a finding starts "node (Op, cycles)"; other nodes may share the prefix
    assert not any(named in w for w in prof.why) or prof.ops[1].cycles != prof.ops[0].cycles
    assert f"{prof.summary.cycles:,}" in prof.why[0]


# ------------------------------------------------------------------------------------------------ trace


def test_tile_group_bounds():
    b = tile_group_bounds(1472, 16)
    assert len(b) == 16 and b[0][0] == 0 and b[-1][1] == 1472
    assert all(b[i][1] == b[i + 1][0] for i in range(15))
    assert tile_group_bounds(3, 16) == [(0, 1), (1, 2), (2, 3)]


def test_trace_is_valid_and_tracks_do_not_overlap(tiny, tmp_path):
    chip, _, res, prof = tiny
    path = write_trace(prof, tmp_path / "t.json")
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ns"
    ev = doc["traceEvents"]
    xs = [e for e in ev if e["ph"] == "X"]
    assert {e["ph"] for e in ev} == {"X", "M"}
    named = {(e["pid"], e["tid"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    tracks: dict = {}
    for e in xs:
        assert (e["pid"], e["tid"]) in named and e["dur"] > 0
        tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    assert len([k for k in named if k[0] == 2]) == 16  # tile groups
    eps = 1e-6
    for evs in tracks.values():
        evs.sort(key=lambda e: e["ts"])
        for a, b in pairwise(evs):
            assert a["ts"] + a["dur"] <= b["ts"] + eps
    # Every compute/sync/exchange event lies inside its step's event on the steps track (proper nesting).
    steps = {e["args"]["step"]: e for e in tracks[(1, 1)]}
    for e in xs:
        s = steps[e["args"]["step"]]
        assert s["ts"] - eps <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + eps
    end = max(e["ts"] + e["dur"] for e in xs)
    assert end == pytest.approx(res.cycles / chip.clock_hz * 1e6, rel=1e-9)
    assert sum(e["dur"] for e in tracks[(1, 1)]) == pytest.approx(res.cycles / chip.clock_hz * 1e6, rel=1e-9)


def test_trace_group_count_is_a_parameter(tiny):
    _, _, _, prof = tiny
    ev = trace_events(prof, tile_groups=4)
    assert len({e["tid"] for e in ev if e["pid"] == 2 and e["ph"] == "M" and e["name"] == "thread_name"}) == 4


def test_report_paths_writes_all_three(tiny, tmp_path):
    chip, graph, res, _ = tiny
    prof = report_paths(res, chip, html=tmp_path / "r.html", trace=tmp_path / "t.json",
                        json_path=tmp_path / "p.json")
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["summary"]["cycles"] == res.cycles == prof.summary.cycles
    assert len(doc["steps"]) == len(res.program.steps)
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    text = (tmp_path / "r.html").read_text()
    assert text.startswith("<!DOCTYPE html>") and "http://" not in text and "https://" not in text
    assert text.count("data:image/png;base64,") == 4
    host = f"{res.host_cycles:,} cycles (in {res.host_in_cycles:,}, out {res.host_out_cycles:,}), not overlapped"
    assert "<td>host I/O</td>" in text and host in text
    assert f"{prof.summary.throughput:,.1f} samples/s (batch / latency: host I/O in series)" in text


def test_trace_of_a_bare_program_equals_the_profiles(tiny):
    chip, _, res, prof = tiny
    assert trace_events(res.program, chip=chip) == trace_events(prof)

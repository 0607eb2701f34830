"""Timetables of a whole program: the schedule cache gives what fresh scheduling gives, and the profile, the JSON, the
HTML report and the CLI charge each exchange its makespan and show it against its lower bound."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from transfer_tables import make_table

from tremula.compiler import compile_model
from tremula.frontends import load_model
from tremula.report import build_profile, render_html
from tremula.target.chip import load_chip
from tremula.target.overheads import reserved_bytes
from tremula.timing import schedule_exchange, verify_timetable
from tremula.timing import timetable as tt_mod
from tremula.timing.patterns import canonical_pattern
from tremula.timing.program_schedule import StepExchange, cycles_with_timetables, schedule_program, summarize

C600 = load_chip("c600")


@pytest.fixture(scope="module")
def tiny():
    graph = load_model("bert-tiny", batch=2)
    res = compile_model(graph, C600, batch=2, dtype="fp16")
    ex = schedule_program(res.program, C600)
    return graph, res, ex, build_profile(res, C600, exchanges=ex)


def _same(a, b) -> bool:
    return all(np.array_equal(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))


# ------------------------------------------------------------------------------------------------ the cache


@pytest.mark.parametrize("model,chip", [("bert-tiny", "c600"), ("vit-tiny", "mk2"),
                                        ("vit-tiny", "examples/chips/tiny64.toml")])
def test_cached_schedules_equal_fresh_ones(model, chip):
    chip = load_chip(chip)
    prog = compile_model(model, chip, batch=2, dtype="fp16", require_fit=False).program
    tables = [s.exchange for s in prog.steps if len(s.exchange)]
    tt_mod.clear_cache()
    warm = [schedule_exchange(t, chip) for t in tables]  # later steps reuse earlier steps' schedules
    assert len(tt_mod._CACHE) < len(tables)  # the layers of the model do share patterns
    for t, w in zip(tables, warm):
        tt_mod.clear_cache()
        assert _same(w, schedule_exchange(t, chip))  # cache cleared
        assert _same(w, tt_mod._schedule(t, chip, 16))  # no cache, no renaming of tiles
        verify_timetable(t, w, chip)
        assert w.lower_bound <= w.makespan


def test_renamed_tiles_reuse_the_schedule_and_stay_valid():
    # Senders moved by 300 tiles, receivers by 40 (a whole number of bus pairs): the same pattern.
    src, nbytes = [3, 3, 7, 9, 9], [4000, 640, 2048, 96, 1024]
    dests = [[100, 101], [102], [100, 104, 105], [101], [104]]
    a = make_table(src, nbytes, dests, rows=[4, 1, 2, 1, 4], src_gap=0.5)
    b = make_table([s + 300 for s in src], nbytes, [[d + 40 for d in ds] for ds in dests], rows=[2, 1, 1, 1, 2],
                   src_gap=0.5)
    assert canonical_pattern(a, C600, 16).key == canonical_pattern(b, C600, 16).key
    tt_mod.clear_cache()
    ta = schedule_exchange(a, C600)
    tb = schedule_exchange(b, C600)
    assert len(tt_mod._FLOWS) == len(tt_mod._CACHE) == 1
    verify_timetable(b, tb, C600)
    assert (tb.makespan, tb.lower_bound) == (ta.makespan, ta.lower_bound)
    assert np.array_equal(tb.d_port, ta.d_port + 40)
    # exchange code counts each table's own rows (b has fewer), not the cached table's
    assert tb.send_code.sum() < ta.send_code.sum()
    tt_mod.clear_cache()
    assert _same(schedule_exchange(b, C600), tb)


def test_a_pattern_whose_flows_tie_in_another_order_gets_its_own_timetable():
    # Equal flows tie until the ring distance receiver - sender: 1467 and 10 here, 5 and 20 after moving the
    # receivers (same ranks, same places in their bus pairs): one pattern, two orders, two timetables.
    a = make_table([10, 20], [4000, 4000], [[5], [30]])
    b = make_table([10, 20], [4000, 4000], [[15], [40]])
    assert canonical_pattern(a, C600, 16).key == canonical_pattern(b, C600, 16).key
    tt_mod.clear_cache()
    ta, tb = schedule_exchange(a, C600), schedule_exchange(b, C600)
    assert len(tt_mod._FLOWS) == 1 and len(tt_mod._CACHE) == 2
    assert _same(ta, tt_mod._schedule(a, C600, 16)) and _same(tb, tt_mod._schedule(b, C600, 16))


@pytest.mark.parametrize("change", ["bytes", "bus_group", "grouping"])
def test_patterns_that_schedule_differently_do_not_share_a_key(change):
    a = make_table([3, 7], [4000, 4000], [[100, 101], [102]])
    b = {"bytes": make_table([3, 7], [4000, 4004], [[100, 101], [102]]),
         "bus_group": make_table([3, 7], [4000, 4000], [[101, 102], [104]]),  # one pair -> two pairs
         "grouping": make_table([3, 7], [4000, 4000], [[100], [101, 102]])}[change]
    assert canonical_pattern(a, C600, 16).key != canonical_pattern(b, C600, 16).key


# ------------------------------------------------------------------------------------------------ the profile


def test_profile_charges_makespans_and_keeps_bounds(tiny):
    _, res, ex, prof = tiny
    by_step = {e.step: e for e in ex}
    assert ex and set(by_step) == {k for k, s in enumerate(res.program.steps) if len(s.exchange)}
    for r in prof.steps:
        e = by_step.get(r.index)
        if e is None:
            assert r.exchange_makespan is None and r.exchange == r.priced_exchange == 0
            continue
        assert r.exchange == r.exchange_makespan == e.makespan
        assert r.exchange_lower_bound == e.lower_bound > 0
        assert r.exchange_makespan >= r.exchange_lower_bound
        assert r.exchange_ratio == pytest.approx(r.exchange_makespan / r.exchange_lower_bound)
    s = prof.summary
    assert s.exchange_source == "timetables"
    assert s.exchange_cycles == sum(e.makespan for e in ex)
    assert s.priced_cycles == res.cycles and s.priced_exchange_cycles == res.exchange_cycles
    assert s.cycles == cycles_with_timetables(res.cycles, res.exchange_cycles, ex) == sum(r.total for r in prof.steps)
    assert s.latency_s == pytest.approx((s.host_in_cycles + s.cycles + s.host_out_cycles) / C600.clock_hz)
    assert sum(o.cycles for o in prof.ops) == s.cycles
    worst = max(ex, key=lambda e: e.ratio)
    assert s.timetables == summarize(ex).to_json()
    assert (s.timetables["worst_step"], s.timetables["worst_ratio"]) == (worst.step, worst.ratio)
    assert s.timetables["makespan"] >= s.timetables["lower_bound"]


def test_profile_without_timetables_is_unchanged(tiny):
    graph, res, _, _ = tiny
    prof = build_profile(res, C600)
    assert prof.summary.exchange_source == "cost model" and prof.summary.timetables is None
    assert prof.summary.cycles == prof.summary.priced_cycles == res.cycles
    assert all(r.exchange_makespan is None and r.exchange == r.priced_exchange for r in prof.steps)
    assert prof.exchange_code is None and prof.to_json()["exchange_code"] is None


def test_json_has_per_step_makespans_and_exchange_code(tiny):
    _, res, ex, prof = tiny
    doc = json.loads(json.dumps(prof.to_json()))
    rows = [r for r in doc["steps"] if r["exchange_makespan"] is not None]
    assert len(rows) == len(ex)
    assert all(r["exchange_makespan"] >= r["exchange_lower_bound"] > 0 for r in rows)
    assert doc["summary"]["timetables"]["exchanges"] == len(ex)
    code = doc["exchange_code"]
    # The timetables' code is every step's Timetable.exchange_code_bytes; the planned code is the memory plan's.
    expect = sum(schedule_exchange(s.exchange, C600).exchange_code_bytes(C600)
                 for s in res.program.steps if len(s.exchange))
    assert code["timetable"] == expect.tolist()
    # Recounted from the Program's absolute addresses, a receive that happens to start where one in another buffer
    # ends needs no pointer reset; the plan, which knows only buffers, reserved one (overheads._receive_bytes).
    recount = reserved_bytes(res.program.tiles, res.program.steps, C600)["exchange_code"]
    planned = np.asarray(code["planned"])
    resets = (planned - recount) / C600.exchange_code.pointer_reset_bytes
    assert (resets >= 0).all() and (resets == resets.round()).all()
    assert recount.sum() > 0.9 * planned.sum()
    assert code["timetable_max_bytes"] == max(code["timetable"]) > 0
    assert code["planned_max_bytes"] == max(code["planned"]) > 0
    has = planned > 0
    assert code["max_ratio"] == pytest.approx(float((expect[has] / planned[has]).max()))


def test_steps_moved_whole_in_address_order_cost_what_the_plan_reserves(tiny):
    # Where a timetable moves every transfer in one chunk and each tile receives in address order, its code is the
    # memory plan's count for that step (the same encoding model on the same sends and receives).
    _, res, _, _ = tiny
    same = 0
    for s in res.program.steps:
        t = s.exchange
        tt = schedule_exchange(t, C600)
        if not len(t) or len(tt) != len(t):
            continue
        ends = np.asarray(t.dst_start)
        j = np.concatenate([np.arange(ends[i], ends[i + 1]) for i in tt.transfer[np.argsort(tt.start, kind="stable")]])
        tile, addr = np.asarray(t.d_tile)[j], np.asarray(t.d_addr)[j]
        o = np.argsort(tile, kind="stable")
        if np.any((tile[o][1:] == tile[o][:-1]) & (addr[o][1:] < addr[o][:-1])):
            continue
        step = SimpleNamespace(compute=[], exchange=t)  # its exchange only
        assert np.array_equal(tt.exchange_code_bytes(C600),
                              reserved_bytes(res.program.tiles, [step], C600)["exchange_code"]), s.label
        same += 1
    assert same >= 10


def test_timetables_of_another_program_are_refused(tiny):
    graph, res, ex, _ = tiny
    wrong = [StepExchange(ex[0].step, "not this step", 1, 1)]
    with pytest.raises(ValueError, match="does not belong"):
        build_profile(res, C600, exchanges=wrong)


def test_html_shows_makespan_bound_and_exchange_code(tiny):
    graph, res, _, prof = tiny
    text = render_html(prof)
    assert "exchange makespan" in text and "makespan / bound" in text and 'id="exchange-code"' in text
    assert "cycles with scheduled exchanges" in text
    plain = render_html(build_profile(res, C600))
    assert "makespan" not in plain and 'id="exchange-code"' not in plain


def test_cli_prints_totals_with_scheduled_exchanges():
    p = subprocess.run([sys.executable, "-m", "tremula", "compile", "bert-tiny", "--chip", "c600", "--batch", "2",
                        "--dtype", "fp16", "--timetable"], capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stderr
    assert "timetables" in p.stdout and "worst step" in p.stdout
    assert "total cycles with scheduled exchanges:" in p.stdout and "with bounds)" in p.stdout

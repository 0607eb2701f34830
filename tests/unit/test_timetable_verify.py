"""Timetable verifier: a valid timetable passes; one built to break each rule fails naming that rule."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transfer_tables import make_table

from tremula.errors import TremulaError
from tremula.target.chip import load_chip
from tremula.timing import Timetable, TimetableError, replay_order, schedule_exchange, verify_timetable

CHIP = dataclasses.replace(load_chip("bow"), tiles=16)  # 4 B/cycle send and receive, pairs share a bus
FIXED = CHIP.exchange_fixed_cycles


def valid():
    """Five transfers and a hand-written valid timetable for them (4 B/cycle)."""
    t = make_table([0, 0, 6, 8, 12], [8, 8, 8, 400, 800], [[2], [4], [2], [10, 11], [14]], rows=[1, 1, 1, 1, 2])
    chunks = np.array([  # transfer, offset, bytes, start, end
        [0, 0, 8, 0, 2],
        [1, 0, 8, 2, 4],
        [2, 0, 8, 2, 4],  # tile 2's port heard tile 0 during [0, 2)
        [3, 0, 400, 0, 100],  # tiles 10 and 11 share a bus: one port (10's) takes it for both
        [4, 0, 400, 0, 100],
        [4, 400, 400, 100, 200],
    ])
    tt = Timetable(*[chunks[:, k].copy() for k in range(5)], d_port=np.array([2, 4, 2, 10, 10, 14], np.int32),
                   makespan=200 + FIXED, lower_bound=200 + FIXED, fixed_cycles=FIXED)
    return t, tt


def with_chunks(tt: Timetable, **changes) -> Timetable:
    cols = {k: getattr(tt, k).copy() for k in ("transfer", "offset", "nbytes", "start", "end")}
    for key, (k, v) in changes.items():
        cols[key][k] = v
    return dataclasses.replace(tt, **cols)


def drop_chunk(tt: Timetable, k: int) -> Timetable:
    keep = np.arange(len(tt)) != k
    return dataclasses.replace(tt, **{c: getattr(tt, c)[keep] for c in ("transfer", "offset", "nbytes", "start",
                                                                        "end")})


def test_valid_timetable_passes():
    t, tt = valid()
    verify_timetable(t, tt, CHIP)


@pytest.mark.parametrize("make, rule", [
    (lambda tt: with_chunks(tt, start=(1, 1), end=(1, 3)), "sender double-booked"),
    (lambda tt: with_chunks(tt, start=(2, 1), end=(2, 3)), "receiver listening to two senders"),
    (lambda tt: with_chunks(tt, end=(3, 99)), "bandwidth exceeded"),
    (lambda tt: drop_chunk(tt, 5), "byte not delivered exactly once.*never"),
    (lambda tt: with_chunks(tt, offset=(5, 300)), "byte not delivered exactly once.*twice"),
    (lambda tt: with_chunks(tt, nbytes=(5, 404), end=(5, 201)), "chunk outside the transfer"),
    (lambda tt: with_chunks(tt, transfer=(0, 5)), "chunk outside the transfer"),
    (lambda tt: with_chunks(tt, start=(0, -2), end=(0, 0)), "negative times"),
    (lambda tt: with_chunks(tt, start=(0, 2), end=(0, 1)), "negative times"),
    (lambda tt: dataclasses.replace(tt, makespan=199 + FIXED), "makespan smaller than its chunks"),
    (lambda tt: dataclasses.replace(tt, d_port=np.array([3, 4, 2, 10, 10, 14], np.int32)), "shared-bus rule"),
    (lambda tt: dataclasses.replace(tt, d_port=np.array([2, 4, 2, 12, 12, 14], np.int32)), "shared-bus rule"),
    (lambda tt: dataclasses.replace(tt, d_port=np.array([2, 4, 2], np.int32)), "malformed"),
])
def test_each_violation_is_named(make, rule):
    t, tt = valid()
    with pytest.raises(TimetableError, match=rule):
        verify_timetable(t, make(tt), CHIP)


def test_timetable_error_is_a_tremula_error():
    assert issubclass(TimetableError, TremulaError)


def test_shared_port_needs_a_shared_bus():
    t, tt = valid()
    with pytest.raises(TimetableError, match="shared-bus rule"):
        verify_timetable(t, tt, dataclasses.replace(CHIP, tiles_per_shared_exchange_bus=1))


def test_receive_bandwidth_is_checked_separately():
    t, tt = valid()
    slow_rx = dataclasses.replace(CHIP, exchange_recv_bytes_per_cycle_per_tile=2)
    with pytest.raises(TimetableError, match="bandwidth exceeded.*receive"):
        verify_timetable(t, tt, slow_rx)


def test_same_port_heard_twice_across_the_pair():
    # Transfer 3 takes tiles 10+11 through 10's port; a unicast into 10 at the same time collides on that port.
    t = make_table([8, 9], [400, 400], [[10, 11], [10]])
    tt = Timetable(np.array([0, 1]), np.array([0, 0]), np.array([400, 400]), np.array([0, 50]),
                   np.array([100, 150]), np.array([10, 10, 10], np.int32), 150 + FIXED, 0, FIXED)
    with pytest.raises(TimetableError, match="receiver listening to two senders: tile 10"):
        verify_timetable(t, tt, CHIP)
    # Through 11's port instead, both fit at once.
    verify_timetable(t, dataclasses.replace(tt, d_port=np.array([11, 11, 10], np.int32)), CHIP)


@st.composite
def tables(draw):
    n = draw(st.integers(0, 30))
    src, nbytes, dests, rows = [], [], [], []
    for _ in range(n):
        src.append(draw(st.integers(0, 15)))
        r = draw(st.integers(1, 3))
        rows.append(r)
        nbytes.append(r * draw(st.integers(1, 60)))
        dests.append(draw(st.lists(st.integers(0, 15), min_size=1, max_size=6)))
    return make_table(src, nbytes, dests, rows)


@settings(max_examples=60, deadline=None)
@given(tables(), st.sampled_from([1, 2, 4]), st.sampled_from([1, 16]))
def test_random_tables_schedule_and_verify(t, bus, min_piece):
    chip = dataclasses.replace(CHIP, tiles_per_shared_exchange_bus=bus)
    tt = schedule_exchange(t, chip, min_piece_cycles=min_piece)
    verify_timetable(t, tt, chip)
    assert tt.makespan >= tt.lower_bound
    o = replay_order(tt)
    assert sorted(o.tolist()) == list(range(len(tt)))


@settings(max_examples=40, deadline=None)
@given(tables(), st.data())
def test_moving_a_chunk_onto_a_busy_sender_fails(t, data):
    tt = schedule_exchange(t, CHIP)
    src = t.src_tile[tt.transfer]
    pairs = [(a, b) for a in range(len(tt)) for b in range(len(tt))
             if a != b and src[a] == src[b] and tt.end[a] - tt.start[a] >= tt.end[b] - tt.start[b]]
    if not pairs:
        return
    a, b = data.draw(st.sampled_from(pairs))
    dur = tt.end[b] - tt.start[b]
    bad = with_chunks(tt, start=(b, tt.start[a]), end=(b, tt.start[a] + dur))
    with pytest.raises(TimetableError, match="sender double-booked|receiver listening"):
        verify_timetable(t, bad, CHIP)

"""Earliest-fit placement of an exchange's flows on port timelines (stage 1 of timetable.py's scheduler).

Each port (a tile's send port or receive port) keeps its busy intervals as two sorted lists of starts and ends, merged
when they touch. A flow is placed, in the order it is given, into every window from cycle 0 on in which all of its
ports are idle, in pieces of at least min_piece cycles (or what is left of it), until its cycles are used up.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import chain

import numpy as np

I64 = np.int64
_INF = float("inf")

WIDE_FLOW_PORTS = 8  # above this many ports a flow's idle windows are found with NumPy instead of port by port


class _Timelines:
    """Busy intervals of every port, each a sorted list of disjoint [start, end) kept merged."""

    def __init__(self, n: int) -> None:
        self.s: list[list[int]] = [[] for _ in range(n)]
        self.e: list[list[int]] = [[] for _ in range(n)]

    def lanes(self, res: list[int]) -> list[tuple[list[int], list[int]]]:
        return [(self.s[r], self.e[r]) for r in res]


def _book(lanes: list[tuple[list[int], list[int]]], a: int, b: int) -> None:
    """Mark [a, b) busy on every lane (a port's starts and ends), merged with a touching interval on either side."""
    for s, e in lanes:
        i = bisect_right(s, a)
        if i > 0 and e[i - 1] == a:
            e[i - 1] = b
            if i < len(s) and s[i] == b:
                e[i - 1] = e[i]
                del s[i], e[i]
        elif i < len(s) and s[i] == b:
            s[i] = a
        else:
            s.insert(i, a)
            e.insert(i, b)


def _place_wide(tl: _Timelines, res: list[int], dur: int, min_piece: int) -> list[tuple[int, int]]:
    """_place for flows on many ports: the common idle windows are the gaps of the union of their busy intervals."""
    lanes = tl.lanes(res)
    starts = list(chain.from_iterable(s for s, _ in lanes))
    pieces: list[tuple[int, int]] = []
    if starts:
        s = np.array(starts, I64)
        e = np.array(list(chain.from_iterable(e for _, e in lanes)), I64)
        o = np.argsort(s, kind="stable")
        run = np.maximum.accumulate(e[o])
        gap_a = np.concatenate(([0], run))
        gap_b = np.concatenate((s[o], [run[-1] + dur]))  # the last gap is open-ended: long enough for the whole flow
        keep = gap_b - gap_a >= min(min_piece, dur)
        left = dur
        for a, b in zip(gap_a[keep].tolist(), gap_b[keep].tolist()):
            length = min(b - a, left)
            if length < min(min_piece, left):
                continue
            pieces.append((a, a + length))
            left -= length
            if left == 0:
                break
    else:
        pieces.append((0, dur))
    for a, b in pieces:
        _book(lanes, a, b)
    return pieces


def _place(tl: _Timelines, res: list[int], dur: int, min_piece: int) -> list[tuple[int, int]]:
    """Earliest-fit preemptive placement of `dur` cycles on all ports in `res` at once: from cycle t, the first
    window in which every port is idle for at least min(min_piece, cycles left), filled, then on from its end.
    (Written out rather than as per-port method calls: this runs once per flow, ~10^5 times a base model.)"""
    if len(res) > WIDE_FLOW_PORTS:
        return _place_wide(tl, res, dur, min_piece)
    if len(res) == 2:
        return _place_pair(tl.s[res[0]], tl.e[res[0]], tl.s[res[1]], tl.e[res[1]], dur, min_piece)
    lanes = tl.lanes(res)
    if dur > 0 and not any(st for st, _ in lanes):  # every port idle: the whole flow from cycle 0
        for st, en in lanes:
            st.append(0)
            en.append(dur)
        return [(0, dur)]
    pieces: list[tuple[int, int]] = []
    t, left = 0, dur
    while left > 0:
        need = min(min_piece, left)
        while True:
            until = _INF  # the earliest cycle after t at which one of the ports becomes busy
            for st, en in lanes:
                i = bisect_right(st, t) - 1
                if i >= 0 and en[i] > t:  # busy at t: retry from the end of that interval
                    t = en[i]
                    break
                if i + 1 < len(st) and st[i + 1] < until:
                    until = st[i + 1]
            else:
                if until - t >= need:
                    break
                t = until  # window too short: skip past the port that becomes busy there
        b = t + left if until - t >= left else until
        _book(lanes, t, b)
        pieces.append((t, b))
        left -= b - t
        t = b
    return pieces


def _place_pair(s1: list[int], e1: list[int], s2: list[int], e2: list[int], dur: int,
                min_piece: int) -> list[tuple[int, int]]:
    """_place for a unicast flow (one send port, one receive port: nine flows in ten of a base model), the loop over
    the two ports unrolled. Same windows, same order of checks, same pieces."""
    if dur > 0 and not s1 and not s2:
        s1.append(0)
        e1.append(dur)
        s2.append(0)
        e2.append(dur)
        return [(0, dur)]
    pieces: list[tuple[int, int]] = []
    t, left = 0, dur
    while left > 0:
        need = min(min_piece, left)
        while True:
            i = bisect_right(s1, t) - 1
            if i >= 0 and e1[i] > t:
                t = e1[i]
                continue
            until = s1[i + 1] if i + 1 < len(s1) else _INF
            j = bisect_right(s2, t) - 1
            if j >= 0 and e2[j] > t:
                t = e2[j]
                continue
            if j + 1 < len(s2) and s2[j + 1] < until:
                until = s2[j + 1]
            if until - t >= need:
                break
            t = until
        b = t + left if until - t >= left else until
        _book(((s1, e1), (s2, e2)), t, b)
        pieces.append((t, b))
        left -= b - t
        t = b
    return pieces



def greedy_pieces(flow_res: list[list[int]], flow_dur: np.ndarray, order: np.ndarray, ports: int,
                  min_piece: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Place the flows in `order` (flow f uses ports flow_res[f] for flow_dur[f] cycles): the pieces as (flow,
    start, end, first cycle of the piece within its flow), in placement order."""
    tl = _Timelines(ports)
    piece_flow, piece_a, piece_b, piece_f0 = [], [], [], []
    for f in order.tolist():
        done = 0
        for a, b in _place(tl, flow_res[f], int(flow_dur[f]), min_piece):
            piece_flow.append(f)
            piece_a.append(a)
            piece_b.append(b)
            piece_f0.append(done)
            done += b - a
    return np.array(piece_flow, I64), np.array(piece_a, I64), np.array(piece_b, I64), np.array(piece_f0, I64)

"""The exact stage of exchange scheduling: a preemptive schedule of a bipartite multigraph in max-degree time (König).

Used by timetable.py when the flows of a step form a bipartite multigraph (senders x disjoint receiver sets).
"""

from __future__ import annotations

import heapq

import numpy as np

I64 = np.int64

KONIG_MAX_FLOWS = 20000  # the exact construction is O(flows x path length) in Python; the greedy covers larger steps


def receiver_classes(flow_res: list[list[int]]) -> np.ndarray | None:
    """Index of each flow's receive-port set when distinct sets are pairwise disjoint, else None."""
    ids: dict[tuple, int] = {}
    cls = np.empty(len(flow_res), I64)
    seen: set[int] = set()
    for f, res in enumerate(flow_res):
        key = tuple(res[1:])
        c = ids.get(key)
        if c is None:
            if any(p in seen for p in key):
                return None
            seen.update(key)
            c = ids[key] = len(ids)
        cls[f] = c
    return cls


def konig_schedule(sender: np.ndarray, cls: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, ...]:
    """Exact preemptive schedule of a bipartite multigraph (edge f = sender[f] -> class cls[f], dur[f] cycles) in
    max-degree time: pad to a Delta-regular bipartite graph (each sender and class gets a dummy partner absorbing its
    slack, plus mirrored edges between the dummies), then repeatedly run a perfect matching until one of its edges is
    used up and repair the matching by augmenting paths (a regular bipartite graph always has a perfect matching)."""
    su, s_idx = np.unique(sender, return_inverse=True)
    nS, nC = len(su), int(cls.max()) + 1
    row = np.bincount(s_idx, weights=dur, minlength=nS).astype(I64)
    col = np.bincount(cls, weights=dur, minlength=nC).astype(I64)
    delta = int(max(row.max(), col.max()))
    # Left: senders 0..nS-1, class dummies nS..nS+nC-1. Right: classes 0..nC-1, sender dummies nC..nC+nS-1.
    nL = nS + nC
    adj: list[dict[int, int]] = [{} for _ in range(nL)]
    edge_flow: dict[tuple[int, int], int] = {}
    for f, (a, c, w) in enumerate(zip(s_idx.tolist(), cls.tolist(), dur.tolist())):
        adj[a][c] = adj[a].get(c, 0) + w
        adj[nS + c][nC + a] = adj[nS + c].get(nC + a, 0) + w
        edge_flow[(a, c)] = f
    for a in range(nS):
        if row[a] < delta:
            adj[a][nC + a] = delta - int(row[a])
    for c in range(nC):
        if col[c] < delta:
            adj[nS + c][c] = delta - int(col[c])
    match_l = [-1] * nL
    match_r = [-1] * nL
    since = [0] * nL  # cycle at which left vertex u's current match began
    zero_at = [0] * nL  # cycle at which that matched edge runs out
    heap: list[tuple[int, int]] = []
    out_f, out_a, out_b = [], [], []
    now = 0

    def close(u: int) -> None:  # u's matched edge stops running now: keep its remaining weight, record the piece
        v = match_l[u]
        left = zero_at[u] - now
        if left > 0:
            adj[u][v] = left
        else:
            del adj[u][v]
        if now > since[u] and u < nS and v < nC:
            out_f.append(edge_flow[(u, v)])
            out_a.append(since[u])
            out_b.append(now)

    def open_(u: int, v: int) -> None:
        match_l[u], match_r[v] = v, u
        since[u], zero_at[u] = now, now + adj[u][v]
        heapq.heappush(heap, (zero_at[u], u))

    def augment(u0: int) -> None:
        prev: dict[int, int] = {}
        queue, qi = [u0], 0
        while qi < len(queue):
            u = queue[qi]
            qi += 1
            for v in adj[u]:
                if v in prev or v == match_l[u]:
                    continue
                prev[v] = u
                if match_r[v] < 0:
                    while True:  # flip the path back to u0
                        pu = prev[v]
                        old = match_l[pu]
                        if old >= 0:
                            close(pu)
                            match_r[old] = -1
                        open_(pu, v)
                        if pu == u0:
                            return
                        v = old
                queue.append(match_r[v])
        raise AssertionError("regular bipartite graph without a perfect matching")  # cannot happen (Hall)

    for u in range(nL):
        augment(u)
    while heap:
        t, u = heapq.heappop(heap)
        if match_l[u] < 0 or zero_at[u] != t:
            continue  # stale entry
        now = t
        done = [u]
        while heap and heap[0][0] == t:
            _, w = heapq.heappop(heap)
            if match_l[w] >= 0 and zero_at[w] == t and w not in done:
                done.append(w)
        for w in done:
            v = match_l[w]
            close(w)
            match_l[w], match_r[v] = -1, -1
        if now >= delta:
            break
        for w in done:
            if match_l[w] < 0:
                augment(w)
    order = np.lexsort((np.array(out_a, I64), np.array(out_f, I64)))
    f, a, b = (np.array(x, I64)[order] for x in (out_f, out_a, out_b))
    first = np.r_[True, f[1:] != f[:-1]] if len(f) else np.zeros(0, bool)
    length = b - a
    csum = np.cumsum(length)
    f0 = csum - length - np.maximum.accumulate(np.where(first, csum - length, 0)) if len(f) else length
    return f, a, b, f0

"""The vectorised simulator computes exactly what running every vertex and every transfer row alone computes.

The reference here is kept simple on purpose: each vertex runs its codelet on [rows, cols] views of its own tile's
bytes, one vertex after another, and each transfer copies its rows one by one. Memory after the whole program and the
outputs must agree bit for bit at fp32, fp16 and fp8 (including per-vertex params: causal query and key block starts).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tremula.codelets import CODELETS, codelet
from tremula.codelets.embed import IndexOutOfRange
from tremula.codelets.fp8 import FORMATS, amp_matmul_stack
from tremula.compiler import compile_model
from tremula.feeds import make_feeds
from tremula.frontends import load_model
from tremula.numerics.fp8 import Fp8Format, amp_fp8_matmul, quantize
from tremula.pipeline import canonical
from tremula.program import storage_dtype
from tremula.sim.functional import Machine, simulate
from tremula.target.chip import load_chip

TINY64 = "examples/chips/tiny64.toml"


def run_one_by_one(m: Machine) -> None:
    """Every step of m's program, vertex by vertex and transfer row by transfer row."""
    for step in m.p.steps:
        for g in step.compute:
            cl = codelet(g.codelet)
            for i in range(len(g)):
                t = int(g.tiles[i])
                views = []
                for a, dt in enumerate(g.dtypes):
                    r, c = (int(x) for x in g.shapes[i, a])
                    addr = int(g.addrs[i, a])
                    dt = storage_dtype(dt)  # (FP8 operands as their code bytes, as the simulator views them)
                    views.append(m.mem[t, addr: addr + r * c * dt.itemsize].view(dt).reshape(r, c))
                cl.run(views, tuple(int(p) for p in g.params[i]))
        ex = step.exchange
        for j in range(len(ex)):
            tr = ex.transfer(j)
            for r in range(tr.rows):
                src = m.mem[tr.src_tile, tr.src_addr + r * tr.src_stride:][: tr.row_bytes].copy()
                for d in tr.dsts:
                    m.mem[d.tile, d.addr + r * d.stride:][: tr.row_bytes] = src


def run_vectorised(m: Machine) -> None:
    for k in range(len(m.p.steps)):
        m.compute(k)
        m.exchange(k)


def _setup(model: str, chip: str, dtype: str):
    res = compile_model(model, load_chip(chip), 2, dtype)
    feeds = make_feeds(canonical(load_model(model, 2)), 1)
    return res, feeds


def _machines(res, feeds) -> tuple[Machine, Machine]:
    out = []
    for _ in range(2):
        m = Machine(res.program, check=False)
        m.load_weights(res.graph)
        m.host_in(feeds)
        out.append(m)
    return out[0], out[1]


CASES = [(m, TINY64, d) for m in ("vit-tiny", "bert-tiny", "gpt2-tiny", "siglip-tiny") for d in ("fp32", "fp16")]
CASES += [(m, "c600", "fp8") for m in ("vit-tiny", "bert-tiny", "gpt2-tiny")]


@pytest.mark.parametrize("model,chip,dtype", CASES)
def test_vectorised_equals_one_vertex_at_a_time(model, chip, dtype):
    res, feeds = _setup(model, chip, dtype)
    fast, slow = _machines(res, feeds)
    run_vectorised(fast)
    run_one_by_one(slow)
    assert np.array_equal(fast.mem, slow.mem)
    got, want = fast.host_out(), slow.host_out()
    assert got.keys() == want.keys()
    for k in got:
        assert got[k].tobytes() == want[k].tobytes(), k


def test_per_vertex_params_of_key_blocks(monkeypatch):
    """Keys split over tiles in a causal model: every vertex has its own query and key block starts, and a stack of
    them must still mask each vertex's own keys."""
    from tremula.plan import lower_attention

    monkeypatch.setattr(lower_attention, "ATTENTION_KV_FRACTION", 1e-4)
    res, feeds = _setup("gpt2-tiny", "c600", "fp16")
    groups = [g for s in res.program.steps for g in s.compute if g.codelet == "attention_partial"]
    assert groups and any(len(np.unique(g.params[:, 2])) > 1 and len(np.unique(g.params[:, 6])) > 1 for g in groups)
    fast, slow = _machines(res, feeds)
    run_vectorised(fast)
    run_one_by_one(slow)
    assert np.array_equal(fast.mem, slow.mem)


def test_a_group_runs_as_one_stack(monkeypatch):
    """Attention vertices differ in their query block start (a per-vertex param), yet each group is one call."""
    res, feeds = _setup("vit-tiny", "c600", "fp32")
    calls: list[int] = []
    cl = codelet("attention")

    def counted(ops, params):
        calls.append(len(ops[0]))
        cl.run(ops, params)

    monkeypatch.setitem(CODELETS, "attention", dataclasses.replace(cl, run=counted))
    simulate(res.program, res.graph, feeds)
    groups = [g for s in res.program.steps for g in s.compute if g.codelet == "attention"]
    assert groups and len(calls) == len(groups)
    assert calls == [len(g) for g in groups] and max(calls) > 1


def test_stacked_fp8_matmul_is_the_reference_bit_for_bit():
    rng = np.random.default_rng(3)
    for k, group in ((96, 32), (40, 16)):  # 40 is not a multiple of the group: the per-group loop
        xc = np.stack([quantize(rng.standard_normal((5, k)), Fp8Format.F143, -4) for _ in range(6)])
        wc = np.stack([quantize(rng.standard_normal((k, 7)) * 0.1, Fp8Format.F152, -6) for _ in range(6)])
        ws = np.array([-6, -5, -7, -6, -4, -8], np.int8)[:, None, None]
        got = amp_matmul_stack(xc, wc, FORMATS[0], FORMATS[1], -4, ws, group)
        for i in range(6):
            want = amp_fp8_matmul(xc[i], wc[i], Fp8Format.F143, Fp8Format.F152, -4, int(ws[i, 0, 0]), group)
            assert got[i].tobytes() == want.tobytes()


@pytest.mark.parametrize("name", ["Gelu", "GeluTanh", "Erf", "Exp", "Tanh", "Sigmoid", "Sqrt"])
def test_half_unary_tables_are_the_formula_for_every_value(name):
    from tremula.codelets.elementwise import UNARY, UNARY_IDS

    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    rng = np.random.default_rng(0)
    x = np.concatenate([every[rng.permutation(len(every))] for _ in range(2)]).reshape(8, 128, 128)  # a big stack
    out = np.zeros_like(x)
    codelet("unary").run([x, out], (UNARY_IDS[name],))
    with np.errstate(all="ignore"):
        want = np.asarray(UNARY[name](x)).astype(np.float16)
    assert out.tobytes() == want.tobytes()


def test_embedding_ids_out_of_range_in_a_stack():
    table = np.arange(12, dtype=np.float32).reshape(1, 4, 3).repeat(2, axis=0)
    out = np.zeros((2, 2, 3), np.float32)
    codelet("embed").run([np.array([[[0, 3]], [[1, -1]]], np.int32), table, out], np.zeros((2, 0), np.int64))
    assert out[1, 1].tolist() == [9.0, 10.0, 11.0]  # -1 is the last row
    with pytest.raises(IndexOutOfRange):
        codelet("embed").run([np.array([[[0, 4]], [[1, 1]]], np.int32), table, out], np.zeros((2, 0), np.int64))


def test_round_to_half_is_the_half_cast():
    """Every half value, every midpoint between neighbours and the floats either side of it, and random floats."""
    from tremula.numerics.amp import saturate_round_half as round_to_half

    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    h = np.sort(h[np.isfinite(h)].astype(np.float32))
    mid = ((h[1:].astype(np.float64) + h[:-1]) / 2).astype(np.float32)
    bits = np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([h, -0.0 * h[:1], mid, np.nextafter(mid, np.float32(np.inf)),
                        np.nextafter(mid, np.float32(-np.inf)), bits[np.isfinite(bits)]])
    x = np.clip(x, -65504, 65504)
    assert round_to_half(x.copy()).tobytes() == x.astype(np.float16).astype(np.float32).tobytes()


@pytest.mark.parametrize("name", ["Gelu", "Erf"])
def test_float32_erf_paths_are_the_formula(name):
    """Interpolated erf decides only the float32 results its error bound makes certain: normal activations at
    several scales, random bit patterns (huge, tiny, inf, NaN) and values at the ends of the interpolation range."""
    from tremula.codelets.elementwise import UNARY_IDS
    from tremula.numerics.erf import erf_exact, gelu_exact

    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(1 << 16).astype(np.float32) * s for s in (0.01, 1, 4, 12)]
                       + [rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32).view(np.float32),
                          np.array([0, -0.0, np.inf, -np.inf, np.nan, 8.485, -8.485, 6, -6], np.float32)])
    x = np.resize(x, (4, 2, len(x) // 8))
    out = np.zeros_like(x)
    with np.errstate(all="ignore"):
        codelet("unary").run([x, out], (UNARY_IDS[name],))
        want = erf_exact(x) if name == "Erf" else gelu_exact(x, "none")  # math.erf per element: the definition
    assert out.tobytes() == want.tobytes()


def _two_transfer_step(program) -> int:
    return next(k for k, s in enumerate(program.steps) if len(s.exchange) >= 2)


@pytest.fixture(params=[True, False], ids=["compiled", "numpy"])
def moves_path(request, monkeypatch):
    """The simulator's byte moves compiled (sim/moves.py) and as NumPy's passes: both must catch the same faults."""
    from tremula.numerics import jit

    if request.param and jit.numba is None:
        pytest.skip("numba is not installed (pip install tremula[fast])")
    monkeypatch.setattr(jit, "ENABLED", request.param)


def test_overlapping_transfer_destinations_fire(moves_path):
    import copy

    from tremula.sim.functional import SimCheckError

    res, feeds = _setup("bert-tiny", "mk2", "fp32")
    p = copy.deepcopy(res.program)
    ex = p.steps[_two_transfer_step(p)].exchange
    d0, d1 = int(ex.dst_start[0]), int(ex.dst_start[1])
    ex.d_tile[d1], ex.d_addr[d1] = ex.d_tile[d0], ex.d_addr[d0] + 4  # transfer 1 lands inside transfer 0's bytes
    with pytest.raises(SimCheckError, match="overlapping"):
        simulate(p, res.graph, feeds, check=True)


def test_an_exchange_writing_its_own_source_fires(moves_path):
    import copy

    from tremula.sim.functional import SimCheckError

    res, feeds = _setup("bert-tiny", "mk2", "fp32")
    p = copy.deepcopy(res.program)
    ex = p.steps[_two_transfer_step(p)].exchange
    d1 = int(ex.dst_start[1])
    ex.d_tile[d1], ex.d_addr[d1] = ex.src_tile[0], ex.src_addr[0]  # transfer 1 overwrites what transfer 0 reads
    with pytest.raises(SimCheckError, match="reads bytes it also writes"):
        simulate(p, res.graph, feeds, check=True)


def test_an_exchange_reading_unwritten_bytes_fires(moves_path):
    """A transfer's source row whose bytes were never written (here: forgotten just before the exchange) fails the
    check, naming that row's first byte."""
    from tremula.sim.functional import SimCheckError

    res, feeds = _setup("bert-tiny", "mk2", "fp32")
    p = res.program
    k = _two_transfer_step(p)
    m = Machine(p, check=True)
    m.load_weights(res.graph)
    m.host_in(feeds)
    for j in range(k):
        m.compute(j)
        m.exchange(j)
    m.compute(k)
    ex = p.steps[k].exchange
    row = int(ex.src_addr[1] + ex.src_stride[1])  # the second transfer's second row (or its first, if it has one)
    row = row if ex.rows[1] > 1 else int(ex.src_addr[1])
    m._mark(m._flat([int(ex.src_tile[1])], [row]), int(ex.row_bytes[1]), written=False)
    with pytest.raises(SimCheckError, match=f"step {k} .*a transfer reads unwritten byte {row} on tile "
                                            f"{int(ex.src_tile[1])}$"):
        m.exchange(k)


def test_the_written_bitmap_answers_as_a_byte_map(moves_path):
    """Rows at every alignment and length: the one-bit-per-byte written map marks and reports exactly the bytes a
    byte-per-byte map would, including the first unwritten byte of the first failing row."""
    rng = np.random.default_rng(7)
    m = Machine.__new__(Machine)
    m.size, m.mem, m.written = 256, np.zeros((3, 256), np.uint8), np.zeros((3, 32), np.uint8)
    ref = np.zeros(3 * 256, bool)
    for _ in range(300):
        n, length = int(rng.integers(1, 5)), int(rng.integers(1, 40))
        starts = rng.integers(0, 3 * 256 - length, n)
        m._scatter(starts, rng.integers(0, 256, (n, length), dtype=np.uint8))
        for s in starts:
            ref[s: s + length] = True
        q = rng.integers(0, 3 * 256 - length, 3)
        bad = [(i, int(np.argmin(ref[s: s + length]))) for i, s in enumerate(q) if not ref[s: s + length].all()]
        assert m._unwritten(q, length) == (bad[0] if bad else None)
    assert np.array_equal(np.unpackbits(m.written.reshape(-1), bitorder="little").astype(bool), ref)


def test_range_checks_in_address_order_answer_as_a_byte_map(moves_path):
    """A step's ranges (overlapping, touching, empty, on several tiles) marked and checked as their union in address
    order: the same bytes as row by row, and an unwritten byte is found exactly when a byte map has one."""
    from tremula.sim.functional import _sorted_rows, _union

    rng = np.random.default_rng(8)
    m = Machine.__new__(Machine)
    m.size, m.mem, m.written = 256, np.zeros((3, 256), np.uint8), np.zeros((3, 32), np.uint8)
    ref = np.zeros(3 * 256, bool)
    for _ in range(200):
        n = int(rng.integers(1, 8))
        tile, lens = rng.integers(0, 3, n), rng.integers(0, 40, n)
        start = np.array([int(rng.integers(0, 256 - x + 1)) for x in lens])
        t, s, e, _ = _sorted_rows(tile, start, lens)
        flat = m._map_ranges(t, s, e)
        bad = m._first_unwritten(*flat)
        missing = [int(b) for tt, a0, x in zip(tile, start, lens) for b in range(tt * 256 + a0, tt * 256 + a0 + x)
                   if not ref[b]]
        assert (bad is None) == (not missing) and (bad is None or bad in missing), (bad, missing)
        if rng.random() < 0.5:
            m._mark_ranges(*flat)
            for tt, a0, x in zip(tile, start, lens):
                ref[tt * 256 + a0: tt * 256 + a0 + x] = True
    assert np.array_equal(np.unpackbits(m.written.reshape(-1), bitorder="little").astype(bool), ref)
    starts, lens = _union(np.array([0, 3, 5, 20, 30]), np.array([4, 5, 9, 20, 31]))  # overlap, touch, empty, apart
    assert starts.tolist() == [0, 20, 30] and lens.tolist() == [9, 0, 1]


def test_an_exchange_scanned_in_one_pass_is_judged_as_numpys_passes_judge_it(monkeypatch):
    """moves.scan_rows (the compiled one-pass check of an exchange's sorted rows) against the NumPy passes: the same
    error for overlapping destinations or a source another row writes, else the same source and destination bytes
    for the written map, on random rows (overlapping, touching, empty) over three tiles."""
    from tremula.numerics import jit
    from tremula.sim.functional import SimCheckError

    if jit.numba is None:
        pytest.skip("numba is not installed (pip install tremula[fast])")
    m = Machine.__new__(Machine)
    m.size = 256

    def judged(enabled, src, dst_t, dst_a, nb):
        monkeypatch.setattr(jit, "ENABLED", enabled)
        try:
            ranges = m._check_exchange(0, src, dst_t, dst_a, nb)
        except SimCheckError as e:
            return str(e)
        return [sorted({b for a, n in zip(*r) for b in range(int(a), int(a + n))}) for r in ranges]

    rng = np.random.default_rng(9)
    seen = set()
    for _ in range(400):
        ns, nd = int(rng.integers(0, 5)), int(rng.integers(1, 6))
        src = (rng.integers(0, 3, ns), rng.integers(0, 200, ns), rng.integers(0, 40, ns))
        dst_t, dst_a, nb = rng.integers(0, 3, nd), rng.integers(0, 200, nd), rng.integers(0, 40, nd)
        want = judged(False, src, dst_t, dst_a, nb)
        assert judged(True, src, dst_t, dst_a, nb) == want
        seen.add(want.split(":")[1][:12] if isinstance(want, str) else "ok")
    assert seen == {"ok", " two transfe", " the exchang"}  # every outcome was met


def test_check_json_reports_simulation_seconds():
    import json
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "tremula", "check", "bert-tiny", "--chip", "c600", "--json"],
                       check=False, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["passed"] and isinstance(report["simulation_seconds"], float)

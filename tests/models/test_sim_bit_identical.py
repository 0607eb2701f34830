"""The vectorised simulator gives bit for bit what a plain execution of the Program gives: every vertex run alone on
its own operand bytes, every transfer's rows copied one by one to each destination. Pins the fast paths (stacked
codelets, multicast gathered once, FP8 accumulators in cache-sized blocks without per-group finite checks) to the
obvious meaning of the Program, in fp16 and fp8."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tremula.codelets import codelet
from tremula.codelets.fp8 import _BAD_CODES, FORMATS, amp_matmul_stack
from tremula.compiler import compile_model
from tremula.feeds import make_feeds
from tremula.numerics.fp8 import amp_fp8_matmul
from tremula.program import storage_dtype
from tremula.sim.functional import Machine, simulate
from tremula.target.chip import load_chip

TINY16 = "examples/chips/tiny16.toml"


def _plain(program, graph, feeds) -> dict[str, np.ndarray]:
    """The Program executed one vertex and one transfer row at a time (loading and read-back as the simulator's)."""
    m = Machine(program, check=False)
    m.load_weights(graph)
    m.host_in(feeds)
    mem = m.mem
    for step in program.steps:
        for g in step.compute:
            cl = codelet(g.codelet)
            outs = cl.written(len(g.dtypes))
            for i in range(len(g)):
                t, ops, spans = int(g.tiles[i]), [], []
                for a, dt in enumerate(g.dtypes):
                    r, c = (int(v) for v in g.shapes[i, a])
                    lo = int(g.addrs[i, a])
                    dt = storage_dtype(dt)  # FP8 operands are their code bytes in memory
                    hi = lo + r * c * dt.itemsize
                    ops.append(mem[t, lo:hi].copy().view(dt).reshape(r, c))
                    spans.append((lo, hi))
                cl.run(ops, g.params[i])
                for a in outs:
                    mem[t, spans[a][0]:spans[a][1]] = np.ascontiguousarray(ops[a]).reshape(-1).view(np.uint8)
        ex = step.exchange
        for j in range(len(ex)):
            tr = ex.transfer(j)
            for r in range(tr.rows):
                s = tr.src_addr + r * tr.src_stride
                row = mem[tr.src_tile, s: s + tr.row_bytes].copy()
                for d in tr.dsts:
                    a = d.addr + r * d.stride
                    mem[d.tile, a: a + tr.row_bytes] = row
    return m.host_out()


def _fp8_tiny16():
    c600, tiny = load_chip("c600"), load_chip(TINY16)
    return dataclasses.replace(tiny, name="tiny16-fp8", amp=tiny.amp + (c600.amp_pair("fp8", "fp16"),))


@pytest.mark.parametrize("model,dtype,batch", [("bert-tiny", "fp16", 2), ("vit-tiny", "fp16", 2),
                                               ("vit-tiny", "fp8", 4), ("minilm-tiny", "fp8", 2)])
def test_simulator_matches_plain_execution_bit_for_bit(model, dtype, batch):
    chip = _fp8_tiny16() if dtype == "fp8" else load_chip(TINY16)
    res = compile_model(model, chip, batch, dtype)
    feeds = make_feeds(res.graph, seed=3)
    got = simulate(res.program, res.graph, feeds)
    want = _plain(res.program, res.graph, feeds)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k


@pytest.mark.parametrize("model,dtype,batch", [("bert-tiny", "fp16", 2), ("vit-tiny", "fp8", 4)])
def test_compiled_kernels_give_numpys_bits_on_whole_models(model, dtype, batch, monkeypatch):
    """numerics/jit.py's one-pass kernels against NumPy's passes, on every step of a whole simulated model."""
    from tremula.numerics import jit

    if jit.numba is None:
        pytest.skip("numba is not installed (pip install tremula[fast]): the compiled kernels are not there to test")
    chip = _fp8_tiny16() if dtype == "fp8" else load_chip(TINY16)
    res = compile_model(model, chip, batch, dtype)
    feeds = make_feeds(res.graph, seed=4)
    runs = []
    for enabled in (True, False):
        monkeypatch.setattr(jit, "ENABLED", enabled)
        runs.append(simulate(res.program, res.graph, feeds))
    for k in runs[1]:
        assert runs[0][k].tobytes() == runs[1][k].tobytes(), k


@pytest.mark.parametrize("nan", [False, True])
def test_amp_matmul_stack_is_the_reference_per_vertex(nan):
    """The stacked, blocked FP8 accumulation against numerics' amp_fp8_matmul on each vertex alone, with and without
    NaN codes (which take the half-cast path)."""
    rng = np.random.default_rng(7)
    n, m, k, n2, group = 300, 5, 96, 24, 32  # 300 vertices: more than one accumulator block
    xf, wf = FORMATS
    x = rng.integers(0, 256, (n, m, k), dtype=np.uint8)
    w = rng.integers(0, 256, (n, k, n2), dtype=np.uint8)
    for codes, f in ((x, xf), (w, wf)):  # no NaN codes unless asked for
        bad = np.isin(codes, _BAD_CODES[f])
        codes[bad] = 1
    if nan:
        x[3, 1, 2] = _BAD_CODES[xf][0]
    w_scale = rng.integers(-3, 3, n).astype(np.int8)
    got = amp_matmul_stack(x, w, xf, wf, -2, w_scale[:, None, None], group)
    for i in range(n):
        want = amp_fp8_matmul(x[i], w[i], xf, wf, -2, int(w_scale[i]), group)
        assert np.asarray(want, np.float32).tobytes() == got[i].tobytes(), i

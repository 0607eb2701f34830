"""Reference matmuls by row blocks (ir/blocked.py): the values are each block's own BLAS call, whatever the number
of threads that run them, and the FP8 calibration's scales do not change with its threads."""

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from tremula.frontends import load_model
from tremula.fp8_calibration import fp8_scales
from tremula.ir.blocked import ROWS, BlockedMatmuls
from tremula.ir.graph import Node
from tremula.ir.ops import rule


@pytest.mark.parametrize("op,shape", [("Linear", (3, ROWS // 2 + 7, 96)), ("MatMul", (2 * ROWS + 5, 96))])
def test_blocks_on_any_number_of_threads(op, shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, np.float32)
    args = [x, rng.standard_normal((96, 200), np.float32)] + ([rng.standard_normal(200, np.float32)] if op == "Linear"
                                                              else [])
    node = Node(op, ["x", "w"] + (["b"] if op == "Linear" else []), ["y"], {}, "n")
    outs = []
    with threadpool_limits(1):
        for threads in (1, 2, 3):
            m = BlockedMatmuls(lambda t=threads: t)
            outs.append(m(node)(args, {})[0])
            m.close()
        rows = x.reshape(-1, 96)
        blocks = [rule(op).ref([rows[i: i + ROWS], *args[1:]], {})[0] for i in range(0, len(rows), ROWS)]
    want = np.concatenate(blocks).reshape(*shape[:-1], 200)
    for y in outs:
        assert y.shape == want.shape and np.array_equal(y, want)


def test_other_ops_and_batched_right_operands_keep_their_rule():
    m = BlockedMatmuls(lambda: 2)
    assert m(Node("Add", ["a", "b"], ["c"], {}, "n")) is None
    x, w = np.ones((2, 3, 4), np.float32), np.ones((2, 4, 5), np.float32)
    y = m(Node("MatMul", ["x", "w"], ["y"], {}, "n"))([x, w], {})[0]
    assert np.array_equal(y, np.matmul(x, w))


def test_calibration_scales_do_not_depend_on_threads(monkeypatch):
    """The calibration runs its graph with the blocked matmuls, on the threads it is given, with BLAS on one thread
    (the tiny model's products are too small for BLAS's threads to change a bit, so the run is checked too)."""
    from threadpoolctl import threadpool_info

    import tremula.passes.precision as precision

    seen = []
    real = precision.run

    def run(graph, feeds, override=None, observe=None):
        blas = {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}
        seen.append((type(override), override.threads(), blas))
        return real(graph, feeds, override=override, observe=observe)

    monkeypatch.setattr(precision, "run", run)
    g = load_model("vit-tiny", 4)
    one = fp8_scales(g, threads=lambda: 1)
    assert one and fp8_scales(g, threads=lambda: 2) == one
    assert seen == [(BlockedMatmuls, 1, {1}), (BlockedMatmuls, 2, {1})]


@pytest.mark.parametrize("mask_shape", [None, (3, 1, 1, 40), (1, 1, 1, 40), (40,)])
def test_attention_by_sample_is_the_whole_batch(mask_shape):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((3, 2, 40, 16), np.float32) for _ in range(3))
    args = [q, k, v] + ([rng.standard_normal(mask_shape, np.float32)] if mask_shape else [])
    node = Node("Attention", ["q", "k", "v"] + (["m"] if mask_shape else []), ["y"], {"scale": 0.25}, "n")
    with threadpool_limits(1):
        want = rule("Attention").ref(args, {"scale": 0.25})[0]
        for threads in (1, 2):
            m = BlockedMatmuls(lambda t=threads: t)
            y = m(node)(args, {"scale": 0.25})[0]
            m.close()
            assert np.array_equal(y, want)


def test_the_calibration_makes_its_seeded_weights_ahead_only_on_a_second_core(monkeypatch):
    """While threads() is 1 (the planner beside holds the other core) no weight is made ahead of the interpreter;
    from two threads on, a thread of its own makes them in the order the graph reads them, each once, and the scales
    are the ones one thread gives."""
    import threading
    import time

    from tremula.ir.graph import LazyInit
    from tremula.passes.precision import _Prefetch

    g = load_model("vit-tiny", 4)
    lazy = [c for c in g.constants.values() if isinstance(c.init, LazyInit)]
    assert lazy
    waiting = _Prefetch(g, lambda: 1)
    time.sleep(0.3)
    waiting.close()
    assert all(c.is_lazy for c in lazy)

    made, real = [], LazyInit._make
    lock = threading.Lock()

    def counted(self, ttype):
        with lock:
            made.append((self, ttype.shape))
        return real(self, ttype)

    monkeypatch.setattr(LazyInit, "_make", counted)
    scales = fp8_scales(g, threads=lambda: 2)
    assert not any(c.is_lazy for c in lazy) and len(made) == len(set(made))  # (each made once, by either thread)
    monkeypatch.undo()
    assert fp8_scales(load_model("vit-tiny", 4), threads=lambda: 1) == scales


def test_two_threads_asking_for_one_lazy_constant_get_one_array():
    import threading

    from tremula.ir.graph import Constant, LazyInit, TensorType

    c = Constant("w", TensorType((512, 512), "float32"), init=LazyInit("normal", seed=12345, std=0.5))
    got = []
    threads = [threading.Thread(target=lambda: got.append(c.value())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(x is got[0] for x in got) and not c.is_lazy

"""Functional simulator speed: seconds to simulate one forward against onnxruntime (one thread) on the same Graph.

The Graph is the one the Program was compiled from (in the program's precision: float16 tensors for fp16, the FP8
casts and quarter matmuls for fp8), exported with tremula.export and run by onnxruntime on one thread. The simulator
time is one `simulate` call in check mode (weights loaded into tile memory, inputs streamed, every step, outputs
read back), as `check` runs it; onnxruntime's is the best of three runs after a warm-up. Neither side counts
compiling, building the session, loading the simulator's compiled kernels (numba's cache, about 2 s once a process:
a tiny model is simulated in each dtype first) or generating the zoo model's seeded weights (made once before
timing). Times are CPU seconds of this process (both sides run on one thread), so other work on a shared machine
does not skew the ratio; wall seconds of the simulator are printed beside them, and "(sys)" is the part of its CPU
seconds spent in the kernel: mostly faulting in the fresh pages that hold the tiles' memory and the large stacked
operands. The simulator turns NumPy's huge-page advice off while it runs (sim/functional._small_pages): with it,
the kernel's search for huge pages on those faults took 1-3 s of a first simulation on the virtual machines this was
measured on. "exch MB" and "vx MB" are the bytes the Program's exchanges write and its vertices read and
write in one forward: the simulator copies each of them at least once, so GB/s (their sum over simulator seconds)
says how close it runs to that floor, and a plan that moves less simulates faster.

Usage: python benchmarks/sim_speed.py [--models vit-base-patch16-224,bert-base-uncased] [--batches 1,8]
                                      [--dtypes fp32,fp16,fp8] [--chip c600]
"""

from __future__ import annotations

import argparse
import os
import resource
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # the simulator on one thread too (before NumPy loads BLAS)
import first_compile

first_compile.cache_off()

import numpy as np

from tremula.target.chip import load_chip
from tremula.compiler import compile_model
from tremula.feeds import make_feeds
from tremula.pipeline import canonical
from tremula.frontends import load_model
from tremula.sim.functional import simulate


def ort_seconds(graph, feeds: dict[str, np.ndarray], runs: int = 3) -> float:
    """Best CPU time of one onnxruntime run of the exported graph on one thread."""
    import onnxruntime as ort

    from tremula.export import export_onnx

    model = export_onnx(graph, opset=19)  # opset 19 for the FP8 types; the same ops otherwise
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    inputs = {i.name: feeds[i.name].astype(graph.types[i.name].dtype) for i in sess.get_inputs()}
    sess.run(None, inputs)
    best = float("inf")
    for _ in range(runs):
        t0 = time.process_time()
        sess.run(None, inputs)
        best = min(best, time.process_time() - t0)
    return best


def bytes_moved(program) -> tuple[int, int]:
    """(bytes the exchanges write, bytes the vertices read and write) in one forward: the copies the simulator must
    make however fast its kernels are (it holds every tile's memory as bytes)."""
    ex = comp = 0
    for s in program.steps:
        t = s.exchange
        if len(t):
            ex += int((t.rows * t.row_bytes * np.diff(t.dst_start)).sum())
        for g in s.compute:
            isz = np.array([np.dtype(d).itemsize for d in g.dtypes], np.int64)
            comp += int((g.shapes[:, :, 0] * g.shapes[:, :, 1] * isz).sum())
    return ex, comp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="vit-base-patch16-224,bert-base-uncased")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--dtypes", default="fp32,fp16,fp8")
    ap.add_argument("--chip", default="c600")
    args = ap.parse_args()
    chip = load_chip(args.chip)
    for dtype in args.dtypes.split(","):  # the simulator's kernels loaded, as onnxruntime's session is built
        tiny = compile_model("vit-tiny", chip, 1, dtype)
        simulate(tiny.program, tiny.graph, make_feeds(canonical(load_model("vit-tiny", 1)), 0))
    print(f"{'model':24} {'batch':>5} {'dtype':>5} {'steps':>6} {'vertices':>9} {'exch MB':>8} {'vx MB':>7} "
          f"{'sim s':>7} {'(sys)':>6} {'(wall)':>7} {'GB/s':>5} {'ort s':>6} {'sim/ort':>8}", flush=True)
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            feeds = make_feeds(canonical(load_model(model, batch)), 0)
            for dtype in args.dtypes.split(","):
                res = compile_model(model, chip, batch, dtype)
                for c in res.graph.constants.values():
                    c.value()  # the seeded weights are the model's, not the simulator's work
                t0, c0, r0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
                simulate(res.program, res.graph, feeds)
                wall, sim = time.perf_counter() - t0, time.process_time() - c0
                sys_s = resource.getrusage(resource.RUSAGE_SELF).ru_stime - r0.ru_stime
                ort_s = ort_seconds(res.graph, feeds)
                steps = len(res.program.steps)
                ex, vx = bytes_moved(res.program)
                print(f"{model:24} {batch:5d} {dtype:>5} {steps:6d} {res.program.n_vertices():9,d} {ex / 1e6:8,.0f} "
                      f"{vx / 1e6:7,.0f} {sim:7.2f} {sys_s:6.2f} {wall:7.2f} {(ex + vx) / sim / 1e9:5.1f} {ort_s:6.3f} "
                      f"{sim / ort_s:7.1f}x", flush=True)


if __name__ == "__main__":
    main()

"""The seed user's path (issue #14): SigLIP so400m exported from transformers with torch.onnx.export, then compiled,
beside the zoo model of the same architecture.

The model is built offline from its config (SiglipVisionModel, random weights: nothing downloads), exported with the
legacy exporter (opset 17, dynamic batch; last_hidden_state and pooler_output, as the user's export was) to a
temporary folder, and compiled with `compile_model(path, "c600", BATCH, DTYPE)`. The zoo model is compiled the same
way. Each row prints what the compile made: whether it fits, its cycles and samples/s, how many layers share code,
the compile's wall time, and the peak host memory of the process that compiled it (each compile runs in a process of
its own, so one's memory does not hide the other's; the FP8 calibration's forked process beside it is not counted).
The export's plan is the zoo model's when its steps and cycles are; at fp8 each model has its own calibrated scales
(on its own weights), and a shared layer's call patches the scale fields that differ from its template's, so their
cycles may differ by those patches (measured: 456 of 38.2 M at batch 8).

Needs torch and transformers (pip install -e .[torch]). Usage: python benchmarks/onnx_export.py [--batch 8]
[--dtype fp8] [--keep DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import tempfile
import time
import warnings
from pathlib import Path

import first_compile

first_compile.cache_off()

SO400M = dict(hidden_size=1152, num_hidden_layers=27, num_attention_heads=16, intermediate_size=4304, image_size=384,
              patch_size=14, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")


def export(path: Path) -> float:
    """The legacy export of a fresh so400m vision tower to `path`; its wall seconds."""
    import torch
    import transformers

    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(attn_implementation="eager", **SO400M))

    class Pooled(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, pixel_values):
            out = self.m(pixel_values=pixel_values)
            return out.last_hidden_state, out.pooler_output

    x = torch.randn(1, 3, SO400M["image_size"], SO400M["image_size"])
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(Pooled(model).eval(), (x,), str(path), input_names=["pixel_values"],
                          output_names=["last_hidden_state", "pooler_output"], dynamo=False, opset_version=17,
                          dynamic_axes={"pixel_values": {0: "batch"}})
    return time.perf_counter() - t0


def _compile(model: str, batch: int, dtype: str, out) -> None:
    from tremula.compiler import DoesNotFit, compile_model
    from tremula.target.chip import load_chip

    t0 = time.perf_counter()
    chip = load_chip("c600")
    try:
        r = compile_model(model, chip, batch, dtype)
        row = dict(fits=True, steps=r.steps, cycles=r.cycles, rate=batch * chip.clock_hz / r.throughput_cycles,
                   shared=r.shared_layers)
    except DoesNotFit as e:
        row = dict(fits=False, error=str(e).splitlines()[0])
    row["seconds"] = time.perf_counter() - t0
    row["rss_gb"] = peak_rss_gb()
    out.send(row)


def peak_rss_gb() -> float:
    """This process's peak resident memory: VmHWM where Linux gives it (ru_maxrss keeps the parent's peak across the
    exec that starts a spawned process: the export's, here), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1e6
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def compiled(model: str, batch: int, dtype: str) -> dict:
    """compile_model's answer for `model` in a process of its own (its peak memory is its own)."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_compile, args=(model, batch, dtype, send))
    p.start()
    row = receive.recv()
    p.join()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="fp8")
    ap.add_argument("--keep", help="export to this folder and keep the file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        path = folder / "so400m.onnx"
        if not path.exists():
            print(f"export: {export(path):.1f} s, {path.stat().st_size / 1e9:.2f} GB", flush=True)
        print(f"{'model':28} {'batch':>5} {'dtype':>5} {'fits':>4} {'steps':>6} {'cycles':>12} {'img/s':>7} "
              f"{'shared':>6} {'compile s':>9} {'RSS GB':>6}", flush=True)
        for name, model in (("legacy ONNX export", str(path)), ("zoo siglip-so400m-patch14-384",
                                                                 "siglip-so400m-patch14-384")):
            r = compiled(model, args.batch, args.dtype)
            if r["fits"]:
                print(f"{name:28} {args.batch:5d} {args.dtype:>5} {'yes':>4} {r['steps']:6,d} {r['cycles']:12,d} "
                      f"{r['rate']:7.1f} {r['shared']:6d} {r['seconds']:9.1f} {r['rss_gb']:6.1f}", flush=True)
            else:
                print(f"{name:28} {args.batch:5d} {args.dtype:>5} {'no':>4} {r['error']} ({r['seconds']:.1f} s, "
                      f"{r['rss_gb']:.1f} GB)", flush=True)


if __name__ == "__main__":
    main()

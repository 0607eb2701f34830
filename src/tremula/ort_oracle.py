"""onnxruntime on the user's inputs: the original ONNX file as a second oracle for `check --inputs`.

The reference interpreter is tremula's own reading of the model; onnxruntime reads the file independently, so an
import mistake shows here even when the simulator and the reference agree. ORT runs the original file at its own batch:
when the program was rebatched (the file fixes batch F, the program runs B, a multiple of F), it runs the file B / F
times on consecutive F-sample slices and joins the outputs, which is what rebatching claims to be equivalent to
(frontends/rebatch.py); a B that F does not divide is reported as not compared, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
              "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}


@dataclass
class OrtRun:
    """onnxruntime's outputs on the inputs (None when it could not be compared) and how it ran, or why not."""

    outputs: dict[str, np.ndarray] | None
    note: str


def is_onnx_file(model: object) -> bool:
    """Whether load_model reads `model` as an ONNX file (a zoo name wins over a file of that name, as there)."""
    if not isinstance(model, str):
        return False
    from tremula.frontends.zoo import zoo_choice

    return zoo_choice(model) is None and Path(model).is_file()


def run_ort(path: str, feeds: dict[str, np.ndarray], batch: int) -> OrtRun:
    """ORT's outputs for `feeds` (the program's inputs at `batch`) from the ONNX file at `path`."""
    try:
        import onnxruntime as ort
    except ImportError:
        return OrtRun(None, "onnxruntime is not installed")
    from tremula.frontends.onnx_import import fixed_batch

    fixed = fixed_batch(path)
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3  # its warnings are not the user's business here
        sess = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # a file tremula imports but ORT does not: say so, compare nothing
        return OrtRun(None, f"onnxruntime cannot load {path}: {_first_line(e)}")
    names = [i.name for i in sess.get_inputs()]
    absent = [n for n in names if n not in feeds]
    if absent:
        return OrtRun(None, f"the file takes input(s) {', '.join(map(repr, absent))} that the program does not")
    types = {i.name: _ORT_TYPES.get(i.type) for i in sess.get_inputs()}
    if fixed is None or fixed == batch:
        slices, note = [(0, batch)], f"onnxruntime on {path}"
    elif batch % fixed == 0:
        slices = [(i, i + fixed) for i in range(0, batch, fixed)]
        note = (f"onnxruntime on {path}, which fixes batch {fixed}, run {len(slices)} times on consecutive "
                f"{fixed}-sample slices (the program was rebatched to {batch})")
    else:
        return OrtRun(None, f"{path} fixes batch {fixed} and the program runs batch {batch}, which {fixed} does not "
                            "divide: onnxruntime cannot run the original file on these inputs")
    parts: list[list[np.ndarray]] = []
    out_names = [o.name for o in sess.get_outputs()]
    try:
        for lo, hi in slices:
            feed = {n: np.ascontiguousarray(feeds[n][lo:hi]).astype(types[n] or feeds[n].dtype) for n in names}
            parts.append(sess.run(out_names, feed))
    except Exception as e:
        return OrtRun(None, f"onnxruntime failed on these inputs: {_first_line(e)}")
    if len(slices) > 1 and any(np.ndim(p[k]) == 0 or np.shape(p[k])[0] != fixed for p in parts
                               for k in range(len(out_names))):
        return OrtRun(None, f"{path} has an output without its batch of {fixed} first: its slices cannot be joined")
    outs = {n: (parts[0][k] if len(parts) == 1 else np.concatenate([p[k] for p in parts])) for k, n in
            enumerate(out_names)}
    return OrtRun(outs, note)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__

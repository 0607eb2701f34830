"""The user's arrays for `check --inputs/--expected` and `run --inputs`, checked against the model in one-line errors.

The CLI reads the files as data (cli._arrays_file: numeric .npy/.npz only, whole, within the host's memory); here they
meet the model: names (every input, no unknown one), shapes (the batch first, the same in every input; every other
dimension the model's), then values (the input's kind of number, finite, token ids inside their table), and for
expected outputs: known names, the outputs' exact shapes, no NaN. A key '' is an .npy file: the model's only input
(or only output).
"""

from __future__ import annotations

import numpy as np

from tremula.errors import TremulaError
from tremula.ir.graph import Graph


def _named(names: list[str], arrays: dict[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
    """`arrays` with an .npy file's '' key given the only name there is."""
    if "" not in arrays:
        return arrays
    if len(names) != 1:
        raise TremulaError(f"the model has {what}s {', '.join(names)}: give them as an .npz with one array per "
                           f"{what} name")
    return {names[0]: arrays[""]}


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def input_batch(graph: Graph, arrays: dict[str, np.ndarray]) -> int:
    """The batch the user's inputs hold, refused unless they name exactly the model's inputs and every one is that
    many samples of the model's sample shape (`graph` at any batch; only the dimensions after the first count)."""
    arrays = _named(list(graph.inputs), arrays, "input")
    missing = [n for n in graph.inputs if n not in arrays]
    unknown = sorted(set(arrays) - set(graph.inputs))
    if missing or unknown:
        parts = ([f"missing {', '.join(map(repr, missing))}"] if missing else []) + \
                ([f"unknown {', '.join(map(repr, unknown))}"] if unknown else [])
        raise TremulaError(f"inputs do not match the model's: {'; '.join(parts)} (the model takes "
                           f"{', '.join(map(repr, graph.inputs))})")
    counts = {}
    for name in graph.inputs:
        arr, model = np.asarray(arrays[name]), graph.types[name].shape
        if not model:
            raise TremulaError(f"input {name!r} is a scalar in the model: --inputs needs a batch dimension first")
        if arr.ndim != len(model) or tuple(arr.shape[1:]) != tuple(model[1:]):
            raise TremulaError(f"input {name!r} has shape {_shape(arr.shape)}, the model takes "
                               f"[{', '.join(['N', *map(str, model[1:])])}] (N samples)")
        if arr.size == 0:
            raise TremulaError(f"input {name!r} is empty (shape {_shape(arr.shape)}): give at least one sample")
        counts[name] = len(arr)
    if len(set(counts.values())) > 1:
        raise TremulaError("inputs hold different numbers of samples: "
                           f"{', '.join(f'{k} {v}' for k, v in counts.items())}")
    return next(iter(counts.values()))


def input_feeds(graph: Graph, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs as feeds for canonical `graph` (at their batch): exact shapes, then values as the model takes them
    (fp8_calibration.calibration_values: the input's kind of number, finite, token ids inside their table)."""
    from tremula.fp8_calibration import calibration_values

    arrays = _named(list(graph.inputs), arrays, "input")
    input_batch(graph, arrays)  # names and sample shapes first, with their own messages
    for name in graph.inputs:
        arr, model = np.asarray(arrays[name]), tuple(graph.types[name].shape)
        if tuple(arr.shape) != model:
            raise TremulaError(f"input {name!r} has shape {_shape(arr.shape)}, the program takes {_shape(model)}")
    return calibration_values(graph, {n: np.asarray(arrays[n]) for n in graph.inputs}, what="input")


def expected_outputs(graph: Graph, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The user's expected outputs for `graph` (at the batch checked): each a model output (some may be left out)
    of its exact shape, numbers without NaN (an infinity is a value the output must also have)."""
    arrays = _named(list(graph.outputs), arrays, "output")
    unknown = sorted(set(arrays) - set(graph.outputs))
    if unknown:
        raise TremulaError(f"expected outputs {', '.join(map(repr, unknown))} are not outputs of the model (it has "
                           f"{', '.join(map(repr, graph.outputs))})")
    if not arrays:
        raise TremulaError("expected outputs hold no array")
    out = {}
    for name in graph.outputs:
        if name not in arrays:
            continue
        arr, model = np.asarray(arrays[name]), tuple(graph.types[name].shape)
        if tuple(arr.shape) != model:
            raise TremulaError(f"expected output {name!r} has shape {_shape(arr.shape)}, the model gives "
                               f"{_shape(model)}")
        if arr.dtype.kind not in "biuf":
            raise TremulaError(f"expected output {name!r} holds {arr.dtype} values; give numbers")
        nan = np.isnan(arr) if arr.dtype.kind == "f" else np.zeros(arr.shape, bool)
        if nan.any():
            first = [int(i) for i in np.argwhere(nan)[0]]
            raise TremulaError(f"expected output {name!r} holds {int(nan.sum()):,} NaN value(s) (the first at "
                               f"index {first}); no output can be compared with NaN")
        out[name] = arr
    return out

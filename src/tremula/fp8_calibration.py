"""FP8 activation scales: calibrated on seeded samples or on the user's arrays, each array checked before it is read."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from tremula import cache
from tremula.batch_search import refuse_oversize
from tremula.errors import TremulaError, notice
from tremula.feeds import index_tables, make_feeds
from tremula.frontends.rebatch import FixedBatch
from tremula.ir.graph import Graph, model_batch
from tremula.pipeline import canonical

CALIBRATION_SEED = 1  # seeded calibration inputs differ from check's inputs (seed 0): scales are not fit to the test
# Seeded samples calibrated together by default (max-abs over all of them). One sample set the scales of SigLIP's
# attention-pooling head too low for other inputs (siglip-tiny's pooler: cosine 0.987 at batch 8, seed 1, below the
# 0.99 bar); from four samples on the scales stopped changing.
CALIBRATION_SAMPLES = 4
SCALES_ENTRY, SCALES_VERSION = "fp8-scales", 1  # the cache's entries of calibrated scales (cache.py)


def fp8_scales(graph: Graph, feeds: dict[str, np.ndarray] | None = None,
               threads: Callable[[], int] | None = None) -> dict[str, int]:
    """Activation scales for the fp8 policy, calibrated on `feeds` (seeded inputs when None), in float32 on
    threads() threads (all usable cores when None; the scales do not depend on it:
    passes/precision.calibration_scales)."""
    from tremula.passes.precision import calibration_scales, fp8_linear_casts

    g = fp8_linear_casts(canonical(graph))
    return calibration_scales(g, feeds if feeds is not None else make_feeds(g, CALIBRATION_SEED), threads)


def calibrate(build, graph: Graph | None, calibration: dict[str, np.ndarray] | None, chip) -> dict[str, int]:
    """Scales from the user's inputs or from CALIBRATION_SAMPLES seeded samples (calibration_job, run now)."""
    return calibration_job(build, graph, calibration, chip)()


def calibration_job(build, graph: Graph | None, calibration: dict[str, np.ndarray] | None, chip
                    ) -> Callable[..., dict[str, int]]:
    """What `calibrate` computes, as a function to run later (compile's --batch auto runs it beside the batch
    search; it takes fp8_scales's `threads`), with everything that can refuse the user's inputs done now: the user's
    arrays are checked against the model at its own batch first (names, shapes, samples), then the model at their
    number of samples against the host's memory (types only), and only then are their values read (kinds,
    finiteness, ids). Scales an earlier run stored for the same model, inputs and code come back as a Stored job
    (cache.py), which computes nothing."""
    if not calibration:
        if build is None:
            assert graph is not None
            return _cached(graph, None)
        try:
            g = build(CALIBRATION_SAMPLES)
        except FixedBatch:  # a fixed batch that cannot be rebatched: its own samples
            g = build(None)
        return _cached(g, None)
    small = graph if build is None else build(None)
    assert small is not None
    arrays, n = _calibration_arrays(small, calibration)
    if n == model_batch(small):
        g = small
    elif build is None:
        raise TremulaError(f"calibration inputs hold {n} samples; this graph was built for {model_batch(small)}: "
                           "give that many")
    else:
        try:
            g = build(n)
        except FixedBatch as e:
            raise TremulaError(f"calibration inputs hold {n} samples, and the model cannot take them: {e}") from None
    refuse_oversize(build, g, chip, "float32", what=f"calibrating {g.name} on {n} samples", host_only=True)
    feeds = calibration_values(canonical(small), arrays)
    return _cached(g, feeds)


class Stored:
    """A calibration job (calibration_job's) with nothing left to compute: the scales an earlier run stored."""

    def __init__(self, scales: dict[str, int]):
        self.scales = scales

    def __call__(self, threads: Callable[[], int] | None = None) -> dict[str, int]:
        return dict(self.scales)


def _cached(g: Graph, feeds: dict[str, np.ndarray] | None) -> Callable[..., dict[str, int]]:
    """The calibration of graph g on `feeds` (None: CALIBRATION_SEED's samples) as a job (calibration_job's): the
    scales a run before stored for the same model, inputs and code (cache.py), told in a notice, else a job that
    calibrates and stores them."""
    k = cache.key(SCALES_ENTRY, SCALES_VERSION, g, {"seed": CALIBRATION_SEED} if feeds is None else {"feeds": feeds})
    hit = cache.load(SCALES_ENTRY, k)
    scales = hit.get("scales") if hit is not None else None
    if isinstance(scales, dict) and all(isinstance(v, int) for v in scales.values()):
        took = hit.get("seconds")  # (told only: an entry's other fields are not trusted to be numbers)
        took = f" in {took:.1f} s" if isinstance(took, (int, float)) else ""
        notice(f"FP8 scales from the cache (calibrated on {hit.get('samples', '?')} samples{took} by an earlier run: "
               f"{cache.cache_dir()}; {cache.ENV}=off calibrates again)")
        return Stored(scales)

    def job(threads=None) -> dict[str, int]:
        t0 = time.perf_counter()
        made = fp8_scales(g, feeds, threads)
        samples = (model_batch(g) or "?") if feeds is None else len(next(iter(feeds.values())))
        cache.store(SCALES_ENTRY, k, {"scales": made, "samples": samples, "seconds": round(time.perf_counter() - t0, 2),
                                      "graph": g.name})
        return made

    return job


def _calibration_arrays(g: Graph, calibration: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
    """The user's calibration arrays by input name and their number of samples, refused (naming the input) unless
    every one is a non-empty batch of the model's samples."""
    if "" in calibration:  # an .npy file: the model's only input
        if len(g.inputs) != 1:
            raise TremulaError(f"the model has inputs {', '.join(g.inputs)}: give calibration inputs as an .npz "
                               "with one array per input name")
        calibration = {g.inputs[0]: calibration[""]}
    if set(calibration) != set(g.inputs):
        raise TremulaError(f"calibration inputs {sorted(calibration)} do not match the model's inputs "
                           f"{sorted(g.inputs)}")
    arrays: dict[str, np.ndarray] = {}
    for name in g.inputs:
        arr = np.asarray(calibration[name])
        rest = list(g.types[name].shape[1:])
        if arr.ndim != len(rest) + 1 or list(arr.shape[1:]) != rest:
            raise TremulaError(f"calibration input {name!r} has shape {list(arr.shape)}, the model takes "
                               f"[{', '.join(['N', *map(str, rest)])}] (N samples)")
        if arr.size == 0:
            raise TremulaError(f"calibration input {name!r} is empty (shape {list(arr.shape)}): give at least one "
                               "sample")
        arrays[name] = arr
    counts = {len(v) for v in arrays.values()}
    if len(counts) > 1:
        raise TremulaError("calibration inputs hold different numbers of samples: "
                           f"{', '.join(f'{k} {len(v)}' for k, v in arrays.items())}")
    return arrays, counts.pop()


def calibration_values(g: Graph, arrays: dict[str, np.ndarray], what: str = "calibration input"
                        ) -> dict[str, np.ndarray]:
    """The arrays in the model's input dtypes, refused (naming the input) unless of the right kind of number,
    finite, and (token ids, by the tables of canonical graph `g`) within the vocabulary: a NaN poisons every scale
    after it and a negative id would silently wrap around."""
    tables = index_tables(g)
    feeds: dict[str, np.ndarray] = {}
    for name, arr in arrays.items():
        t = g.types[name]
        kind = arr.dtype.kind
        if t.dtype.startswith("float"):
            if kind not in "biuf":
                raise TremulaError(f"{what} {name!r} holds {arr.dtype} values; the model takes {t.dtype}")
            arr = arr.astype(t.dtype)
            bad = ~np.isfinite(arr)
            if bad.any():
                first = [int(i) for i in np.argwhere(bad)[0]]
                raise TremulaError(f"{what} {name!r} holds {int(bad.sum()):,} NaN or infinite value(s) "
                                   f"(the first at index {first}); {what}s must be finite numbers")
        else:
            if kind not in "biu":
                ints = "token ids" if name in tables else "integers"
                raise TremulaError(f"{what} {name!r} holds {arr.dtype} values; the model takes "
                                   f"{t.dtype} ({ints}): save integers")
            lo, hi = int(arr.min()), int(arr.max())
            vocab = tables.get(name)
            if vocab is not None and (lo < 0 or hi >= vocab):
                raise TremulaError(f"{what} {name!r} holds ids from {lo} to {hi}, outside [0, {vocab}) "
                                   f"of the {vocab}-row table it indexes")
            if t.dtype != "bool" and not (np.iinfo(t.dtype).min <= lo and hi <= np.iinfo(t.dtype).max):
                raise TremulaError(f"{what} {name!r} holds values from {lo} to {hi}, outside "
                                   f"{t.dtype}'s range")
            arr = arr.astype(t.dtype)
        feeds[name] = arr
    return feeds

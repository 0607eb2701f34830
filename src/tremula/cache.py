"""Results kept on disk between runs, keyed by everything they are computed from: FP8 scales, plans, --batch auto.

Three results take most of a compile's time and are pure functions of its inputs, so a second compile or check with
the same inputs takes them from here (as TensorRT keeps an INT8 calibration cache and JAX a compilation cache), and a
note says so:
- "fp8-scales" (fp8_calibration.py): the FP8 activation scales. Calibrating runs the model in float32 on four samples,
  the longest part of an FP8 compile of a large model (SigLIP so400m: 2.4 TFLOP, about 27 s on two cores).
- "plans" (compiler._grown_plan): the Recipe (plan/plan.py: the few choices a plan is lowered from) of the plan a
  compile at a fixed batch grew, after trying budgets and growth steps; lowered once from it, the plan is the same.
- "batch-auto" (compiler._auto): --batch auto's answer (the batch, the largest, the rates) and its plan's Recipe.
Each also keys the chip (every constant of it), the options (dtype, partials, weights; the FP8 scales a plan was
lowered with) and, for --batch auto, the host's memory, which bounds the batches it plans.

The key is a sha256 over: what the entry is and its format version; tremula's own source files (every .py of the
package, so any change to the code makes new keys); the NumPy, ml_dtypes and BLAS versions that computed it; the
graph (inputs, outputs, every node's op, operands and attributes, every value's type) and each constant's values,
named by how they are made when lazy (a zoo model's seeded initialisers: kind, seed, mean, std, type) and by their
bytes otherwise; and the calibration inputs (seeded: their seed; the user's: their bytes). A graph with
a constant that cannot be named without computing it (one derived from another by a function) has no key and is
not cached.

Where: $TREMULA_CACHE_DIR, else $XDG_CACHE_HOME/tremula, else ~/.cache/tremula; TREMULA_CACHE_DIR set to "" or "off"
turns the cache off (the test suite and the benchmarks that time compiles do). An entry is a small JSON file written
whole (to a temporary file, then renamed), so a reader never sees half of one; an entry that cannot be read or
written is a miss, never an error: the cache only saves time. Entries take a few KB each and are never evicted
(a new tremula makes new keys and leaves the old entries unread): delete the folder to empty it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from tremula.ir.array_memo import ArrayMemo
from tremula.ir.graph import Graph, LazyInit

ENV = "TREMULA_CACHE_DIR"


def cache_dir() -> Path | None:
    """The cache's folder, or None when the cache is off."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "off") else Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "tremula"


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """sha256 over tremula's .py files (relative path and bytes, in path order) and the versions of the libraries
    whose arithmetic the cached results depend on."""
    import ml_dtypes

    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(f"numpy {np.__version__}\0ml_dtypes {ml_dtypes.__version__}\0".encode())
    try:
        from threadpoolctl import threadpool_info

        for lib in sorted(threadpool_info(), key=lambda d: str(d.get("filepath"))):
            if lib.get("user_api") == "blas":
                h.update(f"{lib.get('internal_api')} {lib.get('version')} {lib.get('architecture')}\0".encode())
    except Exception:  # pragma: no cover - threadpoolctl is a dependency; its report is best effort
        pass
    return h.hexdigest()


def _value(h, v: Any) -> None:
    """An attribute value into the hash, by kind (the repr of a float is exact, and of a str unambiguous)."""
    if isinstance(v, np.ndarray):
        a = np.ascontiguousarray(v)
        h.update(f"nd {a.dtype.str} {a.shape}\0".encode())
        h.update(memoryview(a.reshape(-1).view(np.uint8)))
    elif isinstance(v, (list, tuple)):
        h.update(f"{type(v).__name__} {len(v)}\0".encode())
        for x in v:
            _value(h, x)
    elif isinstance(v, dict):
        h.update(f"dict {len(v)}\0".encode())
        for k in sorted(v, key=repr):
            _value(h, k)
            _value(h, v[k])
    else:
        h.update(f"{type(v).__name__} {v!r}\0".encode())


_DIGESTS = ArrayMemo()  # a read-only array's digest (_array_digest)


def _array_digest(a: np.ndarray) -> str:
    """sha256 of an array's dtype, shape and bytes; a read-only array's is kept while it lives (ArrayMemo), so the
    graphs of one compile that share a model file's weights hash them once (an FP8 compile keys its scales on the
    calibration's graph and its plan on the compiled one: SigLIP so400m's 1.7 GB export, 0.85 s a hash)."""

    def digest(a: np.ndarray) -> str:
        h = hashlib.sha256()
        _value(h, a)
        return h.hexdigest()

    return _DIGESTS.get(a, digest)


def graph_key(h, graph: Graph) -> bool:
    """Feed the graph's structure and its constants' values (named as the module doc says) into hash `h`; False when
    a constant cannot be named without computing it."""
    h.update(f"inputs {graph.inputs}\0outputs {graph.outputs}\0".encode())
    for n in graph.nodes:
        h.update(f"node {n.op} {n.name!r} {n.inputs} {n.outputs}\0".encode())
        _value(h, dict(n.attrs))
    for name in sorted(graph.types):
        t = graph.types[name]
        h.update(f"type {name!r} {t.shape} {t.dtype}\0".encode())
    for name in sorted(graph.constants):
        c = graph.constants[name]
        if c.data is not None:
            h.update(f"const {name!r} data {_array_digest(c.data)}\0".encode())
        elif isinstance(c.init, LazyInit):
            h.update(f"const {name!r} lazy {c.init!r}\0".encode())
        else:
            return False
    return True


def graph_digest(graph: Graph) -> str | None:
    """graph_key's sha256 of the graph, or None when the cache is off or a constant cannot be named. Taken before
    anything makes the weights of a seeded graph (a made constant is named by its bytes, not by how it was made)."""
    if cache_dir() is None:
        return None
    h = hashlib.sha256()
    return h.hexdigest() if graph_key(h, graph) else None


def key(what: str, version: int, graph: Graph | str | None, extra: dict[str, Any]) -> str | None:
    """The key of result `what` (format `version`) computed from `graph` (or its graph_digest) and `extra` (the other
    inputs), or None when the cache is off or the graph has no digest."""
    digest = graph_digest(graph) if isinstance(graph, Graph) else graph
    if digest is None or cache_dir() is None:
        return None
    h = hashlib.sha256(f"tremula cache {what} v{version}\0{code_fingerprint()}\0{digest}\0".encode())
    _value(h, extra)
    return h.hexdigest()


def load(what: str, k: str | None) -> dict | None:
    """The entry stored under key k, or None (no key, no entry, or one that cannot be read)."""
    root = cache_dir()
    if k is None or root is None:
        return None
    try:
        entry = json.loads((root / what / f"{k}.json").read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) and entry.get("key") == k else None


def store(what: str, k: str | None, entry: dict) -> Path | None:
    """Write entry under key k (whole, or not at all); its path, or None when it was not written."""
    root = cache_dir()
    if k is None or root is None:
        return None
    folder, tmp = root / what, None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": k, **entry}, f, indent=1, sort_keys=True)
        os.replace(tmp, folder / f"{k}.json")
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                Path(tmp).unlink(missing_ok=True)
        return None
    return folder / f"{k}.json"

"""Suite-wide settings. The README's test command runs on two pytest-xdist workers (pyproject's addopts, `-n 2`:
these machines have two cores); each worker then gets one BLAS and one OpenMP thread, since two workers each
spinning two threads on two cores run slower than either alone. Set before the workers start, so their NumPy,
onnxruntime and torch read it when they load. A serial run (`-n 0`) keeps every library's default.

xdist workers start with COLUMNS=80 in their environment; the CLI reads COLUMNS as the user's wish for a width, so a
worker drops it unless the run itself had it.

The cache of earlier runs' results is off for the whole suite (set at import, so the xdist workers inherit it)."""

import os

_NO_COLUMNS = "TREMULA_TESTS_WITHOUT_COLUMNS"
# Every test computes what it checks: no FP8 scales, plan or --batch auto answer from an earlier run's cache
# (src/tremula/cache.py), and nothing written to the user's cache. The cache's own tests point it at a folder of their
# own.
os.environ["TREMULA_CACHE_DIR"] = "off"


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        if os.environ.pop(_NO_COLUMNS, None):
            os.environ.pop("COLUMNS", None)
        return
    workers = getattr(config.option, "numprocesses", None)
    if workers and workers not in ("auto", "logical") and int(workers) > 1:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, "1")
        if "COLUMNS" not in os.environ:
            os.environ[_NO_COLUMNS] = "1"


def pytest_collection_modifyitems(config, items):
    """Tests marked slow first (each file's own order kept): the workers start on the long ones and the short ones
    fill in at the end (with pyproject's `--dist worksteal`), instead of one worker finishing a long test alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

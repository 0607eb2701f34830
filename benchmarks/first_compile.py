"""Every benchmark times its compiles as first compiles: nothing taken from an earlier run (src/tremula/cache.py: FP8
scales, plans, --batch auto answers), unless TREMULA_CACHE_DIR names a cache."""

import os


def cache_off() -> None:
    """Turn tremula's cache off for this process (call it before tremula reads it: before compiling)."""
    os.environ.setdefault("TREMULA_CACHE_DIR", "off")

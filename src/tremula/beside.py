"""A function run on a second thread while the caller goes on: check simulates beside its references, and
`compile --batch auto` plans beside the FP8 calibration (NumPy on large arrays releases the interpreter lock)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def beside(fn: Callable[..., Any], *args, name: str = "tremula-beside") -> Callable[[], Any]:
    """fn(*args) started on a second thread; returns a function that waits for its result (raising its error). The
    thread is a daemon: a command that fails ends without waiting for it."""
    box: dict = {}

    def work():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # (handed to the caller, who raises it)
            box["error"] = e

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()

    def result():
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    return result

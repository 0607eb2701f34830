"""A function run on a second thread while the caller goes on: check simulates beside its references, and
`compile --batch auto` plans beside the FP8 calibration (NumPy on large arrays releases the interpreter lock)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

# The interpreter's switch interval while a second thread runs (seconds; CPython's default is 0.005). Both threads
# make many short NumPy calls, each releasing the lock and taking it back; a thread coming back waits for the other to
# give it up, up to the interval when that one runs Python (the "convoy effect"). Measured on two cores, SigLIP
# so400m fp8 batch 1 `check`: the simulation beside its references took 62.0 s at the default, 56.1 s at 0.5 ms and
# 49.6 s at 0.1 ms (43.7 s alone); the whole check 113 -> 97 s (one run each; repeated runs on this virtual machine
# vary by up to a fifth: 49.6-60.7 s at 0.1 ms).
SWITCH_INTERVAL = 1e-4
_running: list[float] = []  # the interval before the first thread still running was started


def beside(fn: Callable[..., Any], *args, name: str = "tremula-beside") -> Callable[[], Any]:
    """fn(*args) started on a second thread; returns a function that waits for its result (raising its error). The
    thread is a daemon: a command that fails ends without waiting for it. While it runs, the interpreter switches
    threads every SWITCH_INTERVAL (restored when the last result is collected)."""
    box: dict = {}

    def work():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # (handed to the caller, who raises it)
            box["error"] = e

    _running.append(sys.getswitchinterval())
    sys.setswitchinterval(min(SWITCH_INTERVAL, _running[-1]))
    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    collected = False

    def result():
        nonlocal collected
        thread.join()
        if not collected:
            collected = True
            sys.setswitchinterval(_running.pop())  # (the last one collected restores the first one's)
        if "error" in box:
            raise box["error"]
        return box["value"]

    return result

"""A function run beside the caller, on a second thread or in a forked process: check simulates beside its
references, and `compile --batch auto` plans beside the FP8 calibration (both in a process where the platform can
fork: the caller keeps its own memory, the plans the search answers included, and the two share no interpreter
lock)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from tremula.errors import TremulaError

# The interpreter's switch interval while a second thread runs (seconds; CPython's default is 0.005). Both threads
# make many short NumPy calls, each releasing the lock and taking it back; a thread coming back waits for the other to
# give it up, up to the interval when that one runs Python (the "convoy effect"). Measured on two cores when SigLIP
# so400m fp8 batch 1's `check` ran its references on a thread (they run in a process now): the simulation beside them
# took 62.0 s at the default, 56.1 s at 0.5 ms and 49.6 s at 0.1 ms (43.7 s alone; repeated runs on this virtual
# machine vary by up to a fifth). It serves whatever runs on a thread where the platform cannot fork.
SWITCH_INTERVAL = 1e-4
_running: list[float] = []  # the interval before the first thread still running was started


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def can_fork() -> bool:
    """Whether beside(process=True) runs in a process (fork: the child starts with the caller's memory, copied on
    write, so nothing is pickled to start it); else it runs on a thread."""
    return "fork" in multiprocessing.get_all_start_methods()


def beside(fn: Callable[..., Any], *args, name: str = "tremula-beside", process: bool = False) -> Callable[[], Any]:
    """fn(*args) started on a second thread; returns a function that waits for its result (raising its error). The
    thread is a daemon: a command that fails ends without waiting for it. While it runs, the interpreter switches
    threads every SWITCH_INTERVAL (restored when the last result is collected).

    process=True (where the platform can fork): in a forked daemon process instead, its result (or error) pickled back
    through a pipe: the two share no interpreter lock. SigLIP so400m fp8's simulation took 43.7 s alone and 49.6-62 s
    beside its references on a thread. What fn changes in memory stays in the child.

    The function returned has a `cancel()`: a result no longer wanted is not waited for (a process is ended, a
    thread left to finish on its own); calling the function after it raises."""
    if process and can_fork():
        return _in_process(fn, args, name)
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
        if box.get("cancelled"):
            raise TremulaError(f"{name}: cancelled")
        thread.join()
        if not collected:
            collected = True
            sys.setswitchinterval(_running.pop())  # (the last one collected restores the first one's)
        if "error" in box:
            raise box["error"]
        return box["value"]

    def cancel():
        nonlocal collected
        box["cancelled"] = True
        if not collected:  # (its switch interval is restored now: nothing will collect it)
            collected = True
            sys.setswitchinterval(_running.pop())

    result.cancel = cancel  # type: ignore[attr-defined]
    return result


def _in_process(fn: Callable[..., Any], args: tuple, name: str) -> Callable[[], Any]:
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def work():
        try:
            out = ("value", fn(*args))
        except BaseException as e:  # (handed to the caller, who raises it)
            out = ("error", e)
        try:
            send.send(out)
        except Exception as e:  # a result or an error that does not pickle: say so instead
            send.send(("error", TremulaError(f"{name}: its {out[0]} could not be sent back: {type(e).__name__}: {e}")))

    proc = ctx.Process(target=work, name=name, daemon=True)
    proc.start()
    send.close()  # (the child's copy stays open: a child that dies closes it, and recv() then ends)
    box: dict = {}

    def result():
        if not box:
            try:
                kind, value = receive.recv()
            except EOFError:
                proc.join()
                box["error"] = TremulaError(f"{name}: the process ended without a result (exit code {proc.exitcode})")
            except Exception as e:  # (an error whose class cannot be rebuilt from its pickle)
                proc.join()
                box["error"] = TremulaError(f"{name}: its result could not be read back: {type(e).__name__}: {e}")
            else:
                box[kind] = value
                proc.join()
            receive.close()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def cancel():
        if not box:
            proc.terminate()
            proc.join()
            receive.close()
            box["error"] = TremulaError(f"{name}: cancelled")

    result.cancel = cancel  # type: ignore[attr-defined]
    return result

"""beside(): a function run on a second thread or in a forked process, its result or error handed back, the switch
interval restored."""

import os
import sys
import threading

import numpy as np
import pytest

from tremula.beside import SWITCH_INTERVAL, beside, can_fork
from tremula.errors import TremulaError


def test_result_error_and_switch_interval():
    before = sys.getswitchinterval()
    go = threading.Event()
    seen = []

    def work(x):
        seen.append(sys.getswitchinterval())
        assert go.wait(30)
        return x * 2

    def fail():
        raise ValueError("boom")

    a = beside(work, 21)
    b = beside(fail)
    go.set()
    with pytest.raises(ValueError, match="boom"):
        b()
    fine = pytest.approx(min(SWITCH_INTERVAL, before), abs=2e-6)  # (kept in whole microseconds)
    assert sys.getswitchinterval() == fine  # a still runs
    assert a() == 42 and a() == 42  # (collected twice: restored once)
    assert seen == [fine] and sys.getswitchinterval() == pytest.approx(before, abs=2e-6)


def _exit_now():
    os._exit(3)


@pytest.mark.skipif(not can_fork(), reason="beside(process=True) runs on a thread where the platform cannot fork")
def test_in_a_forked_process():
    seen = {"parent": 1}

    def work(x):
        seen["child"] = 2  # (stays in the child)
        return np.arange(x), os.getpid()

    def fail():
        raise TremulaError("no reference")

    values, pid = beside(work, 5, process=True)()
    assert values.tolist() == [0, 1, 2, 3, 4] and pid != os.getpid() and seen == {"parent": 1}
    with pytest.raises(TremulaError, match="no reference"):
        beside(fail, process=True)()
    with pytest.raises(TremulaError, match="could not be sent back"):
        beside(lambda: threading.Lock(), process=True)()  # (a lock does not pickle)
    with pytest.raises(TremulaError, match="ended without a result \\(exit code 3\\)"):
        beside(_exit_now, process=True)()
    assert sys.getswitchinterval() > SWITCH_INTERVAL  # a process takes no turns at this interpreter's lock


def _sleep_long():
    import time

    time.sleep(60)
    return "late"


@pytest.mark.parametrize("process", [False, True])
def test_a_result_no_longer_wanted_is_cancelled(process):
    """cancel(): a process is ended at once (not waited for), a thread left to finish; the result then raises, and the
    switch interval a thread set is restored."""
    import time

    before = sys.getswitchinterval()
    t = time.perf_counter()
    result = beside(_sleep_long if process else (lambda: "soon"), process=process)
    result.cancel()
    assert time.perf_counter() - t < 30  # (a process sleeping 60 s was not waited for)
    with pytest.raises(TremulaError, match="cancelled"):
        result()
    assert sys.getswitchinterval() == before
    done = beside(lambda: 7, process=process)
    assert done() == 7
    done.cancel()  # (after its result: nothing to end)

"""beside(): a function run on a second thread, its result or error handed back, the switch interval restored."""

import sys
import threading

import pytest

from tremula.beside import SWITCH_INTERVAL, beside


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

"""The simulator runs with NumPy's huge-page advice off (sim/functional._small_pages) and gives it back after,
also when the simulation fails."""

import pytest

from tremula.sim import functional


@pytest.mark.skipif(functional._SET_HUGEPAGE is None, reason="this NumPy has no huge-page switch")
@pytest.mark.parametrize("start", [True, False])
def test_small_pages_switch_the_advice_off_and_back(start):
    switch = functional._SET_HUGEPAGE
    before = switch(start)
    try:
        with functional._small_pages():
            inside = switch(False)  # (returns the setting it replaces)
        assert inside is False and switch(start) is start
        with pytest.raises(RuntimeError), functional._small_pages():
            raise RuntimeError("a simulation that fails")
        assert switch(start) is start
    finally:
        switch(before)

"""ir/array_memo.ArrayMemo: a read-only array's value is made once while the array lives, a writable array's every
time, and a weakly held value is made again once nothing else holds it."""

import gc

import numpy as np

from tremula.ir.array_memo import ArrayMemo


def _counting():
    made = []

    def make(a):
        made.append(a.shape)  # (not the array: the test lets it die)
        return a * 2

    return made, make


def test_a_read_only_arrays_value_is_made_once_and_dropped_with_the_array():
    memo, (made, make) = ArrayMemo(), _counting()
    a = np.arange(4.0)
    a.flags.writeable = False
    first = memo.get(a, make)
    assert memo.get(a, make) is first and len(made) == 1 and memo.holds(a)
    assert memo.get(a, make, key="other") is not first and len(made) == 2  # (a key of its own: its own value)
    del a, first
    gc.collect()
    assert not memo._kept  # the array died: nothing kept


def test_a_writable_arrays_value_is_made_every_time():
    memo, (made, make) = ArrayMemo(), _counting()
    a = np.arange(4.0)
    memo.get(a, make)
    a[0] = 7.0  # (it may change under its value)
    assert memo.get(a, make)[0] == 14.0 and len(made) == 2 and not memo.holds(a)


def test_weak_values_are_made_again_once_nothing_holds_them():
    memo, (made, make) = ArrayMemo(weak_values=True), _counting()
    a = np.arange(4.0)
    a.flags.writeable = False
    v = memo.get(a, make)
    assert memo.get(a, make) is v and len(made) == 1
    del v
    gc.collect()
    assert np.array_equal(memo.get(a, make), a * 2) and len(made) == 2

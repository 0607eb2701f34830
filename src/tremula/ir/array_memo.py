"""Values made from read-only arrays (a model's weights), kept while the array lives, so the graphs of one compile
that share a model file's weights hash or cast them once."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np


class ArrayMemo:
    """make(a) for an array `a` (and a key of the caller's), kept for a read-only `a` while it lives: keyed by the
    array's identity, checked by a weak reference to it, dropped when it dies. A writable array may change under
    its value, so that value is made every time and never kept. weak_values: the value itself is held weakly too (a
    large array: kept while something else uses it, made again after)."""

    def __init__(self, weak_values: bool = False):
        self.weak_values = weak_values
        self._kept: dict[tuple[int, Hashable], tuple[weakref.ref, Any]] = {}

    def get(self, a: np.ndarray, make: Callable[[np.ndarray], Any], key: Hashable = None) -> Any:
        k = (id(a), key)
        hit = self._kept.get(k)
        if hit is not None and hit[0]() is a:
            value = hit[1]() if self.weak_values else hit[1]
            if value is not None:
                return value
        value = make(a)
        if not a.flags.writeable:
            self._kept[k] = (weakref.ref(a, lambda _, k=k: self._kept.pop(k, None)),
                             weakref.ref(value) if self.weak_values else value)
        return value

    def holds(self, a: np.ndarray, key: Hashable = None) -> bool:
        """Whether a value of `a` (and `key`) is kept."""
        hit = self._kept.get((id(a), key))
        return hit is not None and hit[0]() is a

    def clear(self) -> None:
        self._kept.clear()

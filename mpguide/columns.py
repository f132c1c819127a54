"""Columns of many repeated values, kept as codes: each value's index among the distinct
values. A trace's names, categories, processes and threads are such columns
(:class:`mpguide.trace.Trace`); the call tree and the cast report ask them questions once
per distinct value instead of once per event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np


class Coded(NamedTuple):
    """A column kept as each event's index into the column's distinct values."""

    codes: np.ndarray
    values: list

    def value(self, i: int) -> Any:
        return self.values[self.codes[i]]


class _Index(dict):
    """Numbers values in the order they first appear."""

    def __missing__(self, value: Any) -> int:
        self[value] = code = len(self)
        return code


def codes(values: Iterable, n: int) -> tuple[np.ndarray, list]:
    """Each of ``n`` values' index among the distinct values, and the distinct values."""
    index = _Index()
    return np.fromiter(map(index.__getitem__, values), np.int64, n), list(index)


def matching(coded: tuple[np.ndarray, list], predicate: Callable[[Any], bool]) -> np.ndarray:
    """Mask of the entries whose value satisfies ``predicate`` (asked once per value)."""
    codes, distinct = coded
    return np.fromiter(map(predicate, distinct), bool, len(distinct))[codes]


def merged(columns: list[Coded]) -> Coded:
    """One column from the pieces' columns, the codes renumbered over all distinct values."""
    index = _Index()
    parts = [
        np.fromiter(map(index.__getitem__, c.values), np.int64, len(c.values))[c.codes]
        for c in columns
    ]
    return Coded(np.concatenate(parts), list(index))

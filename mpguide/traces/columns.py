"""The columns a trace is read into (:class:`mpguide.traces.trace.Trace`): columns of many
repeated values kept as codes, each value's index among the distinct values (names,
categories, processes and threads; the call tree and the cast report ask them questions once
per distinct value instead of once per event), the events' undecoded ``args`` and the flow
events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from mpguide import MPGuideError


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


@dataclass(frozen=True, eq=False)
class Args:
    """Each event's ``args`` as undecoded JSON, cut from a few byte blobs: event ``i`` ends
    at byte ``ends[i]`` of the blobs laid end to end, blob ``k`` starting at ``offsets[k]``."""

    blobs: tuple[bytes, ...]
    offsets: np.ndarray
    ends: np.ndarray
    kept: np.ndarray | None = None
    """Which events' ``args`` were kept (None: all)."""

    def raws(self, ids: np.ndarray) -> list[bytes]:
        """The ``args`` JSON of each event in ``ids``."""
        if self.kept is not None and not self.kept[ids].all():
            i = int(ids[~self.kept[ids]][0])
            raise MPGuideError(f"the args of event {i} were not kept (load with args_of=None)")
        stop = self.ends[ids]
        start = np.where(ids > 0, self.ends[ids - 1], 0)
        blob = np.searchsorted(self.offsets, start, side="right") - 1
        base = self.offsets[blob]
        cuts = zip(blob.tolist(), (start - base).tolist(), (stop - base).tolist(), strict=True)
        return [self.blobs[k][lo:hi] for k, lo, hi in cuts]

    def raw(self, i: int) -> bytes:
        return self.raws(np.array([i]))[0]


class Flows(NamedTuple):
    """The ``ac2g`` flow events: ``start`` is True for a flow's start (``ph: "s"``), False for
    its end (``ph: "f"``); ``key`` is the flow's ``id``."""

    start: np.ndarray
    key: Coded
    pid: Coded
    tid: Coded
    ts: np.ndarray

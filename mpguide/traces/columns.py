"""The columns a trace is read into (:class:`mpguide.traces.trace.Trace`): columns of many
repeated values kept as codes, each value's index among the distinct values (names,
categories, processes and threads; the call tree and the cast report ask them questions once
per distinct value instead of once per event), the events' undecoded ``args`` and the flow
events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

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


CODE = np.int32
"""The type of a trace's codes: four bytes an event for each coded column."""


def merged(columns: list[Coded]) -> Coded:
    """One column from the pieces' columns, the codes renumbered over all distinct values;
    ``columns`` is emptied as it is read, so that memory holds each piece's codes or their
    copy, not both."""
    index = _Index()
    out = np.empty(sum(len(c.codes) for c in columns), dtype=CODE)
    at = 0
    while columns:
        c = columns.pop(0)
        table = np.fromiter(map(index.__getitem__, c.values), CODE, len(c.values))
        out[at : at + len(c.codes)] = table[c.codes]
        at += len(c.codes)
        del c
    return Coded(out, list(index))


EMPTY = b"{}"


@dataclass(frozen=True, eq=False)
class Args:
    """The ``args`` of the events as undecoded JSON, cut from a few byte blobs laid end to
    end, blob ``k`` starting at byte ``offsets[k]``: the ``i``-th stored ``args`` end at byte
    ``ends[i]``. Stored are those of the events in ``stored`` (ascending; None: every
    event's); an event kept but not stored had none, or ``{}``."""

    blobs: tuple[bytes, ...]
    offsets: np.ndarray
    ends: np.ndarray
    kept: np.ndarray | None = None
    """Which events' ``args`` were kept (None: all)."""
    stored: np.ndarray | None = None

    def raws(self, ids: np.ndarray) -> list[bytes]:
        """The ``args`` JSON of each event in ``ids``."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.kept is not None and not self.kept[ids].all():
            i = int(ids[~self.kept[ids]][0])
            raise MPGuideError(f"the args of event {i} were not kept (load with args_of=None)")
        if not len(self.ends):
            return [EMPTY] * len(ids)
        if self.stored is None:
            at, present = ids, np.ones(len(ids), dtype=bool)
        else:
            at = np.minimum(np.searchsorted(self.stored, ids), len(self.stored) - 1)
            present = self.stored[at] == ids
        stop = np.where(present, self.ends[at], 0)
        start = np.where(present & (at > 0), self.ends[np.maximum(at - 1, 0)], 0)
        blob = np.searchsorted(self.offsets, start, side="right") - 1
        base = self.offsets[blob]
        cuts = zip(blob.tolist(), (start - base).tolist(), (stop - base).tolist(), strict=True)
        found = [self.blobs[k][lo:hi] for k, lo, hi in cuts]
        return (
            found
            if present.all()
            else [f if p else EMPTY for f, p in zip(found, present.tolist(), strict=True)]
        )

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


class Events(Protocol):
    """What a call tree reads of a trace, one array or column per field of its complete
    events (:class:`mpguide.traces.trace.Trace` is one)."""

    name: Coded
    cat: Coded
    pid: Coded
    tid: Coded
    ts: np.ndarray
    dur: np.ndarray
    args: Args
    flows: Flows
    source: str
    replaced: int

    def event(self, i: int) -> Any:
        """Event ``i`` as it was exported."""
        ...

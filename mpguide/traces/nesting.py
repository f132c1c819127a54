"""How :func:`mpguide.traces.calltree.build` nests one thread's events: by time interval on
integer nanoseconds, in (start, longest first, layer, file order) order. Without overlaps, by
array operations a chunk of :data:`_CHUNK` events at a time, each chunk's roots put under
the events still open before it (:class:`_Stack`), so that memory beyond the tree is one
chunk's arrays; with an overlap, by one stack over the thread (:func:`_nest_in_stack`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import numpy as np

from mpguide.traces.columns import Events


def _absolute_ns(ts: np.ndarray) -> np.ndarray:
    """Finite microsecond times in integer nanoseconds.

    Exports write microseconds with three decimals, or whole microseconds since the epoch
    (about 1.7e15). ``ts * 1000`` is not exact in a double at either size: it can round to
    the wrong nanosecond, or, past 2**53 ns, by hundreds of them, and nest a child past its
    parent's end. The whole microseconds and the fraction of a double are each exact, so
    they are converted apart.
    """
    whole = np.floor(ts)
    fraction = ts - whole
    fraction *= 1000.0
    ns = whole.astype(np.int64)
    del whole
    ns *= 1000
    ns += np.rint(fraction, out=fraction).astype(np.int64)
    return ns


def _nest_in_stack(start: list[int], end: list[int]) -> tuple[list[int], list[int], Counter]:
    """Nest one thread's events, given in (start, longest first) order, with one stack."""
    parents: list[int] = []
    depths: list[int] = []
    seen: Counter = Counter()
    stack = [(math.inf, -1, -1)]  # (end, start, position) of the open events, above a root guard
    for k, (s, e) in enumerate(zip(start, end, strict=True)):
        top = stack[-1]
        while top[0] <= s:
            stack.pop()
            if top[0] == s and top[1] < s:
                seen["touching"] += 1
            top = stack[-1]
        parents.append(top[2])
        depths.append(len(stack) - 1)
        if e > top[0]:
            seen["overlaps"] += 1
        elif s == top[1] and e == top[0]:
            seen["identical"] += 1
        stack.append((e, s, k))
    return parents, depths, seen


def _ranks(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For two ascending arrays, how many of ``second`` are below each of ``first``, and how
    many of ``first`` are at or below each of ``second``: ``np.searchsorted`` both ways, by
    one stable sort that merges the two runs."""
    n = len(first)
    from_first = np.argsort(np.concatenate((first, second)), kind="stable") < n
    below = np.flatnonzero(from_first)
    below -= np.arange(n)
    at_or_below = np.flatnonzero(~from_first)
    at_or_below -= np.arange(len(second))
    return below, at_or_below


def _group_ends(start: np.ndarray) -> np.ndarray:
    """For ascending ``start``, the position after the last of each one's equal values."""
    change = np.flatnonzero(np.diff(start)) + 1
    group = np.zeros(len(start), dtype=np.int64)
    group[change] = 1
    return np.append(change, len(start))[np.cumsum(group)]


def _nest_without_overlaps(
    start: np.ndarray, end: np.ndarray
) -> tuple[np.ndarray, np.ndarray, Counter] | None:
    """What :func:`_nest_in_stack` finds, by array operations, or None if an event overlaps
    its parent.

    Without overlaps, the stack at event k holds exactly the earlier events that end after
    ``start[k]``: their count is k's depth, and the parent is the last earlier event one
    level up.
    """
    m = len(start)
    # Earlier events ended by start[k]: all ends up to it, less the zero-length events at
    # start[k] sorted after k (they close the group of events with that start).
    zero_length = np.concatenate(([0], np.cumsum(start == end)))
    ends = np.sort(end)
    closer, ended = _ranks(ends, start)
    # Events of positive length at whose end another starts (a zero-length event's end is
    # its own start).
    touching = int((start[np.minimum(closer, m - 1)] == ends).sum()) - int(zero_length[-1])
    del ends, closer
    position = np.arange(m)
    depth = position - ended
    if zero_length[-1]:
        depth += zero_length[_group_ends(start)] - zero_length[position]
    del ended, zero_length
    # The events sorted by (depth, position) each look for the last event one level up
    # before them, in that order too (which numpy searches fastest).
    by_level = np.sort(depth * m + position)
    del position
    above = np.empty(m, dtype=np.int64)
    above[by_level % m] = by_level[np.maximum(np.searchsorted(by_level, by_level - m) - 1, 0)]
    del by_level
    nested = depth > 0
    parent = np.where(nested, above % m, -1)
    if (above[nested] // m != depth[nested] - 1).any() or (end > end[parent])[nested].any():
        return None
    identical = nested & (start == start[parent]) & (end == end[parent])
    return parent, depth, Counter(touching=touching, identical=int(identical.sum()))


def _nest(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, Counter]:
    """Each event's parent position (-1 for a root) and depth among one thread's events,
    given in (start, longest first) order, and the counts of overlapping, touching and
    identical intervals."""
    found = _nest_without_overlaps(start, end)
    if found is not None:
        return found
    parents, depths, seen = _nest_in_stack(start.tolist(), end.tolist())
    return np.array(parents, dtype=np.int64), np.array(depths, dtype=np.int64), seen


_CHUNK = 1 << 18
"""Events a thread is nested in at a time: the arrays of one chunk are what nesting holds
beyond the tree."""


def _ascending(values: np.ndarray) -> bool:
    """Whether ``values`` never fall, checked a chunk at a time."""
    return all(
        not (np.diff(values[lo : lo + _CHUNK + 1]) < 0).any()
        for lo in range(0, len(values), _CHUNK)
    )


def _index_type(n: int) -> type:
    """The smallest integer type that holds an event's id and -1."""
    return np.int32 if n < 2**31 else np.int64


def _where(mask: np.ndarray, dtype: type) -> np.ndarray:
    """``np.flatnonzero(mask)`` as ``dtype``, found a chunk at a time."""
    parts = [
        np.flatnonzero(mask[lo : lo + _CHUNK]).astype(dtype) + dtype(lo)
        for lo in range(0, len(mask), _CHUNK)
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


class _Lazy:
    """An array of one value per event made only for the events asked for: ``f(ids)``."""

    def __init__(self, f: Callable[[np.ndarray], np.ndarray]):
        self._f = f

    def __getitem__(self, ids):
        if np.ndim(ids) == 0:
            return self._f(np.array([ids]))[0]
        return self._f(np.asarray(ids))


def _spans(trace: Events, ids: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray]:
    """Start and end of the timed events ``ids`` in integer nanoseconds after ``base``."""
    start = _absolute_ns(trace.ts[ids])
    start -= base
    dur = trace.dur[ids] * 1000.0
    end = np.rint(dur, out=dur).astype(np.int64)
    end += start
    return start, end


def _order_key(start: np.ndarray, end: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Longest first, then layer, among events of one start."""
    key = start - end
    key *= 4
    key += rank
    return key


def _sorted_runs(ids, trace: Events, base: int, rank: np.ndarray, lo: int, hi: int) -> bool:
    """Whether ``ids[lo:hi]``, one thread's events, are in (start, longest first, layer)
    order already, checked a chunk at a time."""
    last = None
    for a in range(lo, hi, _CHUNK):
        part = ids[a : min(a + _CHUNK, hi)]
        start, end = _spans(trace, part, base)
        key = _order_key(start, end, rank[part])
        if last is not None:
            start, key = np.append(last[0], start), np.append(last[1], key)
        later, longer = np.diff(start), np.diff(key)
        if not ((later > 0) | ((later == 0) & (longer >= 0))).all():
            return False
        last = start[-1], key[-1]
    return True


def _sort_thread(ids, trace: Events, base: int, rank: np.ndarray, lo: int, hi: int) -> None:
    """Sort one thread's events ``ids[lo:hi]`` by start, then longest first, then layer,
    then file order, in place."""
    part = ids[lo:hi]
    start, end = _spans(trace, part, base)
    key = _order_key(start, end, rank[part])
    del end
    ids[lo:hi] = part[np.lexsort((key, start))]


class _Stack:
    """The open events of a thread being nested, outermost first: their ids in a buffer that
    grows, and their ends computed when asked for. Event ``k`` of the stack is at depth
    ``k``: the stack is the ancestors of the event nested last, and that event."""

    def __init__(self, dtype: type):
        self.ids = np.zeros(1024, dtype)
        self.size = 0

    def keep(self, n: int, more: np.ndarray) -> None:
        """Keep the first ``n`` open events and open ``more`` above them."""
        need = n + len(more)
        if need > len(self.ids):
            grown = np.zeros(max(need, len(self.ids) * 3 // 2), self.ids.dtype)
            grown[:n] = self.ids[:n]
            self.ids = grown
        self.ids[n:need] = more
        self.size = need

    def still_open(self, trace: Events, base: int, at: np.ndarray) -> np.ndarray:
        """For each time in ``at`` (ascending, none before the stack's events start), how
        many events of the stack end after it: the ends fall from the bottom of the stack to
        its top, so those are its first ones."""
        latest = int(at[-1]) if len(at) else 0
        bottom = self.size
        while bottom:  # down from the top to the first event that ends after the latest time
            lo = max(bottom - _CHUNK, 0)
            still = int(np.count_nonzero(_spans(trace, self.ids[lo:bottom], base)[1] > latest))
            if still:
                bottom = lo + still
                break
            bottom = lo
        top = _spans(trace, self.ids[bottom : self.size], base)[1][::-1]  # ascending
        return bottom + len(top) - np.searchsorted(top, at, side="right")


def _matches_start(ids, trace, base, lo: int, hi: int, ends, starts, past: int) -> int:
    """How many of ``ends`` (nanoseconds) are the start of one of the thread's events
    ``ids[lo:hi]``, whose starts ascend: ``starts`` are those of ``ids[lo:past]``."""
    at = np.minimum(np.searchsorted(starts, ends), len(starts) - 1)
    found = starts[at] == ends
    rest = ends[~found & (ends > starts[-1])]
    if len(rest) and past < hi:
        last = _spans(trace, ids[hi - 1 : hi], base)[0][0]
        rest = rest[rest <= last]
        a = np.full(len(rest), past, dtype=np.int64)  # binary search over starts not made
        b = np.full(len(rest), hi, dtype=np.int64)
        while (live := a < b).any():
            mid = (a + b) // 2
            below = _spans(trace, ids[np.minimum(mid, hi - 1)], base)[0] < rest
            a = np.where(live & below, mid + 1, a)
            b = np.where(live & ~below, mid, b)
        hit = a < hi
        hit[hit] = _spans(trace, ids[a[hit]], base)[0] == rest[hit]
        return int(found.sum()) + int(hit.sum())
    return int(found.sum())


def _nest_thread(ids, trace, base, lo: int, hi: int, parent, depth) -> Counter | None:
    """Nest one thread's events ``ids[lo:hi]``, in (start, longest first) order, a chunk
    at a time (:func:`_nest_without_overlaps` on the chunk, its roots put under the open
    events before it), writing ``parent`` and ``depth``; None, with nothing decided, if
    an event overlaps its parent."""
    stack = _Stack(ids.dtype)
    seen: Counter = Counter()
    ahead = None
    for a in range(lo, hi, _CHUNK):
        b = min(a + _CHUNK, hi)
        part = ids[a:b]
        start, end = ahead if ahead is not None else _spans(trace, part, base)
        ahead = _spans(trace, ids[b : min(b + _CHUNK, hi)], base) if b < hi else None
        found = _nest_without_overlaps(start, end)
        if found is None:
            return None
        local, level, counts = found
        counts.pop("touching", None)
        seen += counts
        below = stack.still_open(trace, base, start)
        root = local < 0
        up = np.where(below[root] > 0, stack.ids[np.maximum(below[root] - 1, 0)], -1)
        if (up >= 0).any():
            s_up, e_up = _spans(trace, up[up >= 0], base)
            s_in, e_in = start[root][up >= 0], end[root][up >= 0]
            if (e_in > e_up).any():
                return None
            seen["identical"] += int(((s_in == s_up) & (e_in == e_up)).sum())
        parent[part] = np.where(root, 0, part[np.maximum(local, 0)])
        parent[part[root]] = up
        depth[part] = level + below
        positive = end > start
        nexts = start if ahead is None else np.concatenate((start, ahead[0]))
        seen["touching"] += _matches_start(
            ids, trace, base, lo, hi, end[positive], nexts, b + len(nexts) - len(start)
        )
        last = start[-1]
        inside = np.flatnonzero((end > last) & (np.arange(len(part)) < len(part) - 1))
        stack.keep(int(below[-1]), np.append(part[inside], part[-1]))
    return seen

"""How :func:`mpguide.traces.calltree.build` hangs GPU events under the launches that started
them: through the ``ac2g`` flow events, else the ``correlation`` id in their ``args``, within
one process when launches of several share an id (see :mod:`mpguide.traces.calltree`).
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import NamedTuple

import msgspec
import numpy as np

from mpguide import MPGuideError
from mpguide.traces.columns import Events, codes
from mpguide.traces.nesting import _absolute_ns


class _Link(msgspec.Struct, gc=False):
    correlation: int | str | None = None


_LINKS = msgspec.json.Decoder(list[_Link])


class _Links(NamedTuple):
    """GPU events and launches, each with a key (a flow id or a correlation id, as codes)."""

    gpu: np.ndarray
    gpu_key: np.ndarray
    launch: np.ndarray
    launch_key: np.ndarray


def _correlation_links(trace: Events, gpu: np.ndarray, launch: np.ndarray) -> _Links:
    """GPU events and launches keyed by the ``correlation`` in their ``args``."""
    ids = np.concatenate((gpu, launch))
    try:
        links = _LINKS.decode(b"[" + b",".join(trace.args.raws(ids)) + b"]")
    except msgspec.ValidationError as err:
        where = trace.source or "trace"
        raise MPGuideError(
            f"{where}: a launch's or GPU event's args are not usable ({err})"
        ) from None
    keys = list(map(attrgetter("correlation"), links))
    has = np.fromiter(map(is_not, keys, repeat(None)), bool, len(keys))
    ids, key = ids[has], codes(compress(keys, has), int(has.sum()))[0]
    on_gpu = np.isin(ids, gpu)
    return _Links(ids[on_gpu], key[on_gpu], ids[~on_gpu], key[~on_gpu])


def _bind(targets: np.ndarray, start: np.ndarray, thread: np.ndarray, at, on) -> np.ndarray:
    """For each flow end at nanosecond ``at`` on thread ``on``, the first of ``targets`` on
    that thread starting then, or -1."""
    order = targets[np.argsort(start[targets], kind="stable")]
    first = np.searchsorted(start[order], at, side="left")
    count = np.searchsorted(start[order], at, side="right") - first
    found = np.full(len(at), -1, dtype=np.int64)
    one = np.flatnonzero(count == 1)
    candidate = order[first[one]]
    found[one] = np.where(thread[candidate] == on[one], candidate, -1)
    for k in np.flatnonzero(count > 1).tolist():
        same = [j for j in order[first[k] : first[k] + count[k]].tolist() if thread[j] == on[k]]
        found[k] = same[0] if same else -1
    return found


def _flow_links(trace: Events, gpu, launch, start, thread, base: int) -> _Links:
    """GPU events and launches keyed by the ``ac2g`` flows bound to them."""
    flows = trace.flows
    pid = {v: k for k, v in enumerate(trace.pid.values)}
    tid = {v: k for k, v in enumerate(trace.tid.values)}
    pids = np.array([pid.get(v, -1) for v in flows.pid.values], dtype=np.int64)[flows.pid.codes]
    tids = np.array([tid.get(v, -1) for v in flows.tid.values], dtype=np.int64)[flows.tid.codes]
    known = (pids >= 0) & (tids >= 0)
    at = _absolute_ns(flows.ts) - base
    on = np.where(known, pids * len(trace.tid.values) + tids, -1)
    ends = []
    for targets, side in ((gpu, ~flows.start), (launch, flows.start)):
        bound = _bind(targets, start, thread, at[side], on[side])
        ends.append((bound[bound >= 0], flows.key.codes[side][bound >= 0]))
    (g, g_key), (la, la_key) = ends
    return _Links(g, g_key, la, la_key)


def _resolve(links: _Links, process: np.ndarray, n_proc: int, start: np.ndarray, pairs):
    """Each GPU event's launch (-1 for none) and whether launches of several processes share
    its key. A key whose launches are all in one process links there; a shared key links in
    the GPU event's own process, else in the process ``pairs`` gives for its own. Within the
    process, the latest launch that starts no later than the GPU event is taken (the first
    when none does)."""
    key, gpu = links.gpu_key, links.gpu
    group = links.launch_key * n_proc + process[links.launch]
    order = np.lexsort((start[links.launch], group))
    groups = group[order]
    present = np.unique(groups)
    n_keys = max(int(key.max(initial=-1)), int(links.launch_key.max(initial=-1))) + 1
    spread = np.bincount(present // n_proc, minlength=n_keys)
    only = np.full(n_keys, -1, dtype=np.int64)
    alone = spread[present // n_proc] == 1
    only[present[alone] // n_proc] = present[alone] % n_proc
    shared = spread[key] > 1
    target = only[key]
    for proc in (process[gpu], None if pairs is None else pairs[process[gpu]]):
        if proc is not None:
            found = shared & (target < 0) & (proc >= 0) & np.isin(key * n_proc + proc, present)
            target[found] = proc[found]
    want = key * n_proc + target
    first = np.searchsorted(groups, want, side="left")
    count = np.where(target >= 0, np.searchsorted(groups, want, side="right") - first, 0)
    parent = np.full(len(gpu), -1, dtype=np.int64)
    parent[count == 1] = links.launch[order[first[count == 1]]]
    for i in np.flatnonzero(count > 1).tolist():
        launches = links.launch[order[first[i] : first[i] + count[i]]]
        before = int(np.searchsorted(start[launches], start[gpu[i]], side="right"))
        parent[i] = launches[max(before - 1, 0)]
    return parent, shared


def _pairs(gpu: np.ndarray, parent: np.ndarray, shared: np.ndarray, process, n_proc: int):
    """The launch process of each GPU process, from its links through unshared keys; -1
    where there are none, -2 where there are several."""
    sure = (parent >= 0) & ~shared
    seen = np.unique(process[gpu[sure]] * n_proc + process[parent[sure]])
    gpu_proc, launch_proc = seen // n_proc, seen % n_proc
    counts = np.bincount(gpu_proc, minlength=n_proc)
    pairs = np.where(counts > 1, -2, -1)
    single = counts[gpu_proc] == 1
    pairs[gpu_proc[single]] = launch_proc[single]
    return pairs


def _link_gpu(trace: Events, gpu, launch, start, thread, base: int, parent: np.ndarray):
    """Parent every GPU event in ``gpu`` to its launch among ``launch`` (see the module
    docs); return the mask of linked events, and the number of GPU events whose key
    launches of several processes share, and of those left unlinked."""
    n = len(parent)
    if not (len(gpu) or len(launch)):
        return np.zeros(n, bool), 0, 0
    process, n_proc = trace.pid.codes, np.int64(max(len(trace.pid.values), 1))
    sources = (
        _flow_links(trace, gpu, launch, start, thread, base),
        _correlation_links(trace, gpu, launch),
    )
    found = [_resolve(links, process, n_proc, start, None) for links in sources]
    pairs = np.full(n_proc, -1, dtype=np.int64)
    for links, (got, shared) in zip(sources, found, strict=True):
        learned = _pairs(links.gpu, got, shared, process, n_proc)
        agree = (learned == -1) | (learned == pairs)
        pairs = np.where(pairs == -1, learned, np.where(agree, pairs, -2))
    link, flow_bound, is_shared = (
        np.full(n, -1, dtype=np.int64),
        np.zeros(n, bool),
        np.zeros(n, bool),
    )
    for links, is_flow in zip(sources, (True, False), strict=True):
        got, shared = _resolve(links, process, n_proc, start, np.maximum(pairs, -1))
        fill = ~flow_bound[links.gpu]
        link[links.gpu[fill]] = got[fill]
        is_shared[links.gpu] |= shared & fill
        if is_flow:
            flow_bound[links.gpu[got >= 0]] = True
    linked = link >= 0
    parent[linked] = link[linked]
    return linked, int(is_shared.sum()), int((is_shared & ~linked).sum())

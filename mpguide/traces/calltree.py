"""Call trees of a chrome trace: :func:`build` nests the complete (``ph: "X"``) events of a
trace read into columns (:class:`~mpguide.traces.columns.Events`;
:meth:`mpguide.traces.trace.Trace.tree` passes its trace) into one tree per process and thread
(:class:`Tree`, whose nodes are :class:`Node`).

- CPU events nest by time interval on integer nanoseconds, sorted by start, then longest
  first, then layer (annotation, Python, op), then file order. An interval is half-open: an
  event starting at another's exact end follows it as a sibling.
- GPU kernels, memcpys and memsets hang under the runtime launch that started them (a graph
  launch gets all its kernels); a GPU event without a launch stays in its stream's tree. The
  ``ac2g`` flow events say which launch started which GPU event: a flow's start binds to the
  launch on its thread that starts at its time, its end to the GPU event that starts at its
  time. GPU events without a flow link through the ``correlation`` id in their ``args``.
- ``python_function`` events are an optional layer (``python=True``), and so are
  ``user_annotation`` ranges such as ``ProfilerStep#N`` (``annotations=False`` leaves them
  out). Left-out events are counted, never lost.

Every other case has a defined place and is counted in :class:`Anomalies`: an event that
overlaps its parent without nesting stays under the parent it starts in; identical intervals
nest in file order; an event without ``ts`` or ``dur`` is left out of the tree (a negative
``dur``, or a time past :data:`MAX_US`, is an error naming the event); bytes that are
not UTF-8 were replaced by U+FFFD when the trace was read. An id shared by launches of
several processes (a merged trace of several ranks) links a GPU event to the launch in its
own process, else in the process its unambiguous links pair it with, else to none: a GPU
event is never linked to another rank's launch by guess. Within one process, the latest
launch that precedes the GPU event is taken.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from html import escape
from itertools import islice, pairwise
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np

from mpguide import MPGuideError
from mpguide.core.table import escape_controls, shortened
from mpguide.core.units import duration_text
from mpguide.traces.columns import Events, matching
from mpguide.traces.gpu_links import _link_gpu
from mpguide.traces.nesting import (
    _CHUNK,
    _absolute_ns,
    _ascending,
    _index_type,
    _Lazy,
    _nest,
    _nest_thread,
    _sort_thread,
    _sorted_runs,
    _spans,
    _where,
)

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
RUNTIME_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver", "hip_runtime", "hip_driver"})
PYTHON, ANNOTATION = "python_function", "user_annotation"
STEP_MARK = "ProfilerStep#"
"""How ``torch.profiler.profile.step()`` names the ``user_annotation`` range of a step."""
MODULE_MARK = "nn.Module: "
"""How ``with_modules``/``with_stack`` traces name the ``python_function`` range of a module's
call: ``nn.Module: Qwen2RMSNorm_3`` (the class, then the instance's number)."""
_FRAME = re.compile(r"(.+)\((\d+)\): (.*)")
_LAYER_RANK = {ANNOTATION: 0, PYTHON: 1}
DEFAULT_FIELDS = ("Input Dims", "Input type")
INDENT = 16
"""The most levels a text tree indents; deeper lines say how many more levels they are in."""
CHAIN = 6
"""The longest chain of nodes of one child each that a text tree draws whole."""


class _Autograd(msgspec.Struct, gc=False):
    sequence: int = msgspec.field(default=-1, name="Sequence number")


_AUTOGRAD = msgspec.json.Decoder(list[_Autograd])


def module_class(name: str) -> str | None:
    """``'nn.Module: Qwen2RMSNorm_3'`` -> ``'Qwen2RMSNorm'``; None for other names."""
    if not name.startswith(MODULE_MARK):
        return None
    head, _, number = name[len(MODULE_MARK) :].rpartition("_")
    return head if head and number.isdigit() else name[len(MODULE_MARK) :]


def frame_place(name: str) -> tuple[str, int, str] | None:
    """``'models/qwen2.py(181): forward'`` -> ``('models/qwen2.py', 181, 'forward')``: the
    file, the line the profiler gives (where the function starts) and the function of a
    Python frame; None for other names (``<built-in method ...>``, ops)."""
    found = _FRAME.fullmatch(name)
    return None if found is None else (found[1], int(found[2]), found[3])


@dataclass(frozen=True)
class Anomalies:
    """How many events met each case that a plain interval nesting gets wrong.

    ``shared_correlation`` counts the GPU events whose id launches of several processes
    share; ``ambiguous_gpu`` those of them left unlinked because no process pairing decides;
    ``no_time`` the events without ``ts`` or ``dur``, left out of the tree; ``replaced`` the
    invalid UTF-8 sequences replaced while reading. The events of layers not asked for are
    not anomalies: :attr:`Tree.hidden` counts them.
    """

    overlaps: int = 0
    touching: int = 0
    identical: int = 0
    shared_correlation: int = 0
    ambiguous_gpu: int = 0
    unlinked_gpu: int = 0
    no_time: int = 0
    replaced: int = 0

    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def losses(self) -> list[str]:
        """A sentence per case that changed or left out what the trace says."""
        said = (
            (self.replaced, "invalid UTF-8 sequences replaced by U+FFFD"),
            (self.no_time, "events without ts or dur left out"),
            (
                self.ambiguous_gpu,
                "GPU events left unlinked: launches of several ranks share their id",
            ),
        )
        return [f"{n} {text}" for n, text in said if n]

    def __repr__(self) -> str:
        parts = [
            f"{f.name.replace('_', ' ')} {getattr(self, f.name):,}"
            for f in fields(self)
            if getattr(self, f.name)
        ]
        return "anomalies: " + (", ".join(parts) or "none")


def _args(raw: bytes) -> dict[str, Any]:
    value = msgspec.json.decode(raw)
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True, eq=False)
class Node:
    """One event in a :class:`Tree`; ``id`` is its index among the trace's complete events."""

    tree: Tree
    id: int

    @property
    def event(self) -> msgspec.Struct:
        return self.tree.trace.event(self.id)

    @property
    def name(self) -> str:
        return self.tree.trace.name.value(self.id)

    @property
    def cat(self) -> str:
        return self.tree.trace.cat.value(self.id)

    @property
    def start(self) -> float:
        """Start in microseconds, as in the file."""
        return float(self.tree.trace.ts[self.id])

    @property
    def dur(self) -> float:
        """Duration in microseconds."""
        return float(self.tree.trace.dur[self.id])

    @property
    def self_time(self) -> float:
        """Duration less the time of the CPU children, in microseconds."""
        return float(self.tree.self_us[self.id])

    @property
    def gpu_time(self) -> float:
        """Time of the GPU events in this subtree, in microseconds."""
        return float(self.tree.gpu_us[self.id])

    @property
    def is_gpu(self) -> bool:
        """Whether it happens on the device: a kernel, memcpy, memset or GPU-side range."""
        return _is_gpu_category(self.cat)

    @cached_property
    def args(self) -> dict[str, Any]:
        return _args(self.tree.trace.args.raw(self.id))

    def field(self, name: str) -> Any:
        """An ``args`` entry (``Input Dims``, ``Input type``, ...) or ``None``."""
        return self.args.get(name)

    @property
    def parent(self) -> Node | None:
        p = self.tree.parents[self.id]
        return None if p < 0 else Node(self.tree, p)

    @property
    def children(self) -> list[Node]:
        return [Node(self.tree, i) for i in self.tree.children_ids(self.id)]

    def ancestors(self) -> Iterator[Node]:
        """Parent, grandparent, ... up to the root."""
        node = self.parent
        while node is not None:
            yield node
            node = node.parent

    def walk(self) -> Iterator[Node]:
        """This node and its descendants, depth first in time order."""
        stack = [self.id]
        while stack:
            i = stack.pop()
            yield Node(self.tree, i)
            stack.extend(reversed(self.tree.children_ids(i)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Node) and other.tree is self.tree and other.id == self.id

    def __hash__(self) -> int:
        return hash((id(self.tree), self.id))

    def __repr__(self) -> str:
        return f"Node({self.id}, {self.name!r}, {self.cat}, {self.dur:.3f} us)"


MAX_US = 2.0**62 / 1000
"""The latest time, in microseconds either side of zero, that nests: twice it in integer
nanoseconds fits in an int64."""


def _bad_time(trace: Events, i: int) -> MPGuideError:
    """The error for event ``i``, whose time is negative or out of :data:`MAX_US`."""
    ts, dur = float(trace.ts[i]), float(trace.dur[i])
    if dur < 0:
        what = f"negative dur ({dur:g} us)"
    else:
        field, value = ("ts", ts) if abs(ts) > MAX_US else ("ts + dur", ts + dur)
        what = f"{field} {value:g} us is beyond ±{MAX_US:.3g} us, the times this reader nests"
    return MPGuideError(f"{trace.source or 'trace'}: event {i} ({trace.name.value(i)!r}): {what}")


class Tree:
    """Call trees of a trace (:class:`~mpguide.traces.columns.Events`), one per process and thread, as parent links.

    Build it with :func:`build`. ``parent[i]`` is the parent's id or -1 for a root;
    :meth:`roots` lists each thread's roots; :meth:`find` looks nodes up; :attr:`hidden`
    counts the events of the layers left out.
    """

    def __init__(
        self,
        trace: Events,
        included: np.ndarray,
        parent: np.ndarray,
        depth: np.ndarray,
        order: np.ndarray,
        anomalies: Anomalies,
        gpu_work: np.ndarray,
        hidden: dict[str, int] | None = None,
    ):
        self.trace = trace
        self.included = included
        self.parent = parent
        self.depth = depth
        self.order = order
        self.anomalies = anomalies
        self.gpu_work = gpu_work & included
        self.dur_us = trace.dur
        self.hidden = hidden or {}
        """How many events of each layer not asked for (``python_function``,
        ``user_annotation``) the tree leaves out."""

    def __len__(self) -> int:
        return int(self.included.sum())

    def node(self, i: int) -> Node:
        if not (0 <= i < len(self.included)) or not self.included[i]:
            raise MPGuideError(f"no node with id {i} in this tree")
        return Node(self, i)

    @cached_property
    def _children(self) -> tuple[np.ndarray, np.ndarray]:
        """Children in time order as CSR: ``ids[offsets[p]:offsets[p + 1]]``."""
        kids = self.order[self.parent[self.order] >= 0]
        parents = self.parent[kids]
        if not _ascending(parents):
            by_parent = np.argsort(parents, kind="stable")
            kids, parents = kids[by_parent], parents[by_parent]
            del by_parent
        n = len(self.parent)
        offsets = np.empty(n + 1, dtype=self.parent.dtype)
        for lo in range(0, n + 1, _CHUNK):  # where each node's children start
            wanted = np.arange(lo, min(lo + _CHUNK, n + 1))
            offsets[lo : lo + len(wanted)] = np.searchsorted(parents, wanted)
        return kids, offsets

    def children_ids(self, i: int) -> list[int]:
        ids, offsets = self._children
        return ids[offsets[i] : offsets[i + 1]].tolist()

    def roots(self) -> dict[tuple[int | str, int | str], list[Node]]:
        """Each (pid, tid)'s root nodes in time order."""
        return {key: [Node(self, i) for i in ids.tolist()] for key, ids in self._root_ids().items()}

    def _root_ids(self) -> dict[tuple[int | str, int | str], np.ndarray]:
        """Each (pid, tid)'s root ids in time order, grouped by array operations."""
        pid, tid = self.trace.pid, self.trace.tid
        ids = self.order[self.parent[self.order] < 0]
        if not len(ids):
            return {}
        if len(pid.values) * len(tid.values) == 1:  # one thread: nothing to group
            return {(pid.values[0], tid.values[0]): ids}
        thread = pid.codes[ids] * np.int64(max(len(tid.values), 1)) + tid.codes[ids]
        if _ascending(thread):  # as the tree orders them: thread by thread, time in each
            groups = np.split(ids, np.flatnonzero(np.diff(thread)) + 1)
        else:
            _, seen_first = np.unique(thread, return_index=True)
            by_thread = np.argsort(thread, kind="stable")
            groups = np.split(ids[by_thread], np.flatnonzero(np.diff(thread[by_thread])) + 1)
            order = np.argsort(seen_first, kind="stable")  # threads in order of first root
            groups = [groups[k] for k in order.tolist()]
        return {(pid.value(g[0]), tid.value(g[0])): g for g in groups}

    def named(self, predicate: Callable[[str], bool]) -> np.ndarray:
        """Mask of the events whose name satisfies ``predicate`` (asked once per name)."""
        return matching(self.trace.name, predicate)

    def step_mask(self) -> np.ndarray:
        """Mask of the profiled steps in the tree: the ``ProfilerStep#N`` ranges (read-only,
        computed once)."""
        return self._steps

    @cached_property
    def _steps(self) -> np.ndarray:
        steps = self.in_category(ANNOTATION.__eq__) & self.included
        steps &= self.named(lambda n: n.startswith(STEP_MARK))
        steps.flags.writeable = False
        return steps

    def steps(self) -> list[Node]:
        """The profiled steps (``ProfilerStep#N`` ranges), thread by thread in time order."""
        mask = self.step_mask()
        return [Node(self, i) for i in self.order[mask[self.order]].tolist()]

    def in_category(self, predicate: Callable[[str], bool]) -> np.ndarray:
        """Mask of the events whose category satisfies ``predicate`` (asked once per category)."""
        return matching(self.trace.cat, predicate)

    @cached_property
    def parents(self) -> list[int]:
        """``parent`` as a list, for fast walks up the tree."""
        return self.parent.tolist()

    def nearest(self, ids: np.ndarray, *masks: np.ndarray) -> list[np.ndarray]:
        """For each of ``ids``, its nearest ancestor in each of ``masks`` (-1 where none):
        the ancestors of all ids are walked together, one level a step."""
        found = [np.full(len(ids), -1, dtype=np.int64) for _ in masks]
        up = self.parent[ids]
        live = np.flatnonzero(up >= 0)
        while len(live):
            a = up[live]
            done = np.ones(len(live), dtype=bool)
            for mask, out in zip(masks, found, strict=True):
                hit = (out[live] < 0) & mask[a]
                out[live[hit]] = a[hit]
                done &= out[live] >= 0
            up[live] = self.parent[a]
            live = live[(up[live] >= 0) & ~done]  # an id found in every mask walks no further
        return found

    def sequence_numbers(self, ids: np.ndarray) -> np.ndarray:
        """The autograd ``Sequence number`` of each event in ``ids`` (-1 where it has none):
        a backward node carries the number of the forward op that made it."""
        if not len(ids):
            return np.zeros(0, dtype=np.int64)
        try:
            found = _AUTOGRAD.decode(b"[" + b",".join(self.trace.args.raws(ids)) + b"]")
        except msgspec.ValidationError as err:
            where = self.trace.source or "trace"
            raise MPGuideError(f"{where}: an op's sequence number is not usable ({err})") from None
        return np.fromiter(map(attrgetter("sequence"), found), np.int64, len(found))

    @cached_property
    def self_us(self) -> np.ndarray:
        """Each node's duration less its CPU children's, in microseconds."""
        cpu_child = (self.parent >= 0) & ~self.gpu_work
        child_sum = np.bincount(
            self.parent[cpu_child], weights=self.dur_us[cpu_child], minlength=len(self.parent)
        )
        return self.dur_us - child_sum

    @cached_property
    def gpu_us(self) -> np.ndarray:
        """Each node's GPU time: the GPU events in its subtree, in microseconds."""
        acc = np.where(self.gpu_work, self.dur_us, 0.0)
        if not self.gpu_work.any():
            return acc
        at = np.flatnonzero((self.parent >= 0) & self.included)
        at = at[np.argsort(-self.depth[at], kind="stable")]  # deepest level first
        bounds = np.flatnonzero(np.diff(self.depth[at])) + 1
        for level in np.split(at, bounds):
            np.add.at(acc, self.parent[level], acc[level])
        return acc

    def find(
        self,
        name: str | None = None,
        *,
        id: int | None = None,
        predicate: Callable[[Node], bool] | None = None,
    ) -> list[Node]:
        """Nodes, thread by thread in time order, whose name equals ``name``, whose id is
        ``id`` and for which ``predicate`` holds: each criterion only when given, and all of
        those given (an ``id`` that is not in the tree is an error)."""
        ids = self.order if id is None else np.array([self.node(id).id])
        if name is not None:
            ids = ids[self.named(name.__eq__)[ids]]
        nodes = [Node(self, i) for i in ids.tolist()]
        return [n for n in nodes if predicate(n)] if predicate else nodes

    def lines(
        self,
        root: Node | Sequence[Node] | None = None,
        *,
        fields: Sequence[str] = DEFAULT_FIELDS,
        depth: int | None = None,
        gpu: bool = False,
        limit: int | None = None,
        drawn: Drawn | None = None,
    ) -> Iterator[str]:
        """The lines of a text tree (``└── aten::matmul  1.23 ms  Input Dims: ...``) of
        ``root`` or of every thread, made as they are read, so that memory holds one line.

        ``fields`` are ``args`` entries shown after the name and duration, each cut to
        :data:`~mpguide.core.table.MAX_CELL` characters; ``depth`` limits the levels shown
        below each root; GPU events are shown only with ``gpu=True``; ``limit`` caps the
        nodes drawn, depth first (:meth:`count` says how many there are). Indentation is
        bounded: past :data:`INDENT` levels a line starts with the number of levels not
        drawn (``[+40]``), and a chain of more than :data:`CHAIN` nodes of one child each
        is drawn as its first and last node around a line counting the others. ``drawn``
        counts the nodes drawn and those inside chains. Control characters in names and
        fields are escaped, so that one line is one node.
        """
        drawn = Drawn() if drawn is None else drawn
        for title, i, branch, _, chained in self._shown(root, depth, gpu, collapse=True):
            if i >= 0 and limit is not None and drawn.nodes >= limit:
                return
            if title:
                yield escape_controls(title)
            if i < 0:
                drawn.chained += chained
                yield f"{branch}... {chained:,} nested nodes of one child each"
                continue
            drawn.nodes += 1
            node = Node(self, i)
            shown = [f"{f}: {shortened(_compact(v))}" for f, v in _fields(node, fields).items()]
            text = "  ".join([node.name, duration_text(node.dur), *shown])
            yield escape_controls(branch + text)

    def render(self, root: Node | Sequence[Node] | None = None, **kw: Any) -> str:
        """The text tree of :meth:`lines` (same arguments) as one string."""
        return "\n".join(self.lines(root, **kw))

    def nested(
        self,
        root: Node | Sequence[Node] | None = None,
        *,
        fields: Sequence[str] = DEFAULT_FIELDS,
        depth: int | None = None,
        gpu: bool = False,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """The nodes :meth:`lines` draws as nested dicts for JSON: ``id``, ``name``, ``cat``,
        ``pid``, ``tid``, ``ts`` and ``dur`` (microseconds), the ``fields`` the event has,
        and ``children``; no chain is collapsed."""
        out: list[dict[str, Any]] = []
        open_: list[dict[str, Any]] = []
        trace = self.trace
        for _, i, _, level, _ in islice(self._shown(root, depth, gpu), limit):
            node = Node(self, i)
            item = {
                "id": i,
                "name": node.name,
                "cat": node.cat,
                "pid": trace.pid.value(i),
                "tid": trace.tid.value(i),
                "ts": node.start,
                "dur": node.dur,
                "fields": _fields(node, fields),
                "children": [],
            }
            del open_[level:]
            (open_[-1]["children"] if open_ else out).append(item)
            open_.append(item)
        return out

    def _visible(self, gpu: bool) -> np.ndarray:
        return self.included & (gpu | ~self.in_category(_is_gpu_category))

    def count(
        self, root: Node | Sequence[Node] | None = None, *, depth: int | None = None, gpu=False
    ) -> int:
        """How many nodes :meth:`lines` shows without a limit (those in chains included)."""
        visible = self._visible(gpu)
        if root is None and depth is None:
            under = (self.parent >= 0) & visible
            if not (~visible[self.parent[under]]).any():  # every shown node is reached
                return int(visible.sum())
        ids, offsets = self._children
        groups = self._groups(root, gpu)
        frontier = np.concatenate([g for _, g in groups]) if groups else np.zeros(0, np.int64)
        total, level = len(frontier), 0
        while len(frontier) and (depth is None or level < depth):
            if len(frontier) == 1:  # a chain: a level costs microseconds
                f = int(frontier[0])
                frontier = ids[offsets[f] : offsets[f + 1]]
                frontier = frontier[visible[frontier]]
            else:
                first, n_kids = offsets[frontier], offsets[frontier + 1] - offsets[frontier]
                at = np.repeat(first - np.cumsum(n_kids) + n_kids, n_kids)
                at += np.arange(len(at))
                frontier = ids[at][visible[ids[at]]]
            total, level = total + len(frontier), level + 1
        return total

    def _groups(self, root, gpu: bool) -> list[tuple[str, np.ndarray]]:
        """The roots drawn, by thread with its title (one untitled group for ``root``)."""
        if root is None:
            visible = self._visible(gpu)
            groups = [
                (f"process {pid}, thread {tid}", ids[visible[ids]])
                for (pid, tid), ids in self._root_ids().items()
            ]
            return [(title, ids) for title, ids in groups if len(ids)]
        nodes = [root] if isinstance(root, Node) else list(root)
        return [("", np.array([n.id for n in nodes], dtype=np.int64))]

    def _shown(
        self, root, depth: int | None, gpu: bool, collapse: bool = False
    ) -> Iterator[tuple[str, int, str, int, int]]:
        """Each line drawn, depth first: its thread's title when it is the first of its
        thread (else ""), the node's id, the text drawn before its name, its level below
        the root, and 0; with ``collapse``, a chain of more than :data:`CHAIN` nodes of one
        child each is drawn as its first node, a line with id -1 and the number of nodes
        between, and its last node."""
        ids, offsets = self._children
        visible = self._visible(gpu)

        def kids(i: int) -> list[int]:
            found = ids[offsets[i] : offsets[i + 1]]
            return found[visible[found]].tolist()

        starts, kid, shown = memoryview(offsets), memoryview(ids), memoryview(visible)

        def chain(below: list[int], level: int) -> tuple[int, int, int]:
            """The chain of nodes of one child each that starts at a node's only child
            ``below``, down to the first node with no child or several, within ``depth``:
            its first and last node and its length (0 for none). A chain as deep as the
            trace is walked without a list of its nodes."""
            if len(below) != 1:
                return -1, -1, 0
            last, n = below[0], 1
            while depth is None or level + n < depth:
                a, b = starts[last], starts[last + 1]
                if b - a == 1 and shown[kid[a]]:
                    last, n = kid[a], n + 1
                    continue
                after = kids(last) if b - a > 1 else []
                if len(after) != 1:
                    break
                last, n = after[0], n + 1
            return below[0], last, n

        def before(guides: str, drawn_level: int, last: bool) -> str:
            hidden = f"[+{drawn_level - INDENT}] " if drawn_level > INDENT else ""
            return hidden + guides + ("└── " if last else "├── ")

        for title, nodes in self._groups(root, gpu):
            count = len(nodes)
            for k in range(count):  # not a list: a trace may have millions of roots
                first = int(nodes[k])
                # (id, guides drawn before the branch, last of its siblings, level, drawn level)
                stack = [(first, "", k == count - 1, 0, 0)]
                while stack:
                    i, guides, last, level, drawn_level = stack.pop()
                    yield title, i, before(guides, drawn_level, last), level, 0
                    title = ""
                    if depth is not None and level >= depth:
                        continue
                    below = kids(i)
                    inner = (guides + ("    " if last else "│   "))[-4 * INDENT :]
                    top, bottom, n = chain(below, level) if collapse else (-1, -1, 0)
                    if n > CHAIN:
                        yield "", top, before(inner, drawn_level + 1, True), level + 1, 0
                        inner = (inner + "    ")[-4 * INDENT :]
                        yield "", -1, before(inner, drawn_level + 2, False), -1, n - 2
                        stack.append((bottom, inner, True, level + n, drawn_level + 2))
                        continue
                    stack.extend(
                        (c, inner, j == len(below) - 1, level + 1, drawn_level + 1)
                        for j, c in reversed(list(enumerate(below)))
                    )

    def html(self, root: Node | Sequence[Node] | None = None, **kw: Any) -> str:
        """The text rendering in a ``<pre>`` block, for notebooks and the site."""
        return f'<pre class="mpguide-tree">{escape(self.render(root, **kw))}</pre>'

    def __repr__(self) -> str:
        threads = len(self.roots())
        return f"Tree of {len(self)} events in {threads} thread(s); {self.anomalies!r}"

    def _repr_html_(self) -> str:
        return f"<p>{escape(repr(self))}</p>"


def _fields(node: Node, names: Sequence[str]) -> dict[str, Any]:
    """The ``args`` entries among ``names`` that ``node`` has."""
    found = {f: node.field(f) for f in names}
    return {f: v for f, v in found.items() if v is not None}


def _is_gpu_category(cat: str) -> bool:
    """A kernel, memcpy, memset or GPU-side range."""
    return cat in GPU_CATEGORIES or cat.startswith("gpu_")


@dataclass
class Drawn:
    """How many nodes :meth:`Tree.lines` drew, and how many it counted inside chains."""

    nodes: int = 0
    chained: int = 0


def _compact(value: Any) -> str:
    return msgspec.json.encode(value).decode().replace(",", ", ").replace('"', "'")


def build(trace: Events, *, python: bool = False, annotations: bool = True) -> Tree:
    """Nest a trace's complete events into per-thread call trees (see the module docs).

    Memory beyond the trace is a few bytes an event (masks, parents, depths, the time
    order) and the arrays of one chunk of :data:`_CHUNK` events: times in nanoseconds are
    made a chunk at a time."""
    n = len(trace)
    cat, cats = trace.cat
    left_out = {PYTHON} if not python else set()
    left_out |= {ANNOTATION} if not annotations else set()
    included = ~np.isin(cat, [k for k, c in enumerate(cats) if c in left_out])
    per_cat = np.bincount(cat, minlength=len(cats)).tolist()
    hidden = {c: k for c, k in zip(cats, per_cat, strict=True) if c in left_out and k}
    is_gpu = np.isin(cat, [k for k, c in enumerate(cats) if c in GPU_CATEGORIES])
    runtime = np.isin(cat, [k for k, c in enumerate(cats) if c in RUNTIME_CATEGORIES])
    rank = np.array([_LAYER_RANK.get(c, 2) for c in cats], dtype=np.int8)[cat]
    timed = ~(np.isnan(trace.ts) | np.isnan(trace.dur))
    for lo in range(0, n, _CHUNK):
        ts, dur = trace.ts[lo : lo + _CHUNK], trace.dur[lo : lo + _CHUNK]
        with np.errstate(over="ignore", invalid="ignore"):  # the check is for such times
            good = (np.abs(ts) <= MAX_US) & (dur >= 0) & (np.abs(ts + dur) <= MAX_US)
        bad = ~good & timed[lo : lo + _CHUNK]
        if bad.any():
            raise _bad_time(trace, lo + int(np.flatnonzero(bad)[0]))
    first = float(np.min(trace.ts, where=timed, initial=np.inf))
    base = int(_absolute_ns(np.array([first]))[0]) if timed.any() else 0
    no_time = int((included & ~timed).sum())
    included &= timed
    del timed
    n_tid = np.int64(max(len(trace.tid.values), 1))
    pid_codes, tid_codes = trace.pid.codes, trace.tid.codes
    thread = _Lazy(lambda ids: pid_codes[ids] * n_tid + tid_codes[ids])
    start = _Lazy(lambda ids: _spans(trace, ids, base)[0])
    index = _index_type(n)
    parent = np.full(n, -1, dtype=index)
    linked, shared, ambiguous = _link_gpu(
        trace,
        np.flatnonzero(included & is_gpu),
        np.flatnonzero(included & runtime),
        start,
        thread,
        base,
        parent,
    )
    del runtime
    nested = _where(included & ~linked, index)
    if len(trace.pid.values) * len(trace.tid.values) > 1:
        key = thread[nested]
        if (np.diff(key) < 0).any():
            by = np.argsort(key, kind="stable")
            nested, key = nested[by], key[by]
            del by
        bounds = [0, *(np.flatnonzero(np.diff(key)) + 1).tolist(), len(nested)]
        del key
    else:
        bounds = [0, len(nested)]
    depth = np.zeros(n, dtype=index)
    seen: Counter = Counter()
    for lo, hi in pairwise(bounds):
        if lo == hi:
            continue
        if not _sorted_runs(nested, trace, base, rank, lo, hi):
            _sort_thread(nested, trace, base, rank, lo, hi)
        counts = _nest_thread(nested, trace, base, lo, hi, parent, depth)
        if counts is None:  # an overlap: one stack over the whole thread
            ids = nested[lo:hi]
            par, dep, counts = _nest(*_spans(trace, ids, base))
            parent[ids] = np.where(par >= 0, ids[par], -1)
            depth[ids] = dep
        seen += counts
    del rank
    linked_ids = _where(linked, index)
    depth[linked_ids] = depth[parent[linked_ids]] + 1
    order = np.concatenate((nested, linked_ids))
    anomalies = Anomalies(
        overlaps=seen["overlaps"],
        touching=seen["touching"],
        identical=seen["identical"],
        shared_correlation=shared,
        ambiguous_gpu=ambiguous,
        unlinked_gpu=int((is_gpu & included & ~linked).sum()),
        no_time=no_time,
        replaced=trace.replaced,
    )
    return Tree(trace, included, parent, depth, order, anomalies, is_gpu, hidden)

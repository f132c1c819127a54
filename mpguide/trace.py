"""Read chrome traces exported by ``torch.profiler`` and build their call trees.

:func:`load` reads a ``.json`` or ``.json.gz`` trace with a typed decoder into one array
per field (:class:`Trace`); each event's ``args`` stay undecoded bytes until a node's fields
are asked for. A large plain ``.json`` is cut at an event boundary near its middle and the
two halves are decoded at once, here and in a worker process; when either half does not
decode on its own, the file is decoded in one piece. :func:`build` nests the complete (``ph: "X"``) events into one tree per
process and thread:

- CPU events nest by time interval on integer nanoseconds, sorted by start, then longest
  first, then layer (annotation, Python, op), then file order. An interval is half-open: an
  event starting at another's exact end follows it as a sibling.
- GPU kernels, memcpys and memsets hang under the runtime launch with the same correlation
  id (a graph launch gets all its kernels); a GPU event without a launch stays in its stream's
  tree.
- ``python_function`` events are an optional layer (``python=True``), and so are
  ``user_annotation`` ranges such as ``ProfilerStep#N`` (``annotations=False`` leaves them
  out). Left-out events are counted, never lost.

Every other case has a defined place and is counted in :class:`Anomalies`: an event that
overlaps its parent without nesting stays under the parent it starts in; identical intervals
nest in file order; a correlation id shared by several launches (a merged trace of several
ranks) links each GPU event to the latest launch that precedes it.
"""

from __future__ import annotations

import gc
import gzip
import math
import mmap
import os
import pickle
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import cached_property
from html import escape
from itertools import compress, repeat
from operator import attrgetter, is_not, not_
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np

from mpguide import MPGuideError

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
PYTHON, ANNOTATION, OP = "python_function", "user_annotation", "cpu_op"
_LAYER_RANK = {ANNOTATION: 0, PYTHON: 1}
DEFAULT_FIELDS = ("Input Dims", "Input type")


class Event(msgspec.Struct, gc=False):
    """One trace event as exported; ``args`` is kept as raw JSON until needed."""

    ph: str = ""
    name: str = ""
    cat: str = ""
    pid: int | str = 0
    tid: int | str = 0
    ts: float = 0.0
    dur: float = 0.0
    args: msgspec.Raw = msgspec.Raw(b"{}")


class _File(msgspec.Struct, gc=False):
    traceEvents: list[Event]


class _Link(msgspec.Struct, gc=False):
    correlation: int | None = None


_DECODER = msgspec.json.Decoder(_File | list[Event])
_LINKS = msgspec.json.Decoder(list[_Link])
PARALLEL_BYTES = 64 << 20
"""Plain traces at least this large are decoded in two processes."""


class Coded(NamedTuple):
    """A column kept as each event's index into the column's distinct values."""

    codes: np.ndarray
    values: list

    def value(self, i: int) -> Any:
        return self.values[self.codes[i]]


@dataclass(frozen=True, eq=False)
class Args:
    """Each event's ``args`` as undecoded JSON, cut from a few byte blobs: event ``i`` ends
    at byte ``ends[i]`` of the blobs laid end to end, blob ``k`` starting at ``offsets[k]``."""

    blobs: tuple[bytes, ...]
    offsets: np.ndarray
    ends: np.ndarray

    def raws(self, ids: np.ndarray) -> list[bytes]:
        """The ``args`` JSON of each event in ``ids``."""
        stop = self.ends[ids]
        start = np.where(ids > 0, self.ends[ids - 1], 0)
        blob = np.searchsorted(self.offsets, start, side="right") - 1
        base = self.offsets[blob]
        cuts = zip(blob.tolist(), (start - base).tolist(), (stop - base).tolist(), strict=True)
        return [self.blobs[k][lo:hi] for k, lo, hi in cuts]

    def raw(self, i: int) -> bytes:
        return self.raws(np.array([i]))[0]


def _columns(events: list[Event], source: str) -> Trace:
    """The complete events as columns, the others counted by phase."""
    is_complete = [e.ph == "X" for e in events]
    other = Counter(map(attrgetter("ph"), compress(events, map(not_, is_complete))))
    complete = list(compress(events, is_complete))
    n = len(complete)
    coded = [Coded(*codes(map(attrgetter(f), complete), n)) for f in ("name", "cat", "pid", "tid")]
    ts, dur = (np.fromiter(map(attrgetter(f), complete), float, n) for f in ("ts", "dur"))
    raws = list(map(attrgetter("args"), complete))
    ends = np.cumsum(np.fromiter(map(len, raws), np.int64, n))
    args = Args((b"".join(raws),), np.zeros(1, np.int64), ends)
    return Trace(*coded, ts, dur, args, dict(other), source)


def _merged(columns: list[Coded]) -> Coded:
    """One column from the pieces' columns, the codes renumbered over all distinct values."""
    index = _Index()
    parts = [
        np.fromiter(map(index.__getitem__, c.values), np.int64, len(c.values))[c.codes]
        for c in columns
    ]
    return Coded(np.concatenate(parts), list(index))


def _joined(parts: list[Trace], source: str) -> Trace:
    """One trace of the events of ``parts``, in order."""
    base = np.cumsum([0, *(sum(map(len, p.args.blobs)) for p in parts)])[:-1].tolist()
    return Trace(
        *(_merged([getattr(p, f) for p in parts]) for f in ("name", "cat", "pid", "tid")),
        ts=np.concatenate([p.ts for p in parts]),
        dur=np.concatenate([p.dur for p in parts]),
        args=Args(
            sum((p.args.blobs for p in parts), ()),
            np.concatenate([p.args.offsets + b for p, b in zip(parts, base, strict=True)]),
            np.concatenate([p.args.ends + b for p, b in zip(parts, base, strict=True)]),
        ),
        other=dict(sum((Counter(p.other) for p in parts), Counter())),
        source=source,
    )


class _Events(Sequence):
    """The events of a :class:`Trace`, made one by one when asked for."""

    def __init__(self, trace: Trace):
        self._trace = trace

    def __len__(self) -> int:
        return len(self._trace)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self._trace.event(range(len(self))[i])


@dataclass(frozen=True, eq=False)
class Trace:
    """The complete (``ph: "X"``) events of a chrome trace in file order, one array per
    field, and how many events of each other phase it had."""

    name: Coded
    cat: Coded
    pid: Coded
    tid: Coded
    ts: np.ndarray
    dur: np.ndarray
    args: Args
    other: dict[str, int]
    source: str = ""

    def __len__(self) -> int:
        return len(self.ts)

    def event(self, i: int) -> Event:
        """Event ``i`` as it was exported."""
        return Event(
            ph="X",
            name=self.name.value(i),
            cat=self.cat.value(i),
            pid=self.pid.value(i),
            tid=self.tid.value(i),
            ts=float(self.ts[i]),
            dur=float(self.dur[i]),
            args=msgspec.Raw(self.args.raw(i)),
        )

    @property
    def events(self) -> Sequence[Event]:
        return _Events(self)

    def tree(self, *, python: bool = False, annotations: bool = True) -> Tree:
        """The call tree of this trace; see :func:`build`."""
        return build(self, python=python, annotations=annotations)

    def __repr__(self) -> str:
        counts = np.bincount(self.cat.codes, minlength=len(self.cat.values)).tolist()
        ranked = sorted(zip(counts, self.cat.values, strict=True), key=lambda t: -t[0])
        kinds = ", ".join(f"{n} {c or '(none)'}" for n, c in ranked)
        return f"Trace {self.source or '(in memory)'}: {len(self)} events ({kinds})"


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector: with a million events alive, each of the full
    collections that creating many small objects triggers would walk them all again. The
    objects made meanwhile join the oldest generation unscanned, as if they had survived."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if enabled:
            gc.enable()


def _is_gzip(path: Path) -> bool:
    if not path.is_file():
        raise MPGuideError(f"{path}: no such file")
    with path.open("rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _read(path: Path) -> bytes:
    if not _is_gzip(path):
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (EOFError, gzip.BadGzipFile, OSError) as err:
        raise MPGuideError(f"{path}: broken gzip file ({err})") from None


def _decode(data: bytes | bytearray | mmap.mmap, where: str) -> list[Event]:
    try:
        doc = _DECODER.decode(data)
    except msgspec.ValidationError as err:
        raise MPGuideError(f"{where}: not a chrome trace ({err})") from None
    except msgspec.DecodeError as err:
        raise MPGuideError(f"{where}: not valid JSON ({err})") from None
    return doc if isinstance(doc, list) else doc.traceEvents


@paused_gc()
def parse(data: bytes, source: str = "") -> Trace:
    """A trace from the bytes of a chrome-trace JSON document."""
    return _columns(_decode(data, source or "trace"), source)


@paused_gc()
def load(path: str | Path) -> Trace:
    """Read a chrome trace from ``.json`` or ``.json.gz`` (gzip is detected from the bytes)."""
    path = Path(path)
    if not _is_gzip(path) and path.stat().st_size >= PARALLEL_BYTES:
        halves = _load_halves(path)
        if halves is not None:
            return _joined(halves, str(path))
    return parse(_read(path), str(path))


# A boundary between two events: "}," and then an object whose first key is "ph". Only a
# cut after which both halves decode on their own is used.
_BOUNDARY = re.compile(rb'\}\s*,\s*(\{)\s*"ph"\s*:')
_WINDOW = 1 << 20
_SHARE = 0.6  # of the file decoded here: the worker first starts Python and imports
_WORKER = "import sys; from mpguide.trace import _work; _work(sys.argv[1:])"


def _load_halves(path: Path) -> list[Trace] | None:
    """Decode the first part of ``path`` here while a worker process decodes the rest into
    a temporary file; None when no event boundary is found near the cut or a part does not
    decode."""
    size = path.stat().st_size
    with path.open("rb") as f:
        bracketed = f.read(_WINDOW).lstrip()[:1] == b"["
        f.seek(middle := int(size * _SHARE))
        found = _BOUNDARY.search(f.read(_WINDOW))
    if found is None or not sys.executable:
        return None
    cut, start = middle + found.start() + 1, middle + found.start(1)
    head, tail = (b"]", b"[") if bracketed else (b"]}", b'{"traceEvents":[')
    try:
        return _with_worker(path, cut, start, head, tail)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None  # no temporary folder, no worker or an unreadable result: one piece


def _with_worker(path: Path, cut: int, start: int, head: bytes, tail: bytes) -> list[Trace] | None:
    """Bytes ``:cut`` of ``path`` closed by ``head`` decoded here, and bytes ``start:``
    opened by ``tail`` in a worker; None if either does not decode."""
    package = str(Path(__file__).resolve().parents[1])
    path_list = [package, *filter(None, [os.environ.get("PYTHONPATH")])]
    with tempfile.TemporaryDirectory(prefix="mpguide-") as folder:
        out = Path(folder) / "rest.pickle"
        worker = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(path), str(start), tail.decode(), str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(path_list)},
        )
        first = None
        try:
            first = _piece(path, 0, cut, b"", head)
        finally:
            if first is None:
                worker.kill()
            status = worker.wait()
        if first is None or status != 0:
            return None
        with out.open("rb") as f:
            return [first, pickle.load(f)]


def _piece(path: Path, start: int, stop: int | None, before: bytes, after: bytes) -> Trace | None:
    """Columns of the events in bytes ``start:stop`` of ``path``, framed by ``before`` and
    ``after`` into a document of their own; None if that is not a chrome trace."""
    with path.open("rb") as f:
        size = (os.fstat(f.fileno()).st_size if stop is None else stop) - start
        buf = _buffer(len(before) + size + len(after))
        buf[: len(before)] = before
        f.seek(start)
        if f.readinto(memoryview(buf)[len(before) : len(before) + size]) != size:
            return None
        buf[len(before) + size :] = after
    try:
        return _columns(_decode(buf, str(path)), str(path))
    except MPGuideError:
        return None


def _buffer(size: int) -> bytearray | mmap.mmap:
    """``size`` writable bytes: on POSIX an anonymous map, zeroed only as it is written."""
    if size and hasattr(mmap, "MAP_PRIVATE"):
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return bytearray(size)


def _work(argv: list[str]) -> None:
    """The worker of :func:`_load_halves`: the columns of the events from byte ``start`` to
    the end of file ``path``, framed by ``before``, pickled into file ``out``."""
    path, start, before, out = argv
    with paused_gc():
        part = _piece(Path(path), int(start), None, before.encode(), b"")
    if part is None:
        raise SystemExit(1)
    with open(out, "wb") as f:
        pickle.dump(part, f, protocol=pickle.HIGHEST_PROTOCOL)


@dataclass(frozen=True)
class Anomalies:
    """How many events met each case that a plain interval nesting gets wrong."""

    overlaps: int = 0
    touching: int = 0
    identical: int = 0
    shared_correlation: int = 0
    unlinked_gpu: int = 0
    left_out: int = 0

    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "left_out")

    def __repr__(self) -> str:
        parts = [f"{f.name.replace('_', ' ')} {getattr(self, f.name)}" for f in fields(self)]
        return "anomalies: " + ", ".join(parts)


def _args(raw: bytes) -> dict[str, Any]:
    value = msgspec.json.decode(raw)
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True, eq=False)
class Node:
    """One event in a :class:`Tree`; ``id`` is its index among the trace's complete events."""

    tree: Tree
    id: int

    @property
    def event(self) -> Event:
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
        return self.cat in GPU_CATEGORIES or self.cat.startswith("gpu_")

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


def _nanoseconds(ts: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end in integer nanoseconds since the first event.

    Exports write microseconds with three decimals, but a double near 4e12 us is only good
    to about a nanosecond, so ``ts * 1000`` can round to the wrong nanosecond and nest a
    child past its parent's end. The nanosecond kept is the one whose decimal parses to
    exactly this ``ts``.
    """
    ns = np.rint(ts * 1000.0)
    for step in (-1.0, 1.0):
        wrong = ns / 1000.0 != ts
        ns[wrong & ((ns + step) / 1000.0 == ts)] += step
    start = ns.astype(np.int64)
    start -= start.min() if len(start) else 0
    return start, start + np.rint(dur * 1000.0).astype(np.int64)


class Tree:
    """Call trees of a :class:`Trace`, one per process and thread, as parent links.

    Build it with :func:`build`. ``parent[i]`` is the parent's id or -1 for a root;
    :meth:`roots` lists each thread's roots; :meth:`find` looks nodes up.
    """

    def __init__(
        self,
        trace: Trace,
        included: np.ndarray,
        parent: np.ndarray,
        depth: np.ndarray,
        order: np.ndarray,
        anomalies: Anomalies,
        gpu_work: np.ndarray,
    ):
        self.trace = trace
        self.included = included
        self.parent = parent
        self.depth = depth
        self.order = order
        self.anomalies = anomalies
        self.gpu_work = gpu_work & included
        self.dur_us = trace.dur

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
        by_parent = kids[np.argsort(self.parent[kids], kind="stable")]
        counts = np.bincount(self.parent[by_parent], minlength=len(self.parent))
        offsets = np.concatenate(([0], np.cumsum(counts)))
        return by_parent, offsets

    def children_ids(self, i: int) -> list[int]:
        ids, offsets = self._children
        return ids[offsets[i] : offsets[i + 1]].tolist()

    def roots(self) -> dict[tuple[int | str, int | str], list[Node]]:
        """Each (pid, tid)'s root nodes in time order."""
        out: dict[tuple[int | str, int | str], list[Node]] = {}
        pid, tid = self.trace.pid, self.trace.tid
        for i in self.order[self.parent[self.order] < 0].tolist():
            out.setdefault((pid.value(i), tid.value(i)), []).append(Node(self, i))
        return out

    def named(self, predicate: Callable[[str], bool]) -> np.ndarray:
        """Mask of the events whose name satisfies ``predicate`` (asked once per name)."""
        return _matching(self.trace.name, predicate)

    def in_category(self, predicate: Callable[[str], bool]) -> np.ndarray:
        """Mask of the events whose category satisfies ``predicate`` (asked once per category)."""
        return _matching(self.trace.cat, predicate)

    @cached_property
    def parents(self) -> list[int]:
        """``parent`` as a list, for fast walks up the tree."""
        return self.parent.tolist()

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
        for d in range(int(self.depth.max()), 0, -1):
            at = np.flatnonzero((self.depth == d) & (self.parent >= 0))
            np.add.at(acc, self.parent[at], acc[at])
        return acc

    def find(
        self,
        name: str | None = None,
        *,
        id: int | None = None,
        predicate: Callable[[Node], bool] | None = None,
    ) -> list[Node]:
        """Nodes, thread by thread in time order, whose name equals ``name``, whose id is ``id``, and for which
        ``predicate`` holds (each criterion only when given)."""
        if id is not None:
            return [self.node(id)]
        ids = self.order
        if name is not None:
            ids = ids[self.named(name.__eq__)[ids]]
        nodes = [Node(self, i) for i in ids.tolist()]
        return [n for n in nodes if predicate(n)] if predicate else nodes

    def render(
        self,
        root: Node | Sequence[Node] | None = None,
        *,
        fields: Sequence[str] = DEFAULT_FIELDS,
        depth: int | None = None,
        gpu: bool = False,
    ) -> str:
        """A text tree (``└── aten::matmul  Input Dims: ...``) of ``root`` or of every thread.

        ``fields`` are ``args`` entries shown after the name; ``depth`` limits the levels
        shown below each root; GPU events are shown only with ``gpu=True``.
        """
        lines: list[str] = []
        for title, nodes in self._groups(root, gpu):
            if title:
                lines.append(title)
            for k, node in enumerate(nodes):
                self._render(node, "", k == len(nodes) - 1, fields, depth, gpu, lines)
        return "\n".join(lines)

    def _groups(self, root, gpu: bool) -> list[tuple[str, list[Node]]]:
        if root is None:
            groups = [
                (f"process {pid}, thread {tid}", [n for n in nodes if gpu or not n.is_gpu])
                for (pid, tid), nodes in self.roots().items()
            ]
            return [(title, nodes) for title, nodes in groups if nodes]
        return [("", [root] if isinstance(root, Node) else list(root))]

    def _render(self, node: Node, prefix: str, last: bool, fields, depth, gpu, lines) -> None:
        label = node.name
        shown = [f"{f}: {_compact(node.field(f))}" for f in fields if node.field(f) is not None]
        lines.append(f"{prefix}{'└── ' if last else '├── '}{'  '.join([label, *shown])}")
        if depth is not None and depth <= 0:
            return
        kids = [c for c in node.children if gpu or not c.is_gpu]
        inner = prefix + ("    " if last else "│   ")
        for k, child in enumerate(kids):
            self._render(
                child,
                inner,
                k == len(kids) - 1,
                fields,
                None if depth is None else depth - 1,
                gpu,
                lines,
            )

    def html(self, root: Node | Sequence[Node] | None = None, **kw: Any) -> str:
        """The text rendering in a ``<pre>`` block, for notebooks and the site."""
        return f'<pre class="mpguide-tree">{escape(self.render(root, **kw))}</pre>'

    def __repr__(self) -> str:
        threads = len(self.roots())
        return f"Tree of {len(self)} events in {threads} thread(s); {self.anomalies!r}"

    def _repr_html_(self) -> str:
        return f"<p>{escape(repr(self))}</p>"


def _compact(value: Any) -> str:
    return msgspec.json.encode(value).decode().replace(",", ", ").replace('"', "'")


_RUNTIME_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver", "hip_runtime", "hip_driver"})


class _Index(dict):
    """Numbers values in the order they first appear."""

    def __missing__(self, value: Any) -> int:
        self[value] = code = len(self)
        return code


def codes(values: Iterable, n: int) -> tuple[np.ndarray, list]:
    """Each of ``n`` values' index among the distinct values, and the distinct values."""
    index = _Index()
    return np.fromiter(map(index.__getitem__, values), np.int64, n), list(index)


def _matching(coded: tuple[np.ndarray, list], predicate: Callable[[Any], bool]) -> np.ndarray:
    codes, distinct = coded
    return np.fromiter(map(predicate, distinct), bool, len(distinct))[codes]


def _link_gpu(
    args: Args,
    candidates: np.ndarray,
    is_gpu: np.ndarray,
    start: np.ndarray,
    parent: np.ndarray,
) -> tuple[np.ndarray, int]:
    """Parent every GPU event to its launch; return the mask of linked events and the number
    of GPU events whose correlation id several launches share."""
    links = _LINKS.decode(b"[" + b",".join(args.raws(candidates)) + b"]")
    correlations = list(map(attrgetter("correlation"), links))
    correlated = np.fromiter(map(is_not, correlations, repeat(None)), bool, len(links))
    ids = candidates[correlated]
    corr = np.fromiter(compress(correlations, correlated), np.int64, len(ids))
    on_gpu = is_gpu[ids]
    launches, gpu = ids[~on_gpu], ids[on_gpu]
    by_corr = np.argsort(corr[~on_gpu], kind="stable")
    launch_corr = corr[~on_gpu][by_corr]
    first = np.searchsorted(launch_corr, corr[on_gpu], side="left")
    count = np.searchsorted(launch_corr, corr[on_gpu], side="right") - first
    linked = np.zeros(len(is_gpu), dtype=bool)
    linked[gpu[count > 0]] = True
    parent[gpu[count == 1]] = launches[by_corr[first[count == 1]]]
    for i, lo, n in zip(gpu[count > 1].tolist(), first[count > 1], count[count > 1], strict=True):
        found = launches[by_corr[lo : lo + n]].tolist()
        before = [j for j in found if start[j] <= start[i]]
        parent[i] = max(before, key=lambda j: start[j]) if before else found[0]
    return linked, int((count > 1).sum())


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
    position = np.arange(m)
    # Earlier events ended by start[k]: all ends up to it, less the zero-length events at
    # start[k] sorted after k (they close the group of events with that start).
    zero_length = np.concatenate(([0], np.cumsum(start == end)))
    group_end = np.searchsorted(start, start, side="right")
    ended = np.searchsorted(np.sort(end), start, side="right")
    depth = position - ended + zero_length[group_end] - zero_length[position]
    by_level = np.sort(depth * m + position)
    above = by_level[np.maximum(np.searchsorted(by_level, (depth - 1) * m + position) - 1, 0)]
    nested = depth > 0
    parent = np.where(nested, above % m, -1)
    if (above[nested] // m != depth[nested] - 1).any() or (end > end[parent])[nested].any():
        return None
    closer = np.searchsorted(start, end)  # the event that closes each one, if any
    closed = (start < end) & (closer < m)
    touching = start[closer[closed]] == end[closed]
    identical = nested & (start == start[parent]) & (end == end[parent])
    return parent, depth, Counter(touching=int(touching.sum()), identical=int(identical.sum()))


def _nest(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, Counter]:
    """Each event's parent position (-1 for a root) and depth among one thread's events,
    given in (start, longest first) order, and the counts of overlapping, touching and
    identical intervals."""
    found = _nest_without_overlaps(start, end)
    if found is not None:
        return found
    parents, depths, seen = _nest_in_stack(start.tolist(), end.tolist())
    return np.array(parents, dtype=np.int64), np.array(depths, dtype=np.int64), seen


def _time_order(
    ids: np.ndarray, start: np.ndarray, end: np.ndarray, rank: np.ndarray, thread: np.ndarray
) -> np.ndarray:
    """``ids`` sorted by thread, then start, then longest first, then layer, then file order.

    Exports often list each thread's events in time order already: then only threads need
    sorting.
    """
    ids = ids[np.argsort(thread[ids], kind="stable")]
    first = start[ids]
    by_length = (first - end[ids]) * 4 + rank[ids]
    later, shorter, other_thread = np.diff(first), np.diff(by_length), np.diff(thread[ids])
    if not ((later > 0) | ((later == 0) & (shorter >= 0)) | (other_thread != 0)).all():
        ids = ids[np.lexsort((by_length, first, thread[ids]))]
    return ids


def build(trace: Trace, *, python: bool = False, annotations: bool = True) -> Tree:
    """Nest a trace's complete events into per-thread call trees (see the module docs)."""
    n = len(trace)
    cat, cats = trace.cat
    left_out = {PYTHON} if not python else set()
    left_out |= {ANNOTATION} if not annotations else set()
    included = ~np.isin(cat, [k for k, c in enumerate(cats) if c in left_out])
    is_gpu = np.isin(cat, [k for k, c in enumerate(cats) if c in GPU_CATEGORIES])
    runtime = np.isin(cat, [k for k, c in enumerate(cats) if c in _RUNTIME_CATEGORIES])
    rank = np.array([_LAYER_RANK.get(c, 2) for c in cats], dtype=np.int64)[cat]
    ts, dur = trace.ts, trace.dur
    if n and (not np.isfinite(ts).all() or not np.isfinite(dur).all() or (dur < 0).any()):
        raise MPGuideError(f"{trace.source or 'trace'}: an event has a non-finite or negative time")
    start, end = _nanoseconds(ts, dur)
    parent = np.full(n, -1, dtype=np.int64)
    linked, shared = _link_gpu(
        trace.args, np.flatnonzero(included & (is_gpu | runtime)), is_gpu, start, parent
    )
    thread = trace.pid.codes * len(trace.tid.values) + trace.tid.codes

    nested = np.flatnonzero(included & ~linked)
    nested = _time_order(nested, start, end, rank, thread)
    depth = np.zeros(n, dtype=np.int64)
    seen: Counter = Counter()
    bounds = np.flatnonzero(np.diff(thread[nested])) + 1
    for ids in np.split(nested, bounds):
        par, dep, counts = _nest(start[ids], end[ids])
        parent[ids] = np.where(par >= 0, ids[par], -1)
        depth[ids] = dep
        seen += counts
    linked_ids = np.flatnonzero(linked)
    depth[linked_ids] = depth[parent[linked_ids]] + 1
    order = np.concatenate((nested, linked_ids))
    anomalies = Anomalies(
        overlaps=seen["overlaps"],
        touching=seen["touching"],
        identical=seen["identical"],
        shared_correlation=shared,
        unlinked_gpu=int((is_gpu & included & ~linked).sum()),
        left_out=int(n - included.sum()),
    )
    return Tree(trace, included, parent, depth, order, anomalies, is_gpu)


def casts(tree: Tree):
    """The cast report of a tree: see :func:`mpguide.casts.report`."""
    from mpguide.casts import report

    return report(tree)

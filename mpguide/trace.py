"""Read chrome traces exported by ``torch.profiler`` and build their call trees.

:func:`load` reads a ``.json`` or ``.json.gz`` trace a few megabytes at a time with a typed
decoder into one array per field (:class:`Trace`); each event's ``args`` stay undecoded
bytes until a node's fields are asked for, and ``args_of`` keeps only those a tool reads. A
large plain ``.json`` is cut at an event boundary near its middle and the two parts are read
at once, here and in a worker process. When a part does not decode piece by piece (an event
boundary was found inside an event's ``args``), the file is decoded in one piece: the same
trace, with the memory of the whole document. :func:`build` nests the complete (``ph: "X"``)
events into one tree per process and thread:

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
nest in file order; an event without ``ts`` or ``dur`` is left out of the tree; bytes that are
not UTF-8 are replaced by U+FFFD. An id shared by launches of several processes (a merged
trace of several ranks) links a GPU event to the launch in its own process, else in the
process its unambiguous links pair it with, else to none: a GPU event is never linked to
another rank's launch by guess. Within one process, the latest launch that precedes the GPU
event is taken.
"""

from __future__ import annotations

import codecs
import gc
import gzip
import logging
import math
import os
import pickle
import re
import subprocess
import sys
import tempfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import cached_property
from html import escape
from itertools import compress, islice, repeat
from operator import attrgetter, is_not, not_
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np

from mpguide import MPGuideError, error_line

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
    ts: float = math.nan
    dur: float = math.nan
    args: msgspec.Raw = msgspec.Raw(b"{}")
    id: int | str | None = None


class _File(msgspec.Struct, gc=False):
    traceEvents: list[Event]


class _Link(msgspec.Struct, gc=False):
    correlation: int | str | None = None


_DECODER = msgspec.json.Decoder(_File | list[Event])
FLOW = "ac2g"
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


def _keeps_args(name: Coded, cat: Coded, args_of: Callable[[str], bool]) -> np.ndarray:
    """Mask of the events whose name ``args_of`` accepts, and of launches and GPU events."""
    linked = GPU_CATEGORIES | _RUNTIME_CATEGORIES
    return _matching(name, args_of) | _matching(cat, linked.__contains__)


def _flows(others: list[Event], phase: Coded) -> Flows:
    """The ``ac2g`` flow starts and ends among ``others``, whose phases are ``phase``, with an
    ``id`` and a finite time."""
    flow_phase = _matching(phase, ("s", "f").__contains__)
    maybe = list(compress(others, flow_phase.tolist()))
    n = len(maybe)
    ts = np.fromiter(map(attrgetter("ts"), maybe), float, n)
    cat = np.fromiter(map(FLOW.__eq__, map(attrgetter("cat"), maybe)), bool, n)
    has_id = np.fromiter(map(is_not, map(attrgetter("id"), maybe), repeat(None)), bool, n)
    events = list(compress(maybe, (cat & has_id & np.isfinite(ts)).tolist()))
    n = len(events)
    return Flows(
        np.fromiter(map("s".__eq__, map(attrgetter("ph"), events)), bool, n),
        *(Coded(*codes(map(attrgetter(f), events), n)) for f in ("id", "pid", "tid")),
        np.fromiter(map(attrgetter("ts"), events), float, n),
    )


def _columns(events: list[Event], source: str, replaced: int = 0, args_of=None) -> Trace:
    """The complete events as columns, the flow events apart, the others counted by phase;
    ``args`` only of the events :func:`_keeps_args` says."""
    is_complete = [e.ph == "X" for e in events]
    others = list(compress(events, map(not_, is_complete)))
    phase = Coded(*codes(map(attrgetter("ph"), others), len(others)))
    counts = np.bincount(phase.codes, minlength=len(phase.values)).tolist()
    other = dict(zip(phase.values, counts, strict=True))
    complete = list(compress(events, is_complete))
    n = len(complete)
    coded = [Coded(*codes(map(attrgetter(f), complete), n)) for f in ("name", "cat", "pid", "tid")]
    ts, dur = (np.fromiter(map(attrgetter(f), complete), float, n) for f in ("ts", "dur"))
    raws = list(map(attrgetter("args"), complete))
    kept = None if args_of is None else _keeps_args(coded[0], coded[1], args_of)
    lengths = np.fromiter(map(len, raws), np.int64, n)
    if kept is not None:
        raws = list(compress(raws, kept.tolist()))
        lengths[~kept] = 0
    args = Args((b"".join(raws),), np.zeros(1, np.int64), np.cumsum(lengths), kept)
    return Trace(*coded, ts, dur, args, other, _flows(others, phase), source, replaced)


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
    kept = [p.args.kept for p in parts]
    return Trace(
        *(_merged([getattr(p, f) for p in parts]) for f in ("name", "cat", "pid", "tid")),
        ts=np.concatenate([p.ts for p in parts]),
        dur=np.concatenate([p.dur for p in parts]),
        args=Args(
            sum((p.args.blobs for p in parts), ()),
            np.concatenate([p.args.offsets + b for p, b in zip(parts, base, strict=True)]),
            np.concatenate([p.args.ends + b for p, b in zip(parts, base, strict=True)]),
            None if kept[0] is None else np.concatenate(kept),
        ),
        other=dict(sum((Counter(p.other) for p in parts), Counter())),
        flows=Flows(
            np.concatenate([p.flows.start for p in parts]),
            *(_merged([getattr(p.flows, f) for p in parts]) for f in ("key", "pid", "tid")),
            np.concatenate([p.flows.ts for p in parts]),
        ),
        source=source,
        replaced=sum(p.replaced for p in parts),
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
    field (``ts`` and ``dur`` NaN where the event has none), how many events of each other
    phase it had, its ``ac2g`` flow events, and how many invalid UTF-8 sequences were
    replaced while reading it."""

    name: Coded
    cat: Coded
    pid: Coded
    tid: Coded
    ts: np.ndarray
    dur: np.ndarray
    args: Args
    other: dict[str, int]
    flows: Flows
    source: str = ""
    replaced: int = 0

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
    if path.is_dir():
        raise MPGuideError(f"{path}: is a directory, not a trace file")
    if not path.exists():
        raise MPGuideError(f"{path}: no such file")
    if not path.is_file():
        raise MPGuideError(f"{path}: not a regular file")
    with path.open("rb") as f:
        return f.read(2) == b"\x1f\x8b"


@contextmanager
def _gzip_errors(path: Path) -> Iterator[None]:
    try:
        yield
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise MPGuideError(f"{path}: broken gzip file ({err})") from None


@contextmanager
def _filler(path: Path, start: int = 0, stop: int | None = None) -> Iterator[Callable]:
    """A function filling a buffer with the next bytes of ``path`` (decompressed when it is
    gzip), from byte ``start`` to byte ``stop`` of a plain file; it returns how many."""
    if _is_gzip(path):
        with gzip.open(path, "rb") as z:

            def unzip(view: memoryview) -> int:
                with _gzip_errors(path):
                    return z.readinto(view)

            yield unzip
        return
    with path.open("rb") as f:
        f.seek(start)
        left = [math.inf if stop is None else stop - start]

        def fill(view: memoryview) -> int:
            got = f.readinto(view[: int(min(len(view), left[0]))])
            left[0] -= got
            return got

        yield fill


def _read(path: Path) -> bytes:
    if not _is_gzip(path):
        return path.read_bytes()
    with gzip.open(path, "rb") as z, _gzip_errors(path):
        return z.read()


_UTF8_CHUNK = 1 << 24
_REPLACEMENT = "\ufffd"


def _invalid_utf8(data: bytes | bytearray | memoryview) -> int:
    """How many invalid UTF-8 sequences ``data`` holds, decoded a piece at a time (none
    when it is ASCII, which is checked at once)."""
    if np.frombuffer(data, np.uint8).max(initial=0) < 0x80:
        return 0
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    view = memoryview(data)
    found = sum(
        decoder.decode(view[i : i + _UTF8_CHUNK]).count(_REPLACEMENT)
        for i in range(0, len(data), _UTF8_CHUNK)
    )
    found += decoder.decode(b"", final=True).count(_REPLACEMENT)
    return found - bytes(data).count(_REPLACEMENT.encode())


def _decode(data: bytes | bytearray | memoryview, where: str) -> tuple[list[Event], int]:
    """The events of a chrome-trace document, and how many invalid UTF-8 sequences were
    replaced by U+FFFD to decode it."""
    replaced = _invalid_utf8(data)
    try:
        doc = _DECODER.decode(bytes(data).decode("utf-8", "replace") if replaced else data)
    except msgspec.ValidationError as err:
        raise MPGuideError(f"{where}: not a chrome trace ({err})") from None
    except msgspec.DecodeError as err:
        raise MPGuideError(f"{where}: not valid JSON ({err})") from None
    return (doc if isinstance(doc, list) else doc.traceEvents), replaced


@paused_gc()
def parse(data: bytes, source: str = "", args_of: Callable[[str], bool] | None = None) -> Trace:
    """A trace from the bytes of a chrome-trace JSON document; bytes that are not UTF-8 are
    replaced by U+FFFD and counted (:attr:`Trace.replaced`). ``args_of``: see :func:`load`."""
    events, replaced = _decode(data, source or "trace")
    return _columns(events, source, replaced, args_of)


@paused_gc()
def load(path: str | Path, *, args_of: Callable[[str], bool] | None = None) -> Trace:
    """Read a chrome trace from ``.json`` or ``.json.gz`` (gzip is detected from the bytes),
    a few megabytes at a time (see :func:`_streamed`).

    ``args_of`` keeps the ``args`` only of the events whose name it accepts, and of the
    launches and GPU events, which linking needs: the others' ``args`` are most of a trace's
    bytes. Asking for a dropped event's ``args`` is an error. It must be a module-level
    function: a large file's second half is decoded in a worker process.
    """
    path = Path(path)
    _pickled(args_of)
    if not _is_gzip(path) and path.stat().st_size >= PARALLEL_BYTES:
        halves = _load_halves(path, args_of)
        if halves is not None:
            return _joined(halves, str(path))
    try:
        with _filler(path) as fill:
            return _streamed(fill, b"", b"", str(path), args_of)
    except MPGuideError:  # in one piece: its own error, if it has one
        return parse(_read(path), str(path), args_of)


def _pickled(args_of: Callable[[str], bool] | None) -> bytes:
    try:
        return pickle.dumps(args_of)
    except (pickle.PicklingError, AttributeError, TypeError):
        raise MPGuideError(f"args_of must be a module-level function, got {args_of!r}") from None


# A boundary between two events: "}," and then an object whose first key is "ph". Only a
# cut after which both halves decode on their own is used.
_BOUNDARY = re.compile(rb'\}\s*,\s*(\{)\s*"ph"\s*:')
_PIECE = 16 << 20


def _last_boundary(data: bytearray, size: int) -> tuple[int, int] | None:
    """Where the last event of ``data[:size]`` before its last boundary ends, and where the
    next begins; the boundary is looked for near the end first."""
    for since in (max(size - _WINDOW, 0), 0):
        found = list(_BOUNDARY.finditer(data, since, size))
        if found:
            return found[-1].start() + 1, found[-1].start(1)
    return None


def _streamed(fill: Callable, first: bytes, last: bytes, where: str, args_of=None) -> Trace:
    """The events of the document that ``fill`` gives, opened by ``first`` and closed by
    ``last``, decoded ``_PIECE`` bytes at a time in one buffer, so that memory holds the
    columns and one piece: each piece ends at an event boundary and is closed (``]``) and
    the rest reopened (``[``) into documents of their own. A document without event
    boundaries (its events' first key is not ``ph``) is one piece; MPGuideError if a piece
    does not decode."""
    parts: list[Trace] = []
    buf = bytearray(max(_PIECE, 2 * len(first)))
    buf[: len(first)] = first
    size, close, reopen = len(first), b"", b""
    while True:
        if size == len(buf):  # no boundary in a whole buffer: a larger one
            buf.extend(bytes(len(buf)))
        with memoryview(buf) as view:
            got = fill(view[size:])
        size += got
        if got and size < len(buf):
            continue
        if not got:
            break
        if not close:
            bracketed = re.match(rb"\s*\[", buf) is not None
            close, reopen = (b"]", b"[") if bracketed else (b"]}", b'{"traceEvents":[')
        found = _last_boundary(buf, size)
        if found is None:
            continue
        cut, start = found
        rest = reopen + buf[start:size]
        buf[cut : cut + len(close)] = close  # over the "," after the event, or the "{"
        with memoryview(buf) as view:
            parts.append(parse(view[: cut + len(close)], where, args_of))
        buf[: len(rest)] = rest
        size = len(rest)
    parts.append(parse(bytes(buf[:size]) + last, where, args_of))
    return parts[0] if len(parts) == 1 else _joined(parts, where)


log = logging.getLogger(__name__)

_WINDOW = 1 << 20
_SHARE = 0.6  # of the file decoded here: the worker first starts Python and imports
_WORKER = "import sys; from mpguide.trace import _work; _work(sys.argv[1:])"


def _load_halves(path: Path, args_of) -> list[Trace] | None:
    """Decode the first part of ``path`` here while a worker process decodes the rest into
    a temporary file; None when no event boundary is found near the cut or a part does not
    decode."""
    size = path.stat().st_size
    with path.open("rb") as f:
        bracketed = f.read(_WINDOW).lstrip()[:1] == b"["
        f.seek(middle := int(size * _SHARE))
        found = _BOUNDARY.search(f.read(_WINDOW))
    if found is None or not sys.executable:
        log.info("%s: decoded in one piece: no event boundary near the cut", path)
        return None
    cut, start = middle + found.start() + 1, middle + found.start(1)
    head, tail = (b"]", b"[") if bracketed else (b"]}", b'{"traceEvents":[')
    try:
        return _with_worker(path, cut, start, head, tail, args_of)
    except (OSError, EOFError, pickle.UnpicklingError) as err:
        # No temporary folder, no worker or an unreadable result: one piece, and why.
        log.info("%s: decoded in one piece: the worker failed: %s", path, error_line(err))
        return None


def _with_worker(
    path: Path, cut: int, start: int, head: bytes, tail: bytes, args_of
) -> list[Trace] | None:
    """Bytes ``:cut`` of ``path`` closed by ``head`` decoded here, and bytes ``start:``
    opened by ``tail`` in a worker; None if either does not decode."""
    keep = _pickled(args_of).hex()
    package = str(Path(__file__).resolve().parents[1])
    path_list = [package, *filter(None, [os.environ.get("PYTHONPATH")])]
    with tempfile.TemporaryDirectory(prefix="mpguide-") as folder:
        out = Path(folder) / "rest.pickle"
        errors = Path(folder) / "stderr"
        argv = [sys.executable, "-c", _WORKER, str(path), str(start), tail.decode(), str(out)]
        with errors.open("wb") as stderr:
            worker = subprocess.Popen(
                [*argv, keep],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(path_list)},
            )
        first = None
        try:
            first = _piece(path, 0, cut, b"", head, args_of)
        finally:
            if first is None:
                worker.kill()
            status = worker.wait()
        if first is None:
            log.info("%s: decoded in one piece: the first part does not decode alone", path)
            return None
        if status != 0:
            said = errors.read_text(errors="replace").strip().splitlines() or ["nothing on stderr"]
            log.info("%s: decoded in one piece: the worker exited %d: %s", path, status, said[-1])
            return None
        with out.open("rb") as f:
            return [first, pickle.load(f)]


def _piece(path: Path, start: int, stop, before: bytes, after: bytes, args_of) -> Trace | None:
    """Columns of the events in bytes ``start:stop`` of ``path``, framed by ``before`` and
    ``after`` into a document of their own; None if that is not a chrome trace."""
    try:
        with _filler(path, start, stop) as fill:
            return _streamed(fill, before, after, str(path), args_of)
    except MPGuideError:
        return None


def _work(argv: list[str]) -> None:
    """The worker of :func:`_load_halves`: the columns of the events from byte ``start`` to
    the end of file ``path``, framed by ``before``, pickled into file ``out``; ``keep`` is
    the pickled ``args_of``."""
    path, start, before, out, keep = argv
    args_of = pickle.loads(bytes.fromhex(keep))
    with paused_gc():
        part = _piece(Path(path), int(start), None, before.encode(), b"", args_of)
    if part is None:
        raise SystemExit(1)
    with open(out, "wb") as f:
        pickle.dump(part, f, protocol=pickle.HIGHEST_PROTOCOL)


@dataclass(frozen=True)
class Anomalies:
    """How many events met each case that a plain interval nesting gets wrong.

    ``shared_correlation`` counts the GPU events whose id launches of several processes
    share; ``ambiguous_gpu`` those of them left unlinked because no process pairing decides;
    ``no_time`` the events without ``ts`` or ``dur``, left out of the tree; ``replaced`` the
    invalid UTF-8 sequences replaced while reading; ``left_out`` the events of layers not
    asked for.
    """

    overlaps: int = 0
    touching: int = 0
    identical: int = 0
    shared_correlation: int = 0
    ambiguous_gpu: int = 0
    unlinked_gpu: int = 0
    no_time: int = 0
    replaced: int = 0
    left_out: int = 0

    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "left_out")

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


def _absolute_ns(ts: np.ndarray) -> np.ndarray:
    """Finite microsecond times in integer nanoseconds.

    Exports write microseconds with three decimals, but a double near 4e12 us is only good
    to about a nanosecond, so ``ts * 1000`` can round to the wrong nanosecond and nest a
    child past its parent's end. The nanosecond kept is the one whose decimal parses to
    exactly this ``ts``.
    """
    ns = np.rint(ts * 1000.0)
    for step in (-1.0, 1.0):
        wrong = ns / 1000.0 != ts
        ns[wrong & ((ns + step) / 1000.0 == ts)] += step
    return ns.astype(np.int64)


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
        limit: int | None = None,
    ) -> str:
        """A text tree (``└── aten::matmul  Input Dims: ...``) of ``root`` or of every thread.

        ``fields`` are ``args`` entries shown after the name; ``depth`` limits the levels
        shown below each root; GPU events are shown only with ``gpu=True``; ``limit`` caps
        the nodes shown, depth first (:meth:`count` says how many there are).
        """
        lines: list[str] = []
        for title, node, branch, _ in islice(self._shown(root, depth, gpu), limit):
            if title:
                lines.append(title)
            shown = [f"{f}: {_compact(v)}" for f, v in _fields(node, fields).items()]
            lines.append(f"{branch}{'  '.join([node.name, *shown])}")
        return "\n".join(lines)

    def nested(
        self,
        root: Node | Sequence[Node] | None = None,
        *,
        fields: Sequence[str] = DEFAULT_FIELDS,
        depth: int | None = None,
        gpu: bool = False,
        limit: int | None = None,
    ) -> list[dict[str, Any]]:
        """The nodes :meth:`render` shows as nested dicts for JSON: ``id``, ``name``, ``cat``,
        ``pid``, ``tid``, ``ts`` and ``dur`` (microseconds), the ``fields`` the event has,
        and ``children``."""
        out: list[dict[str, Any]] = []
        open_: list[dict[str, Any]] = []
        trace = self.trace
        for _, node, _, level in islice(self._shown(root, depth, gpu), limit):
            i = node.id
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

    def count(
        self, root: Node | Sequence[Node] | None = None, *, depth: int | None = None, gpu=False
    ) -> int:
        """How many nodes :meth:`render` shows without a limit."""
        ids, offsets = self._children
        visible = self.included & (gpu | ~self.in_category(_is_gpu_category))
        frontier = np.array([n.id for _, nodes in self._groups(root, gpu) for n in nodes], int)
        total, level = len(frontier), 0
        while len(frontier) and (depth is None or level < depth):
            first, n_kids = offsets[frontier], offsets[frontier + 1] - offsets[frontier]
            at = np.repeat(first - np.cumsum(n_kids) + n_kids, n_kids) + np.arange(n_kids.sum())
            frontier = ids[at][visible[ids[at]]]
            total, level = total + len(frontier), level + 1
        return total

    def _groups(self, root, gpu: bool) -> list[tuple[str, list[Node]]]:
        if root is None:
            groups = [
                (f"process {pid}, thread {tid}", [n for n in nodes if gpu or not n.is_gpu])
                for (pid, tid), nodes in self.roots().items()
            ]
            return [(title, nodes) for title, nodes in groups if nodes]
        return [("", [root] if isinstance(root, Node) else list(root))]

    def _shown(self, root, depth: int | None, gpu: bool) -> Iterator[tuple[str, Node, str, int]]:
        """Each node shown, depth first: its thread's title when it is the first shown of
        its thread (else ""), the node, the branch drawn before its name, and its level."""
        for title, nodes in self._groups(root, gpu):
            stack = [(n, "", k == len(nodes) - 1, 0) for k, n in enumerate(nodes)][::-1]
            while stack:
                node, prefix, last, level = stack.pop()
                yield title, node, prefix + ("└── " if last else "├── "), level
                title = ""
                if depth is not None and level >= depth:
                    continue
                kids = [c for c in node.children if gpu or not c.is_gpu]
                inner = prefix + ("    " if last else "│   ")
                below = [(c, inner, k == len(kids) - 1, level + 1) for k, c in enumerate(kids)]
                stack.extend(reversed(below))

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


class _Links(NamedTuple):
    """GPU events and launches, each with a key (a flow id or a correlation id, as codes)."""

    gpu: np.ndarray
    gpu_key: np.ndarray
    launch: np.ndarray
    launch_key: np.ndarray


def _correlation_links(trace: Trace, gpu: np.ndarray, launch: np.ndarray) -> _Links:
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


def _flow_links(trace: Trace, gpu, launch, start, thread, base: int) -> _Links:
    """GPU events and launches keyed by the ``ac2g`` flows bound to them."""
    flows = trace.flows
    pid = _Index((v, k) for k, v in enumerate(trace.pid.values))
    tid = _Index((v, k) for k, v in enumerate(trace.tid.values))
    pids = np.array([pid[v] for v in flows.pid.values], dtype=np.int64)[flows.pid.codes]
    tids = np.array([tid[v] for v in flows.tid.values], dtype=np.int64)[flows.tid.codes]
    known = (pids < len(trace.pid.values)) & (tids < len(trace.tid.values))
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


def _link_gpu(trace: Trace, gpu, launch, start, thread, base: int, parent: np.ndarray):
    """Parent every GPU event in ``gpu`` to its launch among ``launch`` (see the module
    docs); return the mask of linked events, and the number of GPU events whose key
    launches of several processes share, and of those left unlinked."""
    process, n_proc = trace.pid.codes, max(len(trace.pid.values), 1)
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
    n = len(parent)
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
    timed = ~(np.isnan(trace.ts) | np.isnan(trace.dur))
    ts, dur = np.where(timed, trace.ts, 0.0), np.where(timed, trace.dur, 0.0)
    if not (np.isfinite(ts).all() and np.isfinite(dur).all() and (dur >= 0).all()):
        raise MPGuideError(f"{trace.source or 'trace'}: an event has a non-finite or negative time")
    absolute = _absolute_ns(ts)
    base = int(absolute[timed].min()) if timed.any() else 0
    start = absolute - base
    end = start + np.rint(dur * 1000.0).astype(np.int64)
    no_time = int((included & ~timed).sum())
    included &= timed
    thread = trace.pid.codes * len(trace.tid.values) + trace.tid.codes
    parent = np.full(n, -1, dtype=np.int64)
    linked, shared, ambiguous = _link_gpu(
        trace,
        np.flatnonzero(included & is_gpu),
        np.flatnonzero(included & runtime),
        start,
        thread,
        base,
        parent,
    )

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
        ambiguous_gpu=ambiguous,
        unlinked_gpu=int((is_gpu & included & ~linked).sum()),
        no_time=no_time,
        replaced=trace.replaced,
        left_out=int(n - included.sum()) - no_time,
    )
    return Tree(trace, included, parent, depth, order, anomalies, is_gpu)


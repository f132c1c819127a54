"""Read chrome traces exported by ``torch.profiler``.

:func:`load` reads a ``.json`` or ``.json.gz`` trace a few megabytes at a time with a typed
decoder into one array per field (:class:`Trace`); each event's ``args`` stay undecoded
bytes until a node's fields are asked for, and ``args_of`` keeps only those a tool reads. A
large plain ``.json`` is cut at an event boundary near its middle and the two parts are read
at once, here and in a worker process. When a part does not decode piece by piece (an event
boundary was found inside an event's ``args``), the file is decoded in one piece: the same
trace, with the memory of the whole document. Bytes that are not UTF-8 are replaced by
U+FFFD and counted. :meth:`Trace.tree` nests the events into call trees
(:mod:`mpguide.calltree`).
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, is_not
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np

from mpguide import MPGuideError, calltree, error_line
from mpguide.columns import Coded, codes, matching, merged


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


_DECODER = msgspec.json.Decoder(_File | list[Event])
FLOW = "ac2g"
PARALLEL_BYTES = 64 << 20
"""Plain traces at least this large are decoded in two processes."""


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
    linked = calltree.GPU_CATEGORIES | calltree.RUNTIME_CATEGORIES
    return matching(name, args_of) | matching(cat, linked.__contains__)


def _flows(events: list[Event], flowing: np.ndarray) -> Flows:
    """The ``ac2g`` flow starts and ends among ``events``, of those ``flowing`` marks (flow
    phases in the flow category), with an ``id`` and a finite time."""
    maybe = list(compress(events, flowing.tolist()))
    n = len(maybe)
    ts = np.fromiter(map(attrgetter("ts"), maybe), float, n)
    has_id = np.fromiter(map(is_not, map(attrgetter("id"), maybe), repeat(None)), bool, n)
    events = list(compress(maybe, (has_id & np.isfinite(ts)).tolist()))
    n = len(events)
    return Flows(
        np.fromiter(map("s".__eq__, map(attrgetter("ph"), events)), bool, n),
        *(Coded(*codes(map(attrgetter(f), events), n)) for f in ("id", "pid", "tid")),
        np.fromiter(map(attrgetter("ts"), events), float, n),
    )


_KINDS = attrgetter("ph", "name", "cat", "pid", "tid")


def _columns(events: list[Event], source: str, replaced: int = 0, args_of=None) -> Trace:
    """The complete events as columns, the flow events apart, the others counted by phase;
    ``args`` only of the events :func:`_keeps_args` says.

    Phase, name, category, process and thread are coded in one pass over the events, as
    their distinct combinations; each field's codes follow from those by array indexing."""
    kind, kinds = codes(map(_KINDS, events), len(events))
    ph, name, cat, pid, tid = map(list, zip(*kinds, strict=True)) if kinds else ([], [], [], [], [])
    phase, phases = codes(ph, len(ph))
    of_complete = np.array([p == "X" for p in ph], dtype=bool)
    is_complete = of_complete[kind]
    counts = np.bincount(phase[kind[~is_complete]], minlength=len(phases)).tolist()
    other = {p: c for p, c in zip(phases, counts, strict=True) if c}
    flowing = [p in ("s", "f") and c == FLOW for p, c in zip(ph, cat, strict=True)]
    flows = _flows(events, np.array(flowing, dtype=bool)[kind])
    if not is_complete.all():
        events, kind = list(compress(events, is_complete.tolist())), kind[is_complete]
    n = len(events)
    on_complete = np.flatnonzero(of_complete).tolist()
    coded = []
    for values in (name, cat, pid, tid):
        code = np.zeros(len(kinds), dtype=np.int64)
        code[on_complete], distinct = codes(map(values.__getitem__, on_complete), len(on_complete))
        coded.append(Coded(code[kind], distinct))
    ts, dur = (np.fromiter(map(attrgetter(f), events), float, n) for f in ("ts", "dur"))
    kept = None if args_of is None else _keeps_args(coded[0], coded[1], args_of)
    raws = list(map(attrgetter("args"), events if kept is None else compress(events, kept)))
    lengths = np.zeros(n, dtype=np.int64)
    lengths[slice(None) if kept is None else kept] = np.fromiter(
        map(len, raws), np.int64, len(raws)
    )
    args = Args((b"".join(raws),), np.zeros(1, np.int64), np.cumsum(lengths), kept)
    return Trace(*coded, ts, dur, args, other, flows, source, replaced)


def _joined(parts: list[Trace], source: str) -> Trace:
    """One trace of the events of ``parts``, in order."""
    base = np.cumsum([0, *(sum(map(len, p.args.blobs)) for p in parts)])[:-1].tolist()
    kept = [p.args.kept for p in parts]
    return Trace(
        *(merged([getattr(p, f) for p in parts]) for f in ("name", "cat", "pid", "tid")),
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
            *(merged([getattr(p.flows, f) for p in parts]) for f in ("key", "pid", "tid")),
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

    def tree(self, *, python: bool = False, annotations: bool = True) -> calltree.Tree:
        """The call trees of this trace; see :func:`mpguide.calltree.build`."""
        return calltree.build(self, python=python, annotations=annotations)

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

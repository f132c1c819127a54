"""Read chrome traces exported by ``torch.profiler``.

:func:`load` reads a ``.json`` or ``.json.gz`` trace, or a stream, a few megabytes at a time
with a typed decoder into one array per field (:class:`Trace`); each event's ``args`` stay
undecoded bytes until a node's fields are asked for, and ``args_of`` keeps only those a tool
reads. A large plain ``.json`` is cut at an event boundary near its middle and the two parts
are read at once, here and in a worker process (:mod:`mpguide.traces.halves`). Every byte is
read once, and memory stays bounded on any input: a document is refused when it does not start
with ``{`` or ``[``, when it is larger than a cap (:data:`MAX_BYTES` by default, decompressed),
when no event boundary comes in a few pieces, or when it nests deeper than the decoder goes; a
boundary found inside an event's ``args`` is passed over. Bytes that are not UTF-8 are replaced
by U+FFFD and counted. :meth:`Trace.tree` nests the events into call trees
(:mod:`mpguide.traces.calltree`).
"""

from __future__ import annotations

import codecs
import functools
import gc
import gzip
import io
import math
import os
import pickle
import re
import stat
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, is_not
from pathlib import Path
from typing import BinaryIO

import msgspec
import numpy as np

from mpguide import MPGuideError
from mpguide.traces import calltree, halves
from mpguide.traces.columns import CODE, Args, Coded, Flows, codes, matching, merged
from mpguide.traces.memory import (
    BYTES_PER_EVENT,
    available_memory,
    check_memory,
    count_events,
    estimated_memory,
    size_text,
)

__all__ = ["BYTES_PER_EVENT", "count_events", "estimated_memory", "size_text"]  # re-exported


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
_NO_ARGS = _DECODER.decode(b'[{"ph":"X"}]')[0].args
"""The ``args`` an event without them decodes to: one object that all of them share."""
FLOW = "ac2g"
PARALLEL_BYTES = 64 << 20
"""Plain traces at least this large are decoded in two processes."""
Source = str | os.PathLike | BinaryIO


def _keeps_args(name: Coded, cat: Coded, args_of: Callable[[str], bool]) -> np.ndarray:
    """Mask of the events whose name ``args_of`` accepts, and of launches and GPU events."""
    linked = calltree.GPU_CATEGORIES | calltree.RUNTIME_CATEGORIES
    return matching(name, args_of) | matching(cat, linked.__contains__)


def _flows(events: list[Event], flowing: np.ndarray) -> Flows:
    """The ``ac2g`` flow starts and ends among ``events``, of those ``flowing`` marks (flow
    phases in the flow category), with an ``id`` and a time that nests
    (:data:`mpguide.traces.calltree.MAX_US`)."""
    maybe = list(map(events.__getitem__, np.flatnonzero(flowing).tolist()))
    n = len(maybe)
    ts = np.fromiter(map(attrgetter("ts"), maybe), float, n)
    has_id = np.fromiter(map(is_not, map(attrgetter("id"), maybe), repeat(None)), bool, n)
    events = list(compress(maybe, (has_id & (np.abs(ts) <= calltree.MAX_US)).tolist()))
    n = len(events)
    return Flows(
        np.fromiter(map("s".__eq__, map(attrgetter("ph"), events)), bool, n),
        *(Coded(*codes(map(attrgetter(f), events), n)) for f in ("id", "pid", "tid")),
        np.fromiter(map(attrgetter("ts"), events), float, n),
    )


_KINDS = attrgetter("ph", "name", "cat", "pid", "tid")


def _taken(complete: np.ndarray | None, kept: np.ndarray | None) -> list[bool] | None:
    """Mask over all events of the complete ones (None: all are) whose ``args`` are kept
    (None: all), as a list (``itertools.compress`` reads a list far faster than an array);
    None when it takes every event."""
    if kept is None:
        return None if complete is None else complete.tolist()
    if complete is None:
        return kept.tolist()
    whole = np.zeros(len(complete), dtype=bool)
    whole[complete] = kept
    return whole.tolist()


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
    # The other phases are few: the complete events are picked out of columns made over all
    # of them, not copied into a list of their own.
    complete = None if is_complete.all() else is_complete
    kind = kind if complete is None else kind[complete]
    n = len(kind)
    on_complete = np.flatnonzero(of_complete).tolist()
    coded = []
    for values in (name, cat, pid, tid):
        code = np.zeros(len(kinds), dtype=CODE)
        code[on_complete], distinct = codes(map(values.__getitem__, on_complete), len(on_complete))
        coded.append(Coded(code[kind], distinct))
    del kind
    ts, dur = (np.fromiter(map(attrgetter(f), events), float, len(events)) for f in ("ts", "dur"))
    if complete is not None:
        ts, dur = ts[complete], dur[complete]
    kept = None if args_of is None else _keeps_args(coded[0], coded[1], args_of)
    taken = _taken(complete, kept)
    raws = list(map(attrgetter("args"), events if taken is None else compress(events, taken)))
    del events
    lengths = np.fromiter(map(len, raws), np.int64, len(raws))
    has = lengths != len(_NO_ARGS)  # of the args as short as "{}", those an event had are kept
    stored = np.arange(n) if kept is None else np.flatnonzero(kept)
    if not has.all():
        short = compress(raws, (~has).tolist())
        has[~has] = np.fromiter(map(is_not, short, repeat(_NO_ARGS)), bool, len(has) - has.sum())
        if not has.all():
            raws, stored, lengths = list(compress(raws, has.tolist())), stored[has], lengths[has]
    ends = np.cumsum(lengths)
    dense = len(stored) == n
    args = Args((b"".join(raws),), np.zeros(1, np.int64), ends, kept, None if dense else stored)
    return Trace(*coded, ts, dur, args, other, flows, source, replaced)


def _joined(parts: list[Trace], source: str) -> Trace:
    """One trace of the events of ``parts``, in order; ``parts`` is emptied as its columns
    are joined, so that memory holds each column once and one column's copy."""
    sizes = [len(p) for p in parts]
    firsts = np.cumsum([0, *sizes])[:-1].tolist()
    base = np.cumsum([0, *(sum(map(len, p.args.blobs)) for p in parts)])[:-1].tolist()
    args = [p.args for p in parts]
    other = dict(sum((Counter(p.other) for p in parts), Counter()))
    flows = Flows(
        np.concatenate([p.flows.start for p in parts]),
        *(merged([getattr(p.flows, f) for p in parts]) for f in ("key", "pid", "tid")),
        np.concatenate([p.flows.ts for p in parts]),
    )
    replaced = sum(p.replaced for p in parts)
    columns = {
        f: [getattr(p, f) for p in parts] for f in ("name", "cat", "pid", "tid", "ts", "dur")
    }
    parts.clear()
    joined = {f: merged(columns.pop(f)) for f in ("name", "cat", "pid", "tid")}
    for f in ("ts", "dur"):
        joined[f] = np.concatenate(columns[f])
        del columns[f]
    dense = all(a.stored is None for a in args)
    stored = None
    if not dense:
        stored = np.concatenate(
            [
                (np.arange(size) if a.stored is None else a.stored) + first
                for a, size, first in zip(args, sizes, firsts, strict=True)
            ]
        )
    kept = None if args[0].kept is None else np.concatenate([a.kept for a in args])
    joined_args = Args(
        sum((a.blobs for a in args), ()),
        np.concatenate([a.offsets + b for a, b in zip(args, base, strict=True)]),
        np.concatenate([a.ends + b for a, b in zip(args, base, strict=True)]),
        kept,
        stored,
    )
    return Trace(
        **joined, args=joined_args, other=other, flows=flows, source=source, replaced=replaced
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
        """The call trees of this trace; see :func:`mpguide.traces.calltree.build`."""
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


MAX_BYTES = 2 << 30
"""The default cap on a trace's size, decompressed: :func:`load` refuses a larger one."""
_WHITESPACE = re.compile(rb"[ \t\r\n]*")
_UTF8_BOM = b"\xef\xbb\xbf"


def _too_large(where: str, max_bytes: int, size: int | None = None) -> MPGuideError:
    cap = size_text(max_bytes)
    if size is not None and size_text(size) == cap:  # rounding hides the difference
        what, cap = f"{size:,} bytes, more than", f"{max_bytes:,} bytes"
    else:
        what = "more than" if size is None else f"{size_text(size)}, more than"
    return MPGuideError(
        f"{where}: {what} {cap}{' decompressed' if size is None else ''}, the "
        "cap on a trace's size; raise it with --max-bytes (max_bytes= in Python)"
    )


@contextmanager
def _read_errors(where: str) -> Iterator[None]:
    """An error reading ``where`` (an I/O error, a device that refuses reads) as one line
    naming it."""
    try:
        yield
    except MPGuideError:
        raise
    except OSError as err:
        raise MPGuideError(f"{where}: cannot read it ({err.strerror or err})") from None


def _file_size(path: Path) -> int:
    """The size of the regular file ``path``, or MPGuideError saying why it cannot be read."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise MPGuideError(f"{path}: no such file") from None
    except OSError as err:
        raise MPGuideError(f"{path}: cannot read it ({err.strerror or err})") from None
    if stat.S_ISDIR(st.st_mode):
        raise MPGuideError(f"{path}: is a directory, not a trace file")
    if not stat.S_ISREG(st.st_mode):
        raise MPGuideError(f"{path}: not a regular file")
    return st.st_size


@contextmanager
def _opened(source: Source) -> Iterator[BinaryIO]:
    """``source`` open for reading, with ``peek``: a path is opened (and closed after), a
    stream is read as it is."""
    if not isinstance(source, (str, os.PathLike)):
        yield source if hasattr(source, "peek") else io.BufferedReader(source)
        return
    try:
        f = open(source, "rb")  # noqa: SIM115 -- closed below
    except OSError as err:
        raise MPGuideError(f"{source}: cannot read it ({err.strerror or err})") from None
    with f, _read_errors(str(source)):
        yield f


def _name(source: Source) -> str:
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    name = getattr(source, "name", None)
    return name if isinstance(name, str) else "<stream>"


def _is_gzip(f: BinaryIO) -> bool:
    return f.peek(2)[:2] == b"\x1f\x8b"


@contextmanager
def _gzip_errors(where: str) -> Iterator[None]:
    try:
        yield
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise MPGuideError(f"{where}: broken gzip file ({err})") from None


@contextmanager
def _filler(
    source: Source, start: int = 0, stop: int | None = None, max_bytes: int | None = None
) -> Iterator[Callable]:
    """A function filling a buffer with the next bytes of ``source`` (decompressed when it is
    gzip), from byte ``start`` to byte ``stop`` of a plain file; it returns how many, and
    raises MPGuideError once more than ``max_bytes`` were read."""
    where = _name(source)
    with _opened(source) as f:
        if _is_gzip(f):
            z = gzip.GzipFile(fileobj=f, mode="rb")

            def read(view: memoryview) -> int:
                with _gzip_errors(where):
                    return z.readinto(view)
        else:
            if start:
                f.seek(start)
            read = f.readinto
        total = 0

        @_read_errors(where)
        def fill(view: memoryview) -> int:
            nonlocal total
            if stop is not None:
                view = view[: stop - start - total]
            got = read(view)
            total += got
            if max_bytes is not None and total > max_bytes:
                raise _too_large(where, max_bytes)
            return got

        fill.share = _share(f) if stop is None else lambda: None
        fill.read, fill.cap = (lambda: total), max_bytes
        yield fill


def _share(f: BinaryIO) -> Callable[[], float | None]:
    """A function saying how much of the regular file ``f`` was read (compressed, for a
    gzip file), or None where that is not known (a pipe)."""
    try:
        st = os.fstat(f.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return lambda: None
    if not (stat.S_ISREG(st.st_mode) and st.st_size):
        return lambda: None

    def share() -> float | None:
        try:
            return f.tell() / st.st_size
        except (OSError, ValueError):
            return None

    return share


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


_AT_BYTE = re.compile(r"\(byte (\d+)\)")
_AT_EVENT = re.compile(r"(\$(?:\.traceEvents)?\[)(\d+)\]")
_DECODE_ERRORS = (msgspec.DecodeError, RecursionError)


def _message(where: str, err: Exception, events_before: int = 0, base: int = 0) -> str:
    """One line for a document that did not decode, naming its event or byte as counted in
    the whole document: the piece that failed came after ``events_before`` events, and its
    byte 0 is byte ``base`` of the document."""
    if isinstance(err, RecursionError):
        return f"{where}: not valid JSON: nested too deeply to decode"
    text = str(err)
    if isinstance(err, msgspec.ValidationError):
        text = _AT_EVENT.sub(lambda m: f"{m[1]}{int(m[2]) + events_before}]", text, count=1)
        return f"{where}: not a chrome trace ({text})"
    text = _AT_BYTE.sub(lambda m: f"(byte {int(m[1]) + base})", text, count=1)
    return f"{where}: not valid JSON ({text})"


class _Undecodable(MPGuideError):
    """A document that does not decode; ``cause`` is msgspec's error or the RecursionError."""

    def __init__(self, where: str, cause: Exception):
        super().__init__(_message(where, cause))
        self.cause = cause


def _decode(data: bytes | bytearray | memoryview, where: str) -> tuple[list[Event], int]:
    """The events of a chrome-trace document, and how many invalid UTF-8 sequences were
    replaced by U+FFFD to decode it."""
    replaced = _invalid_utf8(data)
    try:
        doc = _DECODER.decode(bytes(data).decode("utf-8", "replace") if replaced else data)
    except _DECODE_ERRORS as err:
        raise _Undecodable(where, err) from None
    return (doc if isinstance(doc, list) else doc.traceEvents), replaced


@paused_gc()
def parse(data: bytes, source: str = "", args_of: Callable[[str], bool] | None = None) -> Trace:
    """A trace from the bytes of a chrome-trace JSON document; bytes that are not UTF-8 are
    replaced by U+FFFD and counted (:attr:`Trace.replaced`). ``args_of``: see :func:`load`."""
    events, replaced = _decode(data, source or "trace")
    return _events_in(_columns(events, source, replaced, args_of))


@paused_gc()
def load(
    source: str | Path | BinaryIO,
    *,
    args_of: Callable[[str], bool] | None = None,
    max_bytes: int | None = MAX_BYTES,
) -> Trace:
    """Read a chrome trace from a ``.json`` or ``.json.gz`` file or a binary stream (gzip is
    detected from the bytes), a few megabytes at a time (see :func:`_streamed`), each byte
    read once.

    ``args_of`` keeps the ``args`` only of the events whose name it accepts, and of the
    launches and GPU events, which linking needs: the others' ``args`` are most of a trace's
    bytes. Asking for a dropped event's ``args`` is an error. It must be a module-level
    function: a large file's second half is decoded in a worker process.

    A document larger than ``max_bytes`` (decompressed; None: no cap) is refused: a plain
    file at once, a gzip or a stream as soon as reading passes the cap.
    """
    _pickled(args_of)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        size = _file_size(path)
        with _opened(path) as f:
            plain = not _is_gzip(f)
        if plain and max_bytes is not None and size > max_bytes:
            raise _too_large(str(path), max_bytes, size)
        if plain:
            check_memory(str(path), count_events(path))
        if plain and size >= PARALLEL_BYTES:
            parts = _in_halves(path, args_of)
            if parts is not None:
                return _events_in(_joined(parts, str(path)))
    with _filler(source, max_bytes=max_bytes) as fill:
        return _events_in(_streamed(fill, b"", b"", _name(source), args_of))


def _events_in(trace: Trace) -> Trace:
    """``trace``, unless none of its objects is a trace event: a JSON array of other records
    (no ``ph``) is not an empty trace but no trace at all."""
    if not len(trace) and set(trace.other) == {""}:
        raise MPGuideError(
            f"{trace.source or 'trace'}: not a chrome trace: its {trace.other['']:,} objects "
            "have no phase (ph), so none is a trace event"
        )
    return trace


_WORKER = "import sys; from mpguide.traces.trace import _worker; _worker(sys.argv[1:])"
"""The code of the worker process of a two-part read."""


def _in_halves(path: Path, args_of) -> list[Trace] | None:
    """``path`` read in two parts at once (:func:`mpguide.traces.halves.read`), cut at an
    event boundary; None where it is read in one piece."""
    part = functools.partial(_part, args_of=args_of)
    return halves.read(path, _cut, part, [_WORKER, _pickled(args_of).hex()])


def _worker(argv: list[str]) -> None:
    """The worker process of :func:`_in_halves`: ``argv`` is the pickled ``args_of``, then
    what :func:`mpguide.traces.halves.work` reads."""
    keep, *rest = argv
    with paused_gc():
        halves.work(rest, functools.partial(_part, args_of=pickle.loads(bytes.fromhex(keep))))


def _cut(f: BinaryIO, middle: int) -> tuple[int, int, bytes, bytes] | None:
    """The first event boundary after byte ``middle`` of the open trace ``f`` (within
    :data:`_WINDOW`): where the first part ends and the second starts, and the bytes that
    close the first and open the second as documents of their own; None where there is none."""
    f.seek(0)
    bracketed = f.read(_WINDOW).lstrip(b" \t\r\n" + _UTF8_BOM)[:1] == b"["
    f.seek(middle)
    found = _BOUNDARY.search(f.read(_WINDOW))
    if found is None:
        return None
    head, tail = (b"]", b"[") if bracketed else (b"]}", b'{"traceEvents":[')
    return middle + found.start() + 1, middle + found.start(1), head, tail


def _part(f: BinaryIO, start: int, stop: int | None, before: bytes, after: bytes, args_of):
    """Columns of the events in bytes ``start:stop`` of the open trace ``f``, framed by
    ``before`` and ``after`` into a document of their own; None if that is not a trace."""
    try:
        with _filler(f, start, stop) as fill:
            return _streamed(fill, before, after, _name(f), args_of)
    except MPGuideError:
        return None


def _pickled(args_of: Callable[[str], bool] | None) -> bytes:
    try:
        return pickle.dumps(args_of)
    except (pickle.PicklingError, AttributeError, TypeError):
        raise MPGuideError(f"args_of must be a module-level function, got {args_of!r}") from None


# A boundary between two events: "}," and then an object whose first key is a plain word
# ("ph" in torch's exports). A cut there is used only if the part before it decodes alone:
# one inside an event's args leaves that part unclosed.
_BOUNDARY = re.compile(rb'\}\s*,\s*(\{)\s*"\w+"\s*:')
_PIECE = 16 << 20
_WINDOW = 1 << 20
"""Bytes searched for an event boundary near a cut."""
_HELD = 4
"""The most bytes held while no event boundary comes, in pieces."""
_TRIES = 3
"""Boundaries tried per buffer, last first, before it grows: one inside an event's args
leaves the part before it unclosed."""


def _last_boundary(data: bytearray, size: int, since: int = 0) -> tuple[int, int] | None:
    """Where the last event of ``data[since:size]`` before its last boundary ends, and where
    the next begins; the boundary is looked for near ``size`` first."""
    for start in (max(size - _WINDOW, since), since):
        found = list(_BOUNDARY.finditer(data, start, size))
        if found:
            return found[-1].start() + 1, found[-1].start(1)
    return None


def _not_a_document(where: str, head: bytes) -> MPGuideError:
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return MPGuideError(
            f"{where}: UTF-16 text (it starts with a UTF-16 byte order mark); a chrome trace "
            "is JSON in UTF-8"
        )
    if head.startswith(b"\x1f\x8b"):
        return MPGuideError(f"{where}: compressed twice (a gzip file inside a gzip file)")
    return MPGuideError(
        f"{where}: not valid JSON (a trace starts with {{ or [; this starts with {head!r})"
    )


def _false_cut(err: _Undecodable, cut: int) -> bool:
    """Whether a part cut at byte ``cut`` failed for the cut alone: it ends unclosed, or
    its first fault is the cut (a cut inside an event's ``args``), or it is the part of an
    object before ``traceEvents`` (a cut in another list of objects)."""
    cause = err.cause
    if isinstance(cause, msgspec.ValidationError):
        return "missing required field `traceEvents`" in str(cause)
    if isinstance(cause, msgspec.DecodeError):
        at = _AT_BYTE.search(str(cause))
        return at is None or int(at[1]) >= cut
    return False


def _count(part: Trace) -> int:
    """How many events of any phase ``part`` was read from."""
    return len(part) + sum(part.other.values())


def _start(fill: Callable, buf: bytearray, where: str) -> tuple[int, int]:
    """Fill ``buf`` from the document's first byte, past a UTF-8 byte order mark and
    whitespace: how many bytes it holds, and how many were passed. MPGuideError when no
    document starts (only whitespace, or a first byte other than ``{`` or ``[``)."""
    passed = 0
    with memoryview(buf) as view:
        while True:
            got = fill(view)
            skip = 3 if passed == 0 and buf.startswith(_UTF8_BOM) else 0
            skip = _WHITESPACE.match(buf, skip, got).end()
            passed += skip
            if skip < got:
                break
            if not got:
                raise MPGuideError(f"{where}: empty, no JSON document in it")
            if passed > _PIECE:
                raise MPGuideError(
                    f"{where}: more than {size_text(_PIECE)} of whitespace and no JSON document"
                )
    buf[: got - skip] = buf[skip:got]
    if buf[:1] not in (b"{", b"["):
        raise _not_a_document(where, bytes(buf[: min(got - skip, 16)]))
    return got - skip, passed


def _streamed(fill: Callable, first: bytes, last: bytes, where: str, args_of=None) -> Trace:
    """The events of the document that ``fill`` gives, opened by ``first`` and closed by
    ``last``, decoded ``_PIECE`` bytes at a time in one buffer, so that memory holds the
    columns and one piece: each piece ends at an event boundary and is closed (``]``) and
    the rest reopened (``[``) into documents of their own. A boundary inside an event is
    passed over; with no boundary in ``_HELD`` pieces, or when a piece does not decode,
    MPGuideError naming the event or byte of the whole document."""
    buf = bytearray(max(_PIECE, 2 * len(first)))
    if first:
        buf[: len(first)] = first
        size, base = len(first), 0
    else:
        size, base = _start(fill, buf, where)
    # The document's byte base + k is byte k of buf, after the first piece's opening.
    base -= len(first)
    close, reopen = (b"]", b"[") if buf[:1] == b"[" else (b"]}", b'{"traceEvents":[')
    parts: list[Trace] = []
    events_before, since, until, tries = 0, 0, None, 0
    may = available_memory()  # checked as events come: a stream is not counted before
    while True:
        if size < len(buf):
            with memoryview(buf) as view:
                got = fill(view[size:])
            if not got:
                break
            size += got
            continue
        found = _last_boundary(buf, until or size, since) if tries < _TRIES else None
        if found is None:  # no boundary in a whole buffer that cuts: a larger one, up to a bound
            if len(buf) >= _HELD * _PIECE:
                raise MPGuideError(
                    f"{where}: no event boundary in {size_text(len(buf))} from byte "
                    f"{base + len(reopen) if parts else base + len(first)}: an event that "
                    "large, or a document that is not a list of events, is not read"
                )
            buf.extend(bytes(len(buf)))
            since = max(since, size - 1024)  # not searched again (a cut is only a saving)
            until, tries = None, 0
            continue
        cut, start = found
        rest = reopen + buf[start:size]
        kept = bytes(buf[cut : cut + len(close)])
        buf[cut : cut + len(close)] = close  # over the "," after the event, or the "{"
        try:
            with memoryview(buf) as view:
                part = parse(view[: cut + len(close)], where, args_of)
        except _Undecodable as err:
            if not _false_cut(err, cut):
                raise MPGuideError(_message(where, err.cause, events_before, base)) from None
            buf[cut : cut + len(close)] = kept
            until, tries = cut, tries + 1  # the boundary before it, next
            continue
        parts.append(part)
        events_before += _count(part)
        check_memory(where, events_before, may)
        share = fill.share()
        if share and (
            fill.cap is None or fill.read() / share <= fill.cap
        ):  # the events to come, as many as in what was read: refused early past 2x
            # (a document the size cap refuses is left to it, which says how to raise it)
            how = f" (projected from the first {share:.1%} of the file)"
            check_memory(where, int(events_before / share), may, how, margin=2.0)
        base += start - len(reopen)
        buf[: len(rest)] = rest
        size, since, until, tries = len(rest), 0, None, 0
    buf[size : size + len(last)] = last
    try:
        with memoryview(buf) as view:
            parts.append(parse(view[: size + len(last)], where, args_of))
    except _Undecodable as err:
        raise MPGuideError(_message(where, err.cause, events_before, base)) from None
    check_memory(where, events_before + _count(parts[-1]), may)  # the tree is still to build
    return parts[0] if len(parts) == 1 else _joined(parts, where)

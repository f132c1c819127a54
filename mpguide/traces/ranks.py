"""Read a directory of traces, one per rank, and compare the ranks.

:func:`files` finds a directory's traces (``*.json``, ``*.json.gz``); each trace's rank is its
``distributedInfo.rank`` where it has one, else ``rank`` and a number in its file name, else
unknown. :func:`casts_of_ranks` and :func:`trees_of_ranks` run the per-file report on every
trace (:func:`mpguide.traces.trace.load`, :meth:`~mpguide.traces.trace.Trace.tree`,
:func:`mpguide.traces.casts.report`): in a pool of processes on this machine's cores, or on a Dask
cluster (``scheduler``), whose workers read the files themselves, at the same path, and send
back a few figures per rank, never the events. A :class:`Ranks` holds one row per trace and
compares the ranks: which one has the most of each figure, the median and the spread.

A pool's processes are started afresh (``spawn``): a script that calls these with several
jobs must guard its top-level code with ``if __name__ == "__main__":``. No process of the
pool outlives the call, whether it ends, fails or is interrupted.
"""

from __future__ import annotations

import asyncio
import errno
import fnmatch
import gzip
import json
import multiprocessing
import os
import re
import signal
import socket
import stat
import statistics
import sys
import threading
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from functools import partial
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

from mpguide import MPGuideError, error_line
from mpguide.core.table import Table
from mpguide.traces import casts as cast_report
from mpguide.traces import halves
from mpguide.traces import trace as trace_file

PATTERNS = ("*.json", "*.json.gz")
FROM_TRACE, FROM_NAME, UNKNOWN = "distributedInfo", "file name", "unknown"
CLUSTER_EXTRA = "pip install mpguide[cluster]"
_HEAD = 1 << 20
_INFO = re.compile(rb'"distributedInfo"\s*:\s*')
_NAME_RANK = re.compile(r"rank[-_.]?(\d+)", re.IGNORECASE)
_CONNECT_S = 10
_MISSING = object()


def files(folder: str | Path) -> list[Path]:
    """The traces (``*.json``, ``*.json.gz``) directly in ``folder``, by name."""
    return _scan(folder)[0]


def _not_a_file(path: Path) -> str | None:
    """Why ``path`` is not a trace file to read (None when it is a regular file)."""
    try:
        mode = path.stat().st_mode
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "a symbolic link loop"
        if path.is_symlink():
            return "a symbolic link to nothing"
        return f"cannot be read ({err.strerror or err})"
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO (named pipe)",
             stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a device", stat.S_ISBLK: "a device"}  # fmt: skip
    return next((kind for test, kind in kinds.items() if test(mode)), "not a regular file")


def _scan(folder: str | Path) -> tuple[list[Path], list[str]]:
    """The traces directly in ``folder``, by name, and a sentence for each entry named like
    a trace that is not a regular file (skipped)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MPGuideError(f"{folder}: not a directory")
    try:
        names = os.listdir(folder)
    except OSError as err:
        raise MPGuideError(f"{folder}: cannot list it ({err.strerror or err})") from None
    named = sorted(
        folder / n
        for n in names
        if not n.startswith(".") and any(fnmatch.fnmatchcase(n, p) for p in PATTERNS)
    )
    why = [(p, _not_a_file(p)) for p in named]
    found = [p for p, reason in why if reason is None]
    skipped = [f"{p.name}: skipped, {reason}" for p, reason in why if reason is not None]
    if not found:
        also = f"; {'; '.join(skipped)}" if skipped else ""
        raise MPGuideError(f"{folder}: no traces in it ({', '.join(PATTERNS)}){also}")
    return found, skipped


def _head(path: Path) -> bytes:
    """The first bytes of the trace's JSON (decompressed when it is gzip); none when they
    cannot be read, which the load then says."""
    try:
        with path.open("rb") as f:
            first = f.read(_HEAD)
            if first[:2] != b"\x1f\x8b":
                return first
            f.seek(0)
            with gzip.open(f) as z:
                return z.read(_HEAD)
    except (OSError, EOFError, zlib.error):
        return b""


def rank_of(path: str | Path) -> tuple[int | None, str]:
    """The rank of a trace and where it was found: the ``distributedInfo`` the profiler
    writes before the events, else ``rank`` and a number in the file name (``rank-3``,
    ``rank_3``, ``rank3``; the last one), else None. A ``distributedInfo`` whose rank is not
    a whole number from 0 is named in the second (``unknown; ...``, ``file name; ...``)."""
    head = _head(Path(path))
    events = head.find(b'"traceEvents"')
    found = _INFO.search(head, 0, events if events >= 0 else len(head))
    bad = ""
    if found is not None:
        text = head[found.end() :].decode("utf-8", "replace")
        try:
            info = json.JSONDecoder().raw_decode(text)[0]
        except ValueError:
            info = None
        rank = info.get("rank", _MISSING) if isinstance(info, dict) else _MISSING
        if type(rank) is int and rank >= 0:
            return rank, FROM_TRACE
        shown = "missing" if rank is _MISSING else f"{json.dumps(rank)[:24]}, not a rank"
        bad = f"; {FROM_TRACE} rank {shown}"
    named = _NAME_RANK.findall(Path(path).name)
    return (int(named[-1]), FROM_NAME + bad) if named else (None, UNKNOWN + bad)


@dataclass(frozen=True)
class RankCasts:
    """The casts in one rank's trace: how many, their CPU time and GPU time (None when the
    trace has no GPU events), the time of its profiled steps (see
    :func:`mpguide.traces.casts.report`), and the largest group under ``by`` with its CPU time."""

    file: str
    rank: int | None
    origin: str
    events: int
    casts: int
    cpu_us: float
    gpu_us: float | None
    step_us: float | None
    by: str
    top: str | None
    top_cpu_us: float | None
    losses: tuple[str, ...] = ()

    FIGURES = ("casts", "cast cpu us", "cast gpu us", "share of step")
    HEADLINE = ("most time in casts", ("cast gpu us", "cast cpu us"))

    def cells(self) -> dict[str, Any]:
        """The figures by column name, as measured (None where unknown)."""
        return {
            "events": self.events,
            "casts": self.casts,
            "cast cpu us": self.cpu_us,
            "cast gpu us": self.gpu_us,
            "share of step": self.cpu_us / self.step_us if self.step_us else None,
            f"top {self.by}": self.top,
            f"top {self.by} cpu us": self.top_cpu_us,
        }


@dataclass(frozen=True)
class RankTree:
    """One rank's trace as a tree: its complete events, profiled steps (``ProfilerStep#N``)
    and their time, the time of its GPU events summed, the anomalies met while nesting,
    and how many nodes are named ``op`` and their time (when an op is asked for)."""

    file: str
    rank: int | None
    origin: str
    events: int
    steps: int
    step_us: float | None
    gpu_us: float | None
    anomalies: int
    op: str | None = None
    op_count: int | None = None
    op_us: float | None = None
    losses: tuple[str, ...] = ()

    FIGURES = ("step us", "gpu us", "op us", "events")
    HEADLINE = ("longest profiled steps", ("step us",))

    def cells(self) -> dict[str, Any]:
        """The figures by column name, as measured (None where unknown)."""
        out = {
            "events": self.events,
            "steps": self.steps,
            "step us": self.step_us,
            "gpu us": self.gpu_us,
            "anomalies": self.anomalies,
        }
        if self.op is not None:
            out |= {"op": self.op, "op count": self.op_count, "op us": self.op_us}
        return out


def _shown(name: str, value: Any) -> Any:
    """A figure as a table shows it: shares to 4 decimals, times to the nanosecond."""
    if not isinstance(value, float):
        return value
    return round(value, 4 if name.startswith("share") else 3)


def rank_casts(
    path: str | Path, by: str = "cause", max_bytes: int | None = trace_file.MAX_BYTES
) -> RankCasts:
    """The casts of one trace (the worker of :func:`casts_of_ranks`), their causes read
    from the Python stack where the trace has it."""
    rank, origin = rank_of(path)
    loaded = trace_file.load(path, args_of=cast_report.needs_args, max_bytes=max_bytes)
    tree = loaded.tree(python=True)
    report = cast_report.report(tree)
    summary = report.summary(by, scalars=False)  # 0-d casts folded, as for one file
    keys = cast_report.SUMMARY_KEYS[by]
    top, top_cpu = None, None
    first = [r for r in summary.records() if r[keys[0]] != cast_report.FOLDED][:1]
    if first:  # the largest group, not the 0-d casts' folded row (sorted with the others)
        top = " -> ".join(str(first[0][k]) for k in keys)
        top_cpu = float(first[0]["cpu us"])
    return RankCasts(
        file=str(path),
        rank=rank,
        origin=origin,
        events=len(loaded),
        casts=len(report),
        cpu_us=float(report.cpu_us.sum()),
        gpu_us=float(report.gpu_us.sum()) if report.gpu else None,
        step_us=None if report.step_us is None else float(report.step_us),
        by=by,
        top=top,
        top_cpu_us=top_cpu,
        losses=tuple(tree.anomalies.losses()),
    )


def rank_tree(
    path: str | Path,
    op: str | None = None,
    python: bool = False,
    max_bytes: int | None = trace_file.MAX_BYTES,
) -> RankTree:
    """One trace's tree in figures (the worker of :func:`trees_of_ranks`)."""
    rank, origin = rank_of(path)
    loaded = trace_file.load(path, max_bytes=max_bytes)
    tree = loaded.tree(python=python)
    steps = tree.step_mask()
    gpu = tree.gpu_work
    named = None if op is None else tree.named(op.__eq__) & tree.included
    return RankTree(
        file=str(path),
        rank=rank,
        origin=origin,
        events=len(loaded),
        steps=int(steps.sum()),
        step_us=float(tree.dur_us[steps].sum()) if steps.any() else None,
        gpu_us=float(tree.dur_us[gpu].sum()) if gpu.any() else None,
        anomalies=tree.anomalies.total(),
        op=op,
        op_count=None if named is None else int(named.sum()),
        op_us=None if named is None else float(tree.dur_us[named].sum()),
        losses=tuple(tree.anomalies.losses()),
    )


Row = RankCasts | RankTree


def _label(row: Row, rows: Sequence[Row]) -> str:
    """``rank 3``, with the file's name when the rank is unknown or has several files."""
    name = Path(row.file).name
    if row.rank is None:
        return name
    shared = sum(r.rank == row.rank for r in rows) > 1
    return f"rank {row.rank} ({name})" if shared else f"rank {row.rank}"


@dataclass(frozen=True)
class Ranks:
    """One row per trace of a directory (:class:`RankCasts` or :class:`RankTree`), in order
    of rank, traces of unknown rank last; ``how`` says where they were read."""

    folder: str
    rows: tuple[Row, ...]
    how: str
    skipped: tuple[str, ...] = ()
    """A sentence for each entry named like a trace that was not read."""

    @property
    def what(self) -> str:
        return "casts" if isinstance(self.rows[0], RankCasts) else "trees"

    def table(self) -> Table:
        """One row per trace: its rank, where the rank was found, its file and figures (a
        figure no trace has, such as GPU time on CPU traces, is left out)."""
        cells = [r.cells() for r in self.rows]
        known = [c for c in cells[0] if any(row[c] is not None for row in cells)]
        columns = ("rank", "rank from", "file", *known)
        rows = tuple(
            (r.rank, r.origin, Path(r.file).name, *(_shown(k, c[k]) for k in known))
            for r, c in zip(self.rows, cells, strict=True)
        )
        caption = f"{self.what} of {len(self.rows)} traces in {self.folder}, {self.how}"
        return Table(columns, rows, caption, self._notes())

    def _notes(self) -> tuple[str, ...]:
        counts = Counter(r.rank for r in self.rows if r.rank is not None)
        shared = sorted(rank for rank, n in counts.items() if n > 1)
        notes = []
        if shared:
            listed = ", ".join(map(str, shared))
            notes.append(f"ranks with several traces, one row each: {listed}")
        unknown = sum(r.origin == UNKNOWN for r in self.rows)
        if unknown:
            notes.append(
                f"{unknown} trace(s) of unknown rank: no distributedInfo, no rank in the name"
            )
        bad = [r for r in self.rows if r.origin.startswith((f"{UNKNOWN}; ", f"{FROM_NAME}; "))]
        if bad:
            named = ", ".join(f"{Path(r.file).name} ({r.origin})" for r in bad)
            notes.append(f"{len(bad)} trace(s) whose distributedInfo has no valid rank: {named}")
        return (*notes, *self.skipped)

    def summary(self) -> Table:
        """Across ranks, per figure: how many traces have it, the rank with the most, the
        largest, median and smallest value, and the largest over the median."""
        rows = []
        for figure in self.rows[0].FIGURES:
            values = [(r.cells().get(figure), r) for r in self.rows]
            values = [(v, r) for v, r in values if v is not None]
            if not values:
                continue
            numbers = [v for v, _ in values]
            top = max(numbers)
            tied = [r for v, r in values if v == top]
            most = _label(tied[0], self.rows) if len(tied) == 1 else f"{len(tied)} tied"
            median = statistics.median(numbers)
            over = round(top / median, 3) if median else None
            shown = (_shown(figure, v) for v in (top, median, min(numbers)))
            rows.append((figure, len(values), most, *shown, over))
        columns = ("figure", "traces", "most", "max", "median", "min", "max / median")
        return Table(columns, tuple(rows), f"{self.what} across ranks", self._headline(rows))

    def _headline(self, rows: list[tuple]) -> tuple[str, ...]:
        """The sentence on the first of the row type's headline figures the traces have."""
        said, figures = self.rows[0].HEADLINE
        found = {r[0]: r for r in rows}
        for figure in figures:
            if figure in found:
                _, _, most, top, median, _, over = found[figure]  # as shown
                than = "median" if over is None else f"{over:.2f}x the median of"
                return (f"{said}: {most} ({figure} {top:,.1f}, {than} {median:,.1f})",)
        return ()

    def render(self, fmt: str, width: int | None = None) -> str:
        """Both tables in ``fmt`` (one of :data:`mpguide.core.table.FORMATS`): JSON as one
        document with ``ranks`` and ``summary``; CSV the rows per trace alone; text fitting
        ``width`` where it can."""
        table, summary = self.table(), self.summary()
        if fmt == "json":
            doc = {"ranks": json.loads(table.to_json()), "summary": json.loads(summary.to_json())}
            return json.dumps(doc, indent=2)
        if fmt == "csv":
            return table.to_csv()
        return f"{table.render(fmt, width)}\n\n{summary.render(fmt, width)}"

    def __repr__(self) -> str:
        return self.render("text")

    def _repr_html_(self) -> str:
        return self.table().to_html() + self.summary().to_html()


Progress = Callable[[int, int, Row], None]


def casts_of_ranks(
    folder: str | Path,
    *,
    by: str = "cause",
    jobs: int | None = None,
    scheduler: str | None = None,
    progress: Progress | None = None,
    max_bytes: int | None = trace_file.MAX_BYTES,
) -> Ranks:
    """The casts of every trace in ``folder``, one :class:`RankCasts` each; ``by`` names
    the summary (:data:`mpguide.traces.casts.SUMMARY_KEYS`) whose largest group each row shows.
    See :func:`trees_of_ranks` for ``jobs``, ``scheduler``, ``progress`` and ``max_bytes``."""
    if by not in cast_report.SUMMARY_KEYS:
        keys = ", ".join(cast_report.SUMMARY_KEYS)
        raise MPGuideError(f"unknown summary {by!r}; choose one of {keys}")
    work = partial(rank_casts, by=by, max_bytes=max_bytes)
    return _read(folder, work, jobs, scheduler, progress)


def trees_of_ranks(
    folder: str | Path,
    *,
    op: str | None = None,
    python: bool = False,
    jobs: int | None = None,
    scheduler: str | None = None,
    progress: Progress | None = None,
    max_bytes: int | None = trace_file.MAX_BYTES,
) -> Ranks:
    """The tree of every trace in ``folder`` in figures, one :class:`RankTree` each, with
    the count and time of the nodes named ``op`` when given; a trace larger than
    ``max_bytes`` decompressed is refused (None: no cap).

    Read by ``jobs`` processes on this machine (default: one per core it may use, at most
    one per trace; each holds one trace in memory), or by the workers of the Dask scheduler
    at address ``scheduler``. ``progress(done, total, row)`` is called as each trace is done.
    """
    work = partial(rank_tree, op=op, python=python, max_bytes=max_bytes)
    return _read(folder, work, jobs, scheduler, progress)


def _read(folder, work: Callable[[str], Row], jobs, scheduler, progress) -> Ranks:
    if jobs is not None and jobs < 1:
        raise MPGuideError(f"jobs must be 1 or more, got {jobs}")
    if jobs is not None and scheduler is not None:
        raise MPGuideError("give jobs or a scheduler, not both: the cluster has its own workers")
    found, skipped = _scan(folder)
    paths = [str(p) for p in found]
    if scheduler is not None:  # the workers have their own working directory: absolute paths
        named = {os.path.abspath(p): p for p in paths}
        rows, how = _on_cluster(work, list(named), scheduler, progress)
        rows = [replace(r, file=named.get(r.file, r.file)) for r in rows]
    else:
        most, why = most_jobs(found)
        rows, how = _on_cores(work, paths, min(jobs or most, most), progress)
        if jobs is not None and jobs > most and len(paths) > most:
            how += f" (--jobs {jobs} capped at {why})"
    rows.sort(key=lambda r: (r.rank is None, r.rank or 0, r.file))
    return Ranks(str(folder), tuple(rows), how, tuple(skipped))


PER_PROCESS = 100 << 20
"""What a pool's process takes before it reads a trace: the interpreter, numpy, msgspec."""
GZIP_RATIO = 10
"""How many bytes a profiler's ``.json.gz`` holds per byte of file, about (for the memory
a process reading it will take, before it is read)."""


def most_jobs(paths: Sequence[Path]) -> tuple[int, str]:
    """How many of ``paths`` may be read at once, one process each, and why no more: one
    per core this process may use, and no more than the memory free holds when each holds
    the largest trace (:data:`mpguide.traces.trace.BYTES_PER_EVENT` an event; a
    gzip's events estimated from its size, :data:`GZIP_RATIO`)."""
    cores = _cores()
    free = trace_file.available_memory()
    if free is None or not paths:
        return cores, f"the {cores} cores"
    largest = 0
    for path in paths:
        with suppress(OSError):
            with path.open("rb") as f:
                gz = f.read(2) == b"\x1f\x8b"
            if gz:
                events = path.stat().st_size * GZIP_RATIO // 300
            else:
                events = trace_file.count_events(path)
            largest = max(largest, events)
    each = PER_PROCESS + trace_file.estimated_memory(largest)
    fit = max(free[0] // each, 1)
    if fit < cores:
        return int(fit), f"what {trace_file.size_text(free[0])} of memory holds"
    return cores, f"the {cores} cores"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _in_pool(parent: int) -> None:
    """In a pool's process: Ctrl-C is left to the parent, which ends the pool. The end
    (SIGTERM) kills the process at once, and so does its parent's death, however it dies
    (on Linux); the trace reader's own worker dies with it (:func:`mpguide.traces.trace.load`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    halves.die_with(parent)


def _pool(jobs: int):
    """A pool of ``jobs`` fresh processes, started ignoring Ctrl-C (from the main thread,
    where signals can be set), so that one still importing when it comes stays quiet."""
    _quiet_tracker()
    context = multiprocessing.get_context("spawn")
    start = partial(context.Pool, jobs, initializer=_in_pool, initargs=(os.getpid(),))
    if threading.current_thread() is not threading.main_thread():
        return start()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return start()
    finally:
        signal.signal(signal.SIGINT, previous)


def _quiet_tracker() -> None:
    """Start multiprocessing's resource tracker, if it is not running, with its stderr on
    the null device: when this process is killed (SIGKILL) the tracker frees the pool's
    semaphores and would warn of them on the terminal after the command has ended."""
    if os.name != "posix":
        return
    with suppress(OSError, ValueError):
        sys.stderr.flush()
        null, saved = os.open(os.devnull, os.O_WRONLY), os.dup(2)
        try:
            os.dup2(null, 2)
            resource_tracker.ensure_running()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(null)


def _on_cores(work, paths: list[str], jobs: int, progress) -> tuple[list[Row], str]:
    jobs = min(jobs, len(paths))
    rows: list[Row] = []
    if jobs == 1:
        for path in paths:
            rows.append(work(path))
            _tell(progress, rows, paths)
        return rows, "read by this process"
    pool = _pool(jobs)
    done = False
    try:
        for row in pool.imap_unordered(work, paths):
            rows.append(row)
            _tell(progress, rows, paths)
        pool.close()
        done = True
    finally:
        if not done:  # a trace failed, or Ctrl-C: the others are not waited for
            pool.terminate()
        pool.join()
    return rows, f"read by {jobs} processes on this machine"


def _on_cluster(work, paths: list[str], scheduler: str, progress) -> tuple[list[Row], str]:
    try:
        from distributed import Client, KilledWorker, as_completed
    except ImportError:
        raise MPGuideError(f"a Dask scheduler needs dask[distributed]: {CLUSTER_EXTRA}") from None
    _reachable(scheduler)
    try:
        client = Client(scheduler, timeout=_CONNECT_S, set_as_default=False)
    except (OSError, TimeoutError, ValueError) as err:
        raise MPGuideError(f"no Dask scheduler at {scheduler}: {error_line(err)}") from None
    futures = []
    rows: list[Row] = []
    done = False
    try:
        workers = _some_workers(client, scheduler)
        futures = client.map(work, paths, pure=False)
        path_of = {f.key: p for f, p in zip(futures, paths, strict=True)}
        for future in as_completed(futures, loop=client.loop):
            try:
                rows.append(future.result())
            except KilledWorker:
                died = f"{path_of[future.key]}: the Dask workers reading it died (out of memory?)"
                raise MPGuideError(died) from None
            _tell(progress, rows, paths)
        done = True
    finally:
        if futures and not done:  # a trace failed, or Ctrl-C: the rest is not waited for
            client.cancel(futures)
        client.close()
    return rows, f"read by the {workers} workers of the Dask cluster at {scheduler}"


def _reachable(scheduler: str) -> None:
    """Fail in one line, within :data:`_CONNECT_S` seconds, on an address that is malformed,
    where nothing listens, or where what listens does not answer as a Dask scheduler: a
    Dask client waits for ever for an answer that never comes."""
    from distributed.comm import connect, get_address_host_port

    async def identity() -> object:
        comm = await connect(scheduler, timeout=_CONNECT_S)
        try:
            await comm.write({"op": "identity"})
            return await comm.read()
        finally:
            await comm.close()

    async def in_time() -> object:
        return await asyncio.wait_for(identity(), _CONNECT_S)

    try:
        host, port = get_address_host_port(scheduler)
        socket.create_connection((host, port), timeout=_CONNECT_S).close()
        answer = asyncio.run(in_time())
    except TimeoutError:
        raise MPGuideError(
            f"no Dask scheduler at {scheduler}: something listens there but gave no Dask "
            f"answer within {_CONNECT_S} s"
        ) from None
    except (OSError, ValueError) as err:
        raise MPGuideError(f"no Dask scheduler at {scheduler}: {error_line(err)}") from None
    if not (isinstance(answer, dict) and answer.get("type") == "Scheduler"):
        raise MPGuideError(f"no Dask scheduler at {scheduler}: it answered as {answer!r:.60}")


def _some_workers(client, scheduler: str) -> int:
    """How many workers the cluster has, once it has one; a one-line error if none comes
    within :data:`_CONNECT_S` seconds (tasks sent to a cluster without workers wait for ever)."""
    try:
        client.wait_for_workers(1, timeout=_CONNECT_S)
    except TimeoutError:
        raise MPGuideError(
            f"the Dask scheduler at {scheduler} has no workers (none came within {_CONNECT_S} s)"
        ) from None
    return len(client.scheduler_info()["workers"])


def _tell(progress, rows: list[Row], paths: list[str]) -> None:
    if progress is not None:
        progress(len(rows), len(paths), rows[-1])

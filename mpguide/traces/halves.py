"""A large file read in two parts at once: the first in this process, the rest in a worker
process (:func:`read`; :func:`mpguide.traces.trace.load` gives it where to cut a trace and how
to decode a part). This module knows processes and files, not JSON."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from mpguide import MPGuideError, error_line

log = logging.getLogger(__name__)

_SHARE = 0.55  # of the file decoded here (the worker first starts Python and imports; on a
# 1 M-event trace 0.55 balanced the two best of 0.5, 0.52, 0.55, 0.58 and 0.6)
_REPLACED = 3
"""The worker's exit status when the path it was given is no longer the file being read."""
_ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
"""The worker does no linear algebra: numpy's BLAS threads, started at import, would take
0.1 s of CPU from this process's decoding."""


Cut = Callable[[Any, int], "tuple[int, int, bytes, bytes] | None"]
"""Where to cut an open file of a size: ``(cut, start, head, tail)``, the first part being
bytes ``:cut`` closed by ``head`` and the second bytes ``start:`` opened by ``tail``; None
where no cut is found."""
Part = Callable[[Any, int, "int | None", bytes, bytes], Any]
"""A part of an open file decoded: ``part(f, start, stop, before, after)``, the bytes
``start:stop`` framed by ``before`` and ``after``; None where they do not decode alone."""


def read(path: Path, cut: Cut, part: Part, worker: list[str]) -> list | None:
    """Decode the first part of ``path`` here while a worker process decodes the rest; None
    when ``cut`` finds no cut or a part does not decode. ``worker`` is the Python code the
    worker runs and its first arguments: it calls :func:`work` with the arguments after
    them and its own ``part``.

    Both parts come from one file: this process opens ``path`` once, and the worker reads
    it only if it finds the same file there (device, inode, size, modification time); a
    file replaced or written to while it is read is refused (MPGuideError), not mixed."""
    try:
        f = path.open("rb")
    except OSError as err:
        log.info("%s: decoded in one piece: %s", path, error_line(err))
        return None
    with f:
        seen = _identity(f)
        found = cut(f, int(seen[2] * _SHARE))
        if found is None or not sys.executable:
            log.info("%s: decoded in one piece: no event boundary near the cut", path)
            return None
        f.seek(0)
        try:
            parts = _with_worker(f, seen, found, part, worker)
        except (OSError, EOFError, pickle.UnpicklingError) as err:
            # No temporary file, no worker or an unreadable result: one piece, and why.
            log.info("%s: decoded in one piece: the worker failed: %s", path, error_line(err))
            return None
        if _identity(f) != seen:
            raise _changed(path)
        return parts


def _identity(f) -> tuple[int, int, int, int]:
    """The device, inode, size and modification time (ns) of the open file ``f``."""
    st = os.fstat(f.fileno())
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _changed(path) -> MPGuideError:
    return MPGuideError(
        f"{path}: the file was replaced or written to while it was read; read it again once "
        "it is complete"
    )


def _with_worker(f, seen: tuple, found: tuple, part: Part, worker: list[str]) -> list | None:
    """Bytes ``:cut`` of the open file ``f`` closed by ``head`` decoded here, and bytes
    ``start:`` opened by ``tail`` in a worker, which reads the file only where it is still
    the one ``seen``; None if either part does not decode.

    The worker writes its part and its errors to temporary files that have no name, so that
    nothing is left on disk however this process ends; it is killed when this process
    leaves early (an error, or a signal that :mod:`mpguide.cli` turns into one), and by
    Linux when this process dies."""
    path = f.name
    cut, start, head, tail = found
    package = str(Path(__file__).resolve().parents[2])
    path_list = [package, *filter(None, [os.environ.get("PYTHONPATH")])]
    identity = ",".join(map(str, seen))
    argv = [sys.executable, "-c", *worker, path, str(start), tail.decode(), str(os.getpid())]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as errors:
        worker = subprocess.Popen(
            [*argv, identity],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=errors,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(path_list), **_ONE_THREAD},
        )
        try:
            first = part(f, 0, cut, b"", head)
            status = None if first is None else worker.wait()
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        if first is None:
            log.info("%s: decoded in one piece: the first part does not decode alone", path)
            return None
        if status == _REPLACED:
            raise _changed(path)
        if status != 0:
            errors.seek(0)
            said = errors.read().decode(errors="replace").strip().splitlines()
            said = said or ["nothing on stderr"]
            log.info("%s: decoded in one piece: the worker exited %d: %s", path, status, said[-1])
            return None
        out.seek(0)
        return [first, pickle.load(out)]


def die_with(parent: int) -> None:
    """Have Linux kill this process when its parent dies; end now if it has already."""
    if sys.platform.startswith("linux"):
        import ctypes

        with suppress(AttributeError, OSError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        raise SystemExit(1)


def work(argv: list[str], part: Part) -> None:
    """The worker of :func:`read`: ``part`` of the file ``path`` from byte ``start`` to its
    end, framed by ``before``, pickled to stdout; ``parent`` is the pid of the process that
    started it, ``identity`` that of the file it opened. Exits ``_REPLACED`` if ``path`` is
    now another file."""
    path, start, before, parent, identity = argv
    die_with(int(parent))
    with open(path, "rb") as f:
        if ",".join(map(str, _identity(f))) != identity:
            raise SystemExit(_REPLACED)
        got = part(f, int(start), None, before.encode(), b"")
    if got is None:
        raise SystemExit("the second part does not decode alone")
    pickle.dump(got, sys.stdout.buffer, protocol=pickle.HIGHEST_PROTOCOL)
    sys.stdout.buffer.flush()

"""What ends the command and how its output is written.

SIGTERM and SIGHUP end the command where it is, so that its clean-up runs; only the process
that started the command writes (the reader's code may fork); the output goes to stdout in
batches, in what stdout's encoding carries, and a closed stdout or a reader who stopped
reading ends the command with its status instead of a traceback.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from mpguide.core.table import escape_controls


class Ended(BaseException):
    """A signal that ends the command, raised where the program is, so that its clean-up
    runs (the trace reader kills its worker)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def signals_end_the_command() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`Ended` while the command runs (in the main thread,
    the only one that can handle signals); the handlers before are restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def end(signum, frame):
        raise Ended(signum)

    ending = [getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n)]
    before = {s: signal.getsignal(s) for s in ending}
    try:
        for s in ending:
            signal.signal(s, end)
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


STARTED = [os.getpid()]
"""The process that runs the command: only it writes (the reader's code may fork)."""


def only_the_first(status: int) -> None:
    """End a process forked from the command's (by the reader's code) without a word."""
    if os.getpid() != STARTED[0]:
        os._exit(status)


def said(line: str, status: int) -> int:
    only_the_first(status)
    print(f"mpguide: {escape_controls(line)}", file=sys.stderr)
    return status


def notes(lines: Iterable[str]) -> None:
    """Notes beside the output (or that its format has no place for, CSV's), one line each on
    stderr, control characters escaped."""
    for line in lines:
        print(f"mpguide: note: {escape_controls(line)}", file=sys.stderr)


def drop_stdout() -> None:
    """Send what stdout still holds to /dev/null, so that exiting does not fail on it."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError, AttributeError):
        pass  # not a file (a test's capture): nothing is flushed at exit


ASCII = str.maketrans({"└": "`", "├": "|", "│": "|", "─": "-", "µ": "u", "×": "x", "…": "..."})
"""What the output's own characters become where stdout's encoding cannot carry them."""
BATCH = 1 << 16


def encodable(text: str, encoding: str) -> str:
    """``text`` as ``encoding`` can carry it: the output's box-drawing characters and units
    in ASCII, other characters escaped (``\\u2603``)."""
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        text = text.translate(ASCII)
        return text.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:  # an encoding Python does not know: ASCII is safe
        return encodable(text, "ascii")
    return text


def pieces(out: str | Iterable[str]) -> Iterator[str]:
    """The output in pieces of about :data:`BATCH` characters, each ending in a newline."""
    if isinstance(out, str):
        yield out if out.endswith("\n") else out + "\n"
        return
    batch, size = [], 0
    for line in out:
        batch.append(line)
        size += len(line) + 1
        if size >= BATCH:
            yield "\n".join(batch) + "\n"
            batch, size = [], 0
    if batch:
        yield "\n".join(batch) + "\n"


def write(out: str | Iterable[str]) -> int:
    """Write the output (a string, or lines made as they are written) to stdout in what
    its encoding carries; the exit status."""
    only_the_first(0)
    stdout = sys.stdout
    if stdout is None or getattr(stdout, "closed", False):
        return said("error: cannot write the output: stdout is closed", 2)
    encoding = getattr(stdout, "encoding", None) or "utf-8"
    utf = encoding.lower().replace("-", "").replace("_", "") in ("utf8", "utf8sig")
    try:
        for piece in pieces(out):
            stdout.write(piece if utf else encodable(piece, encoding))
        stdout.flush()
    except BrokenPipeError:  # whoever read the output stopped reading: end as a pipe would
        drop_stdout()
        return 128 + 13
    except OSError as err:
        drop_stdout()
        return said(f"error: cannot write the output: {err}", 2)
    except ValueError as err:  # closed meanwhile (by the reader's code)
        if not getattr(stdout, "closed", False):
            raise
        return said(f"error: cannot write the output: stdout is closed ({err})", 2)
    return 0

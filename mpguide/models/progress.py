"""Progress of a long run on stderr, for a person at a terminal.

:func:`to_terminal` gives a :class:`Progress` where stderr is a terminal, so captured output
(a test's, a pipe's) stays as documented; ``MPGUIDE_PROGRESS=1`` forces it on, ``0`` off.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

ENV = "MPGUIDE_PROGRESS"
"""``1``: progress on stderr even where it is not a terminal; ``0``: never."""


class Progress:
    """Say where a run is, at most once every ``every`` seconds (the first message always): on
    a terminal one line rewritten in place, elsewhere one line each."""

    def __init__(
        self,
        stream: TextIO,
        every: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stream, self.every, self.clock = stream, every, clock
        self.tty = stream.isatty()
        self._last: float | None = None
        self._width = 0

    def __call__(self, text: str) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.every:
            return
        self._last = now
        line = f"mpguide: {text}"
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        """Clear the terminal's progress line."""
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
        self._width = 0


def to_terminal(stream: TextIO | None = None) -> Progress | None:
    """A :class:`Progress` on ``stream`` (stderr) where it is a terminal or :data:`ENV` is
    ``1``; ``None`` where it is not or :data:`ENV` is ``0``."""
    stream = sys.stderr if stream is None else stream
    forced = os.environ.get(ENV)
    if forced == "0" or (forced != "1" and not stream.isatty()):
        return None
    return Progress(stream)

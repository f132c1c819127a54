"""``python -m mpguide`` run many times by one page without importing torch each time.

One server process imports torch and the command line once; each command then runs in a process
forked from it, as ``python -m`` runs a package: its own arguments, working folder (first on
the module search path), environment and exit status; stdin from /dev/null, stdout and stderr
each to a file without a name. What a command prints is what ``python -m mpguide`` prints (the
first frames of a traceback aside; tests/test_forked_cli.py compares the two); only torch's
import (about 2.5 s of CPU on this project's build machine) is not repeated. Where the imports
print anything, which a fresh process would show, or a command's environment differs from the
server's in more than ``COLUMNS``, the command runs as a plain subprocess instead.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Sequence

_READ_LATER = {"COLUMNS"}
"""Variables read when a command runs, not when torch is imported: free to differ."""


class _Server:
    def __init__(self):
        self.env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
        )
        self.quiet = self._answer()["quiet"]
        atexit.register(self.close)

    def close(self) -> None:
        """End the server: it reads the end of its input and returns."""
        self.proc.stdin.close()
        self.proc.wait()
        self.proc.stdout.close()

    def _answer(self) -> dict:
        return json.loads(self.proc.stdout.readline())

    def takes(self, env: dict[str, str]) -> bool:
        differs = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return self.quiet and not differs - _READ_LATER

    def run(self, args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
        self.proc.stdin.write(json.dumps({"args": args, "env": env, "cwd": os.getcwd()}) + "\n")
        self.proc.stdin.flush()
        done = self._answer()
        return done["status"], done["stdout"], done["stderr"]


_server: _Server | None = None


def run(*args: str, columns: int | None = None, check: bool = False):
    """Run ``python -m mpguide ARGS`` in the current folder, ``COLUMNS`` set to ``columns`` when
    given; return the :class:`subprocess.CompletedProcess`, stdout and stderr as text."""
    global _server
    env = dict(os.environ)
    if columns is not None:
        env["COLUMNS"] = str(columns)
    cmd = [sys.executable, "-m", "mpguide", *args]
    if hasattr(os, "fork"):  # not on Windows
        _server = _server or _Server()
    if _server is None or not _server.takes(env):
        return subprocess.run(cmd, capture_output=True, text=True, env=env, check=check)
    proc = subprocess.CompletedProcess(cmd, *_server.run(list(args), env))
    if check:
        proc.check_returncode()
    return proc


def _serve() -> None:
    """Import torch and the command line, say whether that printed anything, then run each
    command read from stdin (one JSON line) in a forked child, answering one JSON line each.
    The output goes to temporary files without a name: nothing is left on disk however this
    process ends."""
    filters = warnings.filters[:]  # a fresh process's, given back to each child
    # Python 3.12 warns on forking a process with threads (numpy's BLAS starts some at import);
    # each child is forked before it runs anything, as a fresh process starts.
    warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        streams = (os.open(os.devnull, os.O_RDONLY), out.fileno(), err.fileno())
        saved = [os.dup(fd) for fd in (0, 1, 2)]
        _redirect(streams)
        import torch  # noqa: F401

        import mpguide.cli  # noqa: F401

        _flush()
        _redirect(saved)
        for fd in saved:
            os.close(fd)
        _answer(answers, quiet=not any(f.seek(0, os.SEEK_END) for f in (out, err)))
        for line in sys.stdin:
            for f in (out, err):
                f.seek(0)
                f.truncate()
            pid = os.fork()
            if pid == 0:
                warnings.filters[:] = filters
                _child(json.loads(line), streams)
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            out.seek(0)
            err.seek(0)
            _answer(
                answers,
                status=status,
                stdout=out.read().decode("utf-8", errors="replace"),
                stderr=err.read().decode("utf-8", errors="replace"),
            )


def _answer(stream, **fields) -> None:
    stream.write(json.dumps(fields) + "\n")
    stream.flush()


def _redirect(fds: Sequence[int]) -> None:
    """File descriptors 0, 1 and 2 made copies of ``fds``."""
    for fd, source in enumerate(fds):
        os.dup2(source, fd)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def _child(job: dict, streams: Sequence[int]) -> None:
    """Run one command as ``python -m mpguide`` runs in a fresh process, then end."""
    status = 0
    try:
        _redirect(streams)
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        sys.path[0] = job["cwd"]
        sys.argv = ["-m", *job["args"]]
        runpy.run_module("mpguide", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            status = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints it
        traceback.print_exc()
        status = 1
    finally:
        atexit._run_exitfuncs()
        _flush()
        os._exit(status)


if __name__ == "__main__":
    _serve()

"""Probe the registered ops on a real device in a child process, so that an op whose kernel
ends the process (a segmentation fault inside a CUDA library, an abort, a kill) or breaks the
device (a CUDA error such as a device-side assert, after which every later call fails) is
listed as such, and the probe goes on from the next op in a fresh child.

:func:`probe_ops` is what :func:`mpguide.autocast.policy.probe` uses on a real accelerator.
An op whose probe died gets a :class:`~mpguide.autocast.probing.Probe` like any other (class
``unsupported``, every run an error), whose note begins with
:data:`~mpguide.autocast.probing.DIED` and names the signal and the child's last words on
stderr: ``probe died: SIGSEGV (Fatal Python error: Segmentation fault; at catalogue.py:135)``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

import mpguide
from mpguide.autocast import catalogue
from mpguide.autocast.calls import Inputs, Op
from mpguide.autocast.probing import DIED, UNSUPPORTED, Probe, Run, probe_op
from mpguide.core import device as _device
from mpguide.core import dtypes

TIMEOUT_S = 300.0
"""How long one op may take in the child before it is killed and listed as dead."""
_BROKEN = re.compile(r"CUDA error|device-side assert|illegal memory access|AcceleratorError")
"""An error after which the device of the process is unusable: later ops would fail too."""


def _broken(dev: torch.device, probe: Probe) -> str | None:
    """Why ``dev`` is unusable after ``probe`` (an error of the probe itself, or one the device
    reports when waited on), or ``None``."""
    runs = (probe.fp32_in, probe.low_in, probe.mixed_in)
    found = next((r.error for r in runs if r and r.error and _BROKEN.search(r.error)), None)
    if found:
        return found
    if dev.type == "cuda":
        try:
            torch.cuda.synchronize(dev)
        except Exception as err:  # noqa: BLE001 - the device's own report
            return f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"
    return None


def _child() -> None:
    """Probe the ops named on stdin, writing a pickled ``(kind, value)`` per event to stdout;
    after an op that breaks the device, say so and stop (a fresh child takes the rest)."""
    faulthandler.enable()  # a crash prints the Python stack on stderr
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the ops print goes to stderr, not into the stream
    dev, dtype, seed, names = json.load(sys.stdin)
    ops = {op.name: op for op in catalogue.ops()}
    target = _device.target(dev)
    for name in names:
        pickle.dump(("start", name), out)
        out.flush()
        probe = probe_op(ops[name], target, dtypes.parse(dtype), seed)
        pickle.dump(("done", probe), out)
        out.flush()
        why = _broken(target.device, probe)
        if why:
            pickle.dump(("broken", why), out)
            out.close()
            os._exit(3)  # a broken CUDA context can hang an orderly exit
    pickle.dump(("end", None), out)
    out.close()


def _env() -> dict[str, str]:
    """The environment of a child: this one, with the folder this mpguide was imported from
    first on its module path (the parent may have found it through ``sys.path`` alone)."""
    here = str(Path(mpguide.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": here + (os.pathsep + path if path else "")}


def _died(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit status {exitcode}"


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')


def last_words(stderr: str) -> str:
    """The line of a dead child's stderr that says why it died: Python's fatal error with the
    innermost frame of the stack ``faulthandler`` printed under it, else the last line that
    names an error, else the last line; at most 200 characters."""
    lines = [line.rstrip() for line in stderr.splitlines() if line.strip()]
    if not lines:
        return ""
    fatal = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
    if fatal:
        words = lines[fatal[-1]].strip()
        frame = next((m for line in lines[fatal[-1] :] if (m := _FRAME.match(line))), None)
        if frame:
            words += f"; at {Path(frame['file']).name}:{frame['line']}"
    else:
        named = [line for line in lines if re.search(r"\b\w*(Error|Exception)\b", line)]
        words = (named or lines)[-1].strip()
    return words if len(words) <= 200 else words[:199] + "…"


def _n_floats(op: Op) -> int | None:
    """How many floating inputs ``op`` takes (made on the CPU), or ``None`` if unknown."""
    try:
        args = op.inputs(Inputs(torch.device("cpu")))
    except Exception:  # noqa: BLE001 - unknown: every run is listed as dead
        return None
    return sum(isinstance(x, torch.Tensor) and x.is_floating_point() for x in tree_leaves(args))


def crashed(op: Op, dev: str, how: str, words: str = "") -> Probe:
    """The probe of an op whose call ended the process or broke the device: every run an
    error (the mixed run too, where the op takes two or more floating inputs), the note
    beginning with :data:`~mpguide.autocast.probing.DIED`."""
    why = f"{DIED}: {how}" + (f" ({words})" if words else "") + f", running this op on {dev}"
    run = Run(None, (), why)
    n = _n_floats(op)
    return Probe(
        op.name, op.family, UNSUPPORTED, run, run, run if n is None or n >= 2 else None, why
    )


def _events(stream, into: queue.Queue) -> None:
    """Read the child's events into ``into``, then ``None`` when the stream ends."""
    try:
        while True:
            into.put(pickle.load(stream))
    except (EOFError, pickle.UnpicklingError, OSError):
        pass
    into.put(None)


def probe_ops(
    ops: Sequence[Op],
    dev: str,
    dtype: torch.dtype,
    seed: int = 0,
    progress: Callable[[str], None] = lambda msg: None,
    timeout: float = TIMEOUT_S,
) -> tuple[Probe, ...]:
    """:func:`~mpguide.autocast.probing.probe_op` for each of ``ops`` (ops of the registered
    catalogue, rebuilt by name in the child) on the real device ``dev``, in spawned children.

    Every op gets a probe: one whose child died (a signal, an exit, no answer in ``timeout``
    seconds) or broke the device is listed by :func:`crashed`, and the next child goes on
    from the op after it; a child that dies before its first op takes the ops left with it.
    """
    by_name = {op.name: op for op in ops}
    left = [op.name for op in ops]
    done: dict[str, Probe] = {}
    while left:
        with tempfile.TemporaryFile() as err:
            child = subprocess.Popen(
                [sys.executable, "-m", "mpguide.autocast.isolated"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=_env(),
            )
            child.stdin.write(json.dumps([dev, str(dtype), seed, left]).encode())
            child.stdin.close()
            events: queue.Queue = queue.Queue()
            threading.Thread(target=_events, args=(child.stdout, events), daemon=True).start()
            current = last = broken = None
            finished = hung = False
            while True:
                try:
                    event = events.get(timeout=timeout)
                except queue.Empty:
                    hung = True
                    child.kill()
                    continue
                if event is None:
                    break
                kind, value = event
                if kind == "start":
                    current = value
                elif kind == "done":
                    done[current], last, current = value, current, None
                elif kind == "broken":
                    broken = value
                else:
                    finished = True
            child.wait()
            child.stdout.close()
            err.seek(max(0, err.seek(0, os.SEEK_END) - 65536))
            words = last_words(err.read().decode(errors="replace"))
        if finished:
            break
        how = f"no answer in {timeout:g} s, killed" if hung else _died(child.returncode)
        if broken:  # the op ran to its end and left the device unusable
            current, how, words = last, "the device broke", broken
        elif current is None:  # died between ops: the next child goes on from there
            if last is not None:
                left = [name for name in left if name not in done]
                continue
            progress(f"the probing process died before its first op ({how}): {words}")
            for name in left:
                done[name] = crashed(by_name[name], dev, f"{how} before its first op", words)
            break
        progress(f"{current} ended the probing process ({how}); going on in a new one")
        done[current] = crashed(by_name[current], dev, how, words)
        left = left[left.index(current) + 1 :]
    return tuple(done[op.name] for op in ops)


if __name__ == "__main__":
    _child()

"""Probe the registered ops on a real device in a child process, so that an op whose kernel
crashes the process (a segmentation fault inside a CUDA library, say) is listed as crashing
and the probe goes on from the next op in a fresh child.

:func:`probe_ops` is what :func:`mpguide.autocast.policy.probe` uses on a real accelerator.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from mpguide.autocast import catalogue
from mpguide.autocast.calls import Op
from mpguide.autocast.probing import UNSUPPORTED, Probe, Run, probe_op
from mpguide.core import device as _device
from mpguide.core import dtypes


def _child() -> None:
    """Probe the ops named on stdin, writing a pickled ``(kind, value)`` per event to stdout."""
    faulthandler.enable()  # a crash prints the Python stack on stderr
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the ops print goes to stderr, not into the stream
    dev, dtype, seed, names = json.load(sys.stdin)
    ops = {op.name: op for op in catalogue.ops()}
    target = _device.target(dev)
    for name in names:
        pickle.dump(("start", name), out)
        out.flush()
        pickle.dump(("done", probe_op(ops[name], target, dtypes.parse(dtype), seed)), out)
    pickle.dump(("end", None), out)
    out.close()


def _env() -> dict[str, str]:
    """The environment of a child: this one, with the folder this mpguide was imported from
    first on its module path (the parent may have found it through ``sys.path`` alone)."""
    import mpguide

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


def crashed(op: Op, dev: str, how: str) -> Probe:
    """The probe of an op whose call ended the process."""
    why = f"the process died ({how}) running this op on {dev}"
    run = Run(None, (), why)
    return Probe(op.name, op.family, UNSUPPORTED, run, run, None, why)


def probe_ops(
    ops: Sequence[Op],
    dev: str,
    dtype: torch.dtype,
    seed: int = 0,
    progress: Callable[[str], None] = lambda msg: None,
) -> tuple[Probe, ...]:
    """:func:`~mpguide.autocast.probing.probe_op` for each of ``ops`` (ops of the registered
    catalogue, rebuilt by name in the child) on the real device ``dev``, in spawned children."""
    by_name = {op.name: op for op in ops}
    left = [op.name for op in ops]
    done: dict[str, Probe] = {}
    while left:
        child = subprocess.Popen(
            [sys.executable, "-m", "mpguide.autocast.isolated"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_env(),
        )
        child.stdin.write(json.dumps([dev, str(dtype), seed, left]).encode())
        child.stdin.close()
        current, finished = None, False
        try:
            while True:
                kind, value = pickle.load(child.stdout)
                if kind == "start":
                    current = value
                elif kind == "done":
                    done[current], current = value, None
                else:
                    finished = True
                    break
        except EOFError:
            pass
        child.stdout.close()
        child.wait()
        if finished:
            break
        if current is None:  # died between ops: nothing to blame, nothing left to learn
            raise RuntimeError(f"the probing process ended ({_died(child.returncode)})")
        how = _died(child.returncode)
        progress(f"{current} crashed the probing process ({how}); going on in a new one")
        done[current] = crashed(by_name[current], dev, how)
        left = left[left.index(current) + 1 :]
    return tuple(done[op.name] for op in ops)


if __name__ == "__main__":
    _child()

"""Run a callable under ``torch.profiler`` with a schedule and give back its trace.

:func:`profile_fn` calls ``fn`` once per profiler step (``wait + warmup + active`` calls),
records shapes, the CPU always and CUDA when this torch sees a GPU, exports the chrome trace
and reads it back with :func:`mpguide.traces.trace.load`: the trace a reader's own file gives is the
trace the examples use.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from mpguide import MPGuideError
from mpguide.traces.trace import Trace, load


def activities() -> list[ProfilerActivity]:
    """The activities this machine can record: CPU, and CUDA when a GPU is present."""
    found = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        found.append(ProfilerActivity.CUDA)
    return found


def profile_fn(
    fn: Callable[[], Any],
    *,
    wait: int = 1,
    warmup: int = 1,
    active: int = 1,
    path: str | Path | None = None,
    with_stack: bool = False,
    record_shapes: bool = True,
) -> Trace:
    """Profile ``fn`` over ``wait + warmup + active`` steps and return the recorded trace.

    Only the ``active`` steps are recorded, each under a ``ProfilerStep#N`` range. With
    ``path`` the chrome trace is written there (``.json``, or gzipped when the name ends in
    ``.gz``); otherwise it goes through a temporary file. The device is synchronised after
    every step so GPU work lands in the step that launched it.
    """
    if wait < 0 or warmup < 0 or active < 1:
        raise MPGuideError(
            f"need wait >= 0, warmup >= 0 and active >= 1, got "
            f"wait={wait}, warmup={warmup}, active={active}"
        )
    acts = activities()
    with profile(
        activities=acts,
        schedule=schedule(wait=wait, warmup=warmup, active=active),
        record_shapes=record_shapes,
        with_stack=with_stack,
        acc_events=True,  # one cycle: the same events; without it 2.11 and 2.12 warn
    ) as prof:
        for _ in range(wait + warmup + active):
            fn()
            if ProfilerActivity.CUDA in acts:
                torch.cuda.synchronize()
            prof.step()
    if path is not None:
        prof.export_chrome_trace(str(path))
        return load(path)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(out))
        trace = load(out)
    return replace(trace, source="")

"""Device-synchronised latency and peak memory of a callable.

Latency: each call is timed between two device synchronisations, after warm-up calls, and
the result keeps every sample so the median and the spread (interquartile range) are computed
from them. Several callables are timed in interleaved rounds, so a background load that comes
and goes hits all of them alike. The clock and the synchronisation are arguments, so the
statistics can be tested with a fake clock.

Peak memory: on CUDA, the caching allocator's peak statistic; on the CPU, the allocation
events the profiler records (``profile_memory=True``), summed in time order. Both count what
goes through PyTorch's allocators, not scratch memory a library such as oneDNN allocates
itself.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from html import escape
from typing import Any

import torch

from mpguide import MPGuideError
from mpguide.core import device as _device
from mpguide.core.table import Table

NOISY = 0.10
"""A latency whose interquartile range exceeds this share of its median is flagged as noisy."""
FEW = 5
"""Fewer samples than this are flagged: their quartiles mean little."""


def synchronizer(dev: torch.device | str | None = None) -> Callable[[], None]:
    """A function that waits until ``dev`` has finished its queued work (a no-op on the CPU)."""
    dev = _device.pick() if dev is None else torch.device(dev)
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return lambda: None


def _quartiles(xs: tuple[float, ...]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


@dataclass(frozen=True)
class Latency:
    """Seconds per call of one callable, with its statistics and warnings when noisy."""

    label: str
    times: tuple[float, ...]
    device: str
    items: int | None = None

    def __post_init__(self):
        if not self.times:
            raise MPGuideError(f"latency {self.label!r} has no samples")

    @property
    def median(self) -> float:
        return _quartiles(self.times)[1]

    @property
    def quartiles(self) -> tuple[float, float]:
        """The first and third quartiles, in seconds."""
        q1, _, q3 = _quartiles(self.times)
        return q1, q3

    @property
    def spread(self) -> float:
        """The interquartile range, in seconds."""
        q1, q3 = self.quartiles
        return q3 - q1

    @property
    def relative_spread(self) -> float:
        """The interquartile range as a share of the median."""
        return self.spread / self.median if self.median > 0 else float("inf")

    @property
    def throughput(self) -> float | None:
        """Items per second at the median latency (``items`` per call)."""
        return None if self.items is None else self.items / self.median

    @property
    def warnings(self) -> tuple[str, ...]:
        out = []
        if len(self.times) < FEW:
            out.append(f"only {len(self.times)} samples")
        if self.relative_spread > NOISY:
            out.append(
                f"noisy: the interquartile range is {self.relative_spread:.0%} of the median"
            )
        return tuple(out)

    def clearly_below(self, other: Latency) -> bool:
        """Whether this median is below ``other``'s by more than both spreads together."""
        return other.median - self.median > self.spread + other.spread

    def summary(self) -> str:
        line = (
            f"{self.label}: median {self.median * 1e3:.3f} ms, "
            f"IQR {self.spread * 1e3:.3f} ms, {len(self.times)} runs on {self.device}"
        )
        if self.throughput is not None:
            line += f", {self.throughput:,.0f} items/s"
        return line

    def __repr__(self) -> str:
        return "\n".join([self.summary(), *(f"warning: {w}" for w in self.warnings)])

    def _repr_html_(self) -> str:
        warn = "".join(f"<br><em>warning: {escape(w)}</em>" for w in self.warnings)
        return f"<p>{escape(self.summary())}{warn}</p>"


def compare_latency(
    fns: Mapping[str, Callable[[], Any]],
    dev: torch.device | str | None = None,
    *,
    warmup: int = 3,
    repeat: int = 20,
    items: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], None] | None = None,
) -> dict[str, Latency]:
    """Time every callable of ``fns`` ``repeat`` times, in interleaved rounds after warm-up.

    Each sample is ``clock()`` read after a device synchronisation before the call and after
    another one following it. ``items`` is how many items one call processes (for throughput).
    """
    if repeat < 1 or warmup < 0:
        raise MPGuideError(f"need repeat >= 1 and warmup >= 0, got {repeat} and {warmup}")
    if not fns:
        raise MPGuideError("nothing to time")
    dev = _device.pick() if dev is None else torch.device(dev)
    sync = synchronizer(dev) if sync is None else sync
    for fn in fns.values():
        for _ in range(warmup):
            fn()
        sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            sync()
            start = clock()
            fn()
            sync()
            samples[name].append(clock() - start)
    return {name: Latency(name, tuple(ts), dev.type, items) for name, ts in samples.items()}


def measure(
    fn: Callable[[], Any], dev: torch.device | str | None = None, *, label: str = "", **kwargs: Any
) -> Latency:
    """Time one callable; the keyword arguments are those of :func:`compare_latency`."""
    name = label or getattr(fn, "__name__", "call")
    return compare_latency({name: fn}, dev, **kwargs)[name]


def latency_table(latencies: Mapping[str, Latency], caption: str = "") -> Table:
    """Latencies side by side, in milliseconds, with their warnings."""
    rows = tuple(
        (
            name,
            lat.median * 1e3,
            lat.spread * 1e3,
            len(lat.times),
            lat.throughput,
            "; ".join(lat.warnings),
        )
        for name, lat in latencies.items()
    )
    return Table(("callable", "median ms", "IQR ms", "runs", "items/s", "warnings"), rows, caption)


@dataclass(frozen=True)
class Memory:
    """The peak memory a call allocated above what was allocated when it started."""

    label: str
    device: str
    peak_bytes: int
    method: str

    def __repr__(self) -> str:
        return (
            f"{self.label}: peak {self.peak_bytes / 2**20:.3f} MiB above the start "
            f"on {self.device} ({self.method})"
        )

    def _repr_html_(self) -> str:
        return f"<p>{escape(repr(self))}</p>"


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null inside the block (what C++ code prints there)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _cpu_peak(fn: Callable[[], Any]) -> int:
    from torch.profiler import ProfilerActivity, profile

    # acc_events: one cycle either way; without it 2.11 and 2.12 warn (versions.CHANGES)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, acc_events=True)
    with _quiet_stderr():  # the profiler's own start and stop lines are not the reader's
        prof.__enter__()
    try:
        fn()
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _cuda_peak(fn: Callable[[], Any], dev: torch.device) -> int:
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    start = torch.cuda.memory_allocated(dev)
    fn()
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - start


def peak_memory(
    fn: Callable[[], Any], dev: torch.device | str | None = None, *, label: str = ""
) -> Memory:
    """The peak memory ``fn`` allocates on ``dev`` above what was allocated before it ran.

    What ``fn`` returns counts while it lives (until ``fn`` returns and the result is dropped).
    """
    dev = _device.pick() if dev is None else torch.device(dev)
    label = label or getattr(fn, "__name__", "call")
    if dev.type == "cuda":
        return Memory(label, dev.type, _cuda_peak(fn, dev), "torch.cuda.max_memory_allocated")
    return Memory(label, dev.type, _cpu_peak(fn), "profiler allocation events")

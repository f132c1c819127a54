"""The memory reading a trace takes, known before it is read: :data:`BYTES_PER_EVENT`, the
events of a plain file counted from samples (:func:`count_events`), what this process may take
(:func:`available_memory`), and the one-line refusal when a trace would need more
(:func:`check_memory`).
"""

from __future__ import annotations

from contextlib import suppress
from pathlib import Path

from mpguide import MPGuideError


def size_text(n: int) -> str:
    """``n`` bytes in binary units: ``'2 GiB'``, ``'1.5 MiB'``, ``'900 bytes'``."""
    for unit, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            return f"{n / unit:.4g} {name}"
    return f"{n} bytes"


BYTES_PER_EVENT = 68
"""The most memory that reading a trace, nesting its tree and reporting its casts take per
event, in bytes, measured on traces of tiny events (docs/cli.md; a profiler's events, with
their args, take more bytes of file each and about as much memory)."""
_BASE_MEMORY = 128 << 20
"""What reading takes beyond the events: its buffers and one piece being decoded."""
_SAMPLE = 4 << 20


def available_memory() -> tuple[int, str] | None:
    """How many more bytes this process may take, and what bounds it: the address-space
    limit (``ulimit -v``) less what the process holds, the memory limit of its cgroup (a
    container) less what the cgroup uses, or the memory the machine has free, whichever is
    least; None where none is known."""
    found = []
    with suppress(OSError, ValueError, AttributeError):
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            held = _status_kib("VmSize:") << 10
            found.append((soft - held, "the address-space limit (ulimit -v) less what is held"))
    with suppress(OSError, ValueError):
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text())
            found.append((int(limit) - used, "the memory limit of this container less its use"))
    with suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        found.append((kib << 10, "the memory this machine has free"))
    return min(found) if found else None


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def count_events(path: Path) -> int:
    """About how many events the plain trace at ``path`` holds, counted without decoding:
    the ``"ph"`` keys in three samples, scaled to its size."""
    key, size = b'"ph"', path.stat().st_size
    with path.open("rb") as f:
        if size <= 3 * _SAMPLE:
            return f.read().count(key)
        seen = 0
        for at in (0, size // 2, size - _SAMPLE):
            f.seek(at)
            seen += f.read(_SAMPLE).count(key)
    return seen * size // (3 * _SAMPLE)


def estimated_memory(events: int) -> int:
    """The most memory that reading, nesting and reporting ``events`` events takes."""
    return _BASE_MEMORY + events * BYTES_PER_EVENT


def check_memory(
    where: str, events: int, found: tuple[int, str] | None = None, how: str = "", margin=1.0
) -> None:
    """MPGuideError when ``events`` events (``how`` they were counted) would need more
    than ``margin`` times the memory this process may take (``found``, else
    :func:`available_memory`), saying how much and what bounds it."""
    need = estimated_memory(events)
    found = found or available_memory()
    if found is None or need <= margin * found[0]:
        return
    may, bound = found
    raise MPGuideError(
        f"{where}: about {events:,} events{how} would need about {size_text(need)} of memory "
        f"({BYTES_PER_EVENT} bytes an event), more than the {size_text(max(may, 0))} this "
        f"process may take ({bound}); run it where more is free, or raise the limit"
    )

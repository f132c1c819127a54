"""Quantities written as a person reads them, one way across the package."""

from __future__ import annotations

import math


def duration_text(us: float | None) -> str | None:
    """A time in microseconds as a person reads it: ``'850 ns'``, ``'60.9 µs'``, ``'20.14 ms'``,
    ``'1.20 s'``, ``'1,234 s'``; ``'? µs'`` when it is not a number, None for None."""
    if us is None:
        return None
    if not math.isfinite(us):
        return "? µs"
    size = abs(us)
    if size >= 1e9:
        return f"{us / 1e6:,.0f} s"
    if size >= 1e6:
        return f"{us / 1e6:.2f} s"
    if size >= 1e3:
        return f"{us / 1e3:.2f} ms"
    if size >= 1 or size == 0:
        return f"{us:.1f} µs"
    return f"{us * 1000:.0f} ns"

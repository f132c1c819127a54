"""The compile chapter: each backend's result as grouped bars."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from mpguide import MPGuideError
from mpguide.plots.style import (
    DTYPE_COLOURS,
    GROUP_COLOURS,
    SMALL,
    TEXT,
    axes,
    heading,
    legend_below,
    value_axis,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from mpguide.compiled import backends


def backend_bars(
    values: Mapping[str, Mapping[str, float | None]],
    ylabel: str,
    title: str = "",
    log: bool = True,
    *,
    ax: Axes | None = None,
) -> Figure:
    """Grouped bars: one group per backend (in order of first appearance), one bar per entry
    of ``values`` (``{group: {backend: value}}``), each labelled with its value. ``None`` is a
    backend that raised, marked ``raised``; on a log scale a zero is marked ``0``."""
    if len(values) > len(GROUP_COLOURS):
        raise MPGuideError(f"at most {len(GROUP_COLOURS)} groups of bars, got {len(values)}")
    backends = list(dict.fromkeys(b for v in values.values() for b in v))
    positive = [x for v in values.values() for x in v.values() if x]
    floor = min(positive, default=1.0) / 10 if log else 0.0
    width = 0.8 / len(values)
    fig, ax, own = axes(ax, (max(4.5, 1.25 * len(backends) + 1.0), 3.6))
    for g, (group, per_backend) in enumerate(values.items()):
        xs = [i - 0.4 + width * (g + 0.5) for i, b in enumerate(backends) if b in per_backend]
        vs = [per_backend[b] for b in backends if b in per_backend]
        heights = [v - floor if v else 0 for v in vs]
        bars = ax.bar(xs, heights, width * 0.92, bottom=floor, color=GROUP_COLOURS[g], label=group)
        for bar, v in zip(bars, vs, strict=True):
            text = (
                "raised"
                if v is None
                else "0"
                if v == 0
                else f"{v:.3g}"
                if isinstance(v, float)
                else str(v)
            )
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, (v or floor) if log else (v or 0)),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=SMALL,
                color=DTYPE_COLOURS["error"] if v is None else "black",
            )
    if log:
        ax.set_yscale("log")
        ax.set_ylim(bottom=floor, top=max(positive, default=1.0) * 8)
    ax.set_xticks(range(len(backends)), [b.replace("+", "+\n") for b in backends], fontsize=TEXT)
    value_axis(ax, ylabel, grid=False)
    if len(values) > 1:
        legend_below(fig, ax, own, None, ncol=len(values))
    heading(fig, ax, own, title)
    return fig


# The statistics of an Outcome a bar chart can show, with the names Comparison.table gives them.
METRICS = {"max_abs": "max |error|", "max_rel": "max |error| / mean |ref|"}


def comparison_bars(
    comparisons: Mapping[str, backends.Comparison],
    metric: str = "max_abs",
    title: str = "",
    *,
    ax: Axes | None = None,
) -> Figure:
    """:func:`backend_bars` of one statistic (a key of :data:`METRICS`) of each backend's
    outcome, one group per :class:`~mpguide.compiled.backends.Comparison`; a backend that raised
    is marked ``raised``. The title ends with the machine the first comparison ran on."""
    if metric not in METRICS:
        raise MPGuideError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    values = {
        name: {o.backend: getattr(o, metric) for o in c.outcomes} for name, c in comparisons.items()
    }
    machine = next(iter(comparisons.values())).machine.caption() if comparisons else ""
    return backend_bars(values, METRICS[metric], ", ".join(t for t in (title, machine) if t), ax=ax)

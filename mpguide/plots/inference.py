"""The inference chapter: values past a format's range, latency against error."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mpguide.plots.style import BLUE, LOST_COLOUR, OP_COLOUR, TEXT, TITLE, as_float64, axes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from mpguide.models.inference import Result


def overflow_histogram(
    values: Sequence[float], limit: float, *, label: str, ax: Axes | None = None
) -> Figure:
    """A histogram of ``|values|`` with a format's largest finite value marked; the bins past
    it (values the format turns into infinity) are red."""
    import numpy as np

    mags = np.abs(as_float64(values))
    top = max(mags.max(), limit) * 1.05
    edges = np.union1d(np.linspace(0, top, 31), [limit])
    fig, ax, _ = axes(ax, (8.0, 3.8))
    _, _, patches = ax.hist(mags, bins=edges, color=OP_COLOUR, edgecolor=BLUE)
    for patch in patches:
        if patch.get_x() >= limit:
            patch.set_facecolor(LOST_COLOUR)
    over = int((mags > limit).sum())
    ax.axvline(limit, color=LOST_COLOUR, linestyle="--")
    ax.text(
        limit,
        0.97,
        f"largest finite: {limit:g}\n{over} of {mags.size} past it ",
        transform=ax.get_xaxis_transform(),
        va="top",
        ha="right",
        fontsize=TEXT,
        color=LOST_COLOUR,
    )
    ax.set_xlabel(label)
    ax.set_ylabel("count")
    return fig


def latency_error(
    runs: Sequence[Sequence[Result]], *, title: str = "", ax: Axes | None = None
) -> Figure:
    """One point per served variant: its median latency, with a bar from the first to the
    third quartile, against the largest error of its output; each run of variants (timed
    together) has its own marker. The error axis is linear near zero, where fp32 sits."""
    fig, ax, _ = axes(ax, (8.0, 4.8))
    for run, marker in zip(runs, "os^v", strict=False):
        for r in run:
            q1, q3 = r.latency.quartiles
            median = r.latency.median
            ax.errorbar(
                median * 1e3,
                r.max_error,
                xerr=[[(median - q1) * 1e3], [(q3 - median) * 1e3]],
                fmt=marker,
                capsize=3,
                label=r.name,
            )
    nonzero = [r.max_error for run in runs for r in run if r.max_error > 0]
    ax.set_yscale("symlog", linthresh=min(nonzero, default=1.0) / 2)
    ax.set_xscale("log")
    ax.set_xlabel("median latency of a forward pass (ms, log scale)")
    ax.set_ylabel("max |error| against fp32")
    if title:
        ax.set_title(title, fontsize=TITLE, loc="left")
    ax.legend(fontsize=TEXT, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    return fig

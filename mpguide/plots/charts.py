"""Charts any chapter composes: grouped horizontal bars."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from mpguide.plots.style import SERIES_COLOURS, TEXT, TITLE, axes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def bars(
    values: Mapping[str, Mapping[str, float]],
    *,
    xlabel: str,
    title: str = "",
    log: bool = False,
    fmt: str = "{:.3g}",
    ax: Axes | None = None,
) -> Figure:
    """Horizontal bars: one group per outer key (top to bottom), one bar per inner key, each
    labelled with its value; an inner key has the same colour in every group."""
    series = list(dict.fromkeys(k for inner in values.values() for k in inner))
    groups = list(values)
    height = 0.8 / len(series)
    size = (8.0, 0.28 * sum(map(len, values.values())) + 0.2 * len(groups) + 1.5)
    fig, ax, _ = axes(ax, size)
    for s, (name, colour) in enumerate(zip(series, SERIES_COLOURS, strict=False)):
        mine = [g for g in groups if name in values[g]]
        ys = [groups.index(g) - 0.4 + height * (s + 0.5) for g in mine]
        widths = [values[g][name] for g in mine]
        drawn = ax.barh(ys, widths, height=height * 0.9, color=colour, label=name)
        ax.bar_label(drawn, [fmt.format(w) for w in widths], padding=3, fontsize=TEXT)
    ax.set_yticks(range(len(groups)), groups, fontsize=TITLE)
    ax.set_ylim(len(groups) - 0.5, -0.5)
    if log:
        ax.set_xscale("log")
        ax.margins(x=0.25)
    else:
        ax.set_xlim(0, max(w for inner in values.values() for w in inner.values()) * 1.22)
    ax.set_xlabel(xlabel)
    ax.grid(True, axis="x", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=TITLE, loc="left")
    if len(series) > 1:
        ax.legend(
            fontsize=TEXT,
            loc="lower center",
            bbox_to_anchor=(0.5, 1.0 if not title else 1.06),
            ncol=min(len(series), 3),
            frameon=False,
        )
    return fig

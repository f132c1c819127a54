"""The low-bit chapter: each format's values and precision, recipes' errors, loss curves."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from mpguide.plots.style import FORMAT_COLOURS, SMALL, TEXT, TITLE, axes, grid

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from mpguide.core.table import Table
    from mpguide.precision.lowbit import Element


def element_grids(elements: Sequence[Element], *, ax: Sequence[Axes] | None = None) -> Figure:
    """Each format's positive values on a log2 axis (subnormals hollow), and below, the gap
    to the next value relative to the value: the precision at each magnitude. ``ax``: the two
    axes, top and bottom."""
    size = (8, 1.2 + 0.9 * len(elements))
    fig, (top, bottom), own = grid(ax, 2, 1, size, layout=None, sharex=True)
    for row, (fmt, colour) in enumerate(zip(elements, FORMAT_COLOURS, strict=False)):
        positive = [v for v in fmt.finite if v > 0]
        normal = [math.log2(v) for v in positive if v >= fmt.smallest_normal]
        sub = [math.log2(v) for v in positive if v < fmt.smallest_normal]
        top.scatter(normal, [row] * len(normal), marker="|", s=80, color=colour, gid=fmt.name)
        top.scatter(sub, [row] * len(sub), marker="o", s=14, facecolors="none", color=colour)
        gaps = [(b - a) / a for a, b in itertools.pairwise(positive)]
        bottom.step(
            [math.log2(v) for v in positive[:-1]], gaps, where="post", color=colour, label=fmt.name
        )
    top.set_yticks(range(len(elements)), [f.name for f in elements], fontsize=TEXT)
    top.set_title("positive values (subnormals hollow)", fontsize=TITLE)
    bottom.set_yscale("log", base=2)
    bottom.set_ylabel("gap / value")
    bottom.set_xlabel("log2 |value|")
    bottom.legend(fontsize=SMALL, ncol=3)
    if own:
        fig.tight_layout()
    else:  # the caller's axes may not share x
        lows, highs = zip(top.get_xlim(), bottom.get_xlim(), strict=True)
        for a in (top, bottom):
            a.set_xlim(min(lows), max(highs))
    return fig


def error_bars(
    table: Table, value: str, *, by: str, group: str, title: str = "", ax: Axes | None = None
) -> Figure:
    """Grouped bars of column ``value``: one group per distinct ``group`` cell, one bar per
    distinct ``by`` cell, on a log axis."""
    groups = list(dict.fromkeys(table.column(group)))
    bars = list(dict.fromkeys(table.column(by)))
    width = 0.8 / len(bars)
    fig, ax, own = axes(ax, (max(6.0, 1.1 * len(groups) + 2), 3.6), layout=None)
    for i, (name, colour) in enumerate(zip(bars, FORMAT_COLOURS * 3, strict=False)):
        cells = {r[group]: r[value] for r in table.records() if r[by] == name}
        heights = [cells.get(g, math.nan) for g in groups]
        xs = [g + (i - (len(bars) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, heights, width, label=name, color=colour, gid=name)
    ax.set_xticks(range(len(groups)), groups, fontsize=TEXT)
    ax.set_yscale("log")
    ax.set_ylabel(value)
    ax.legend(fontsize=SMALL, ncol=min(4, len(bars)))
    if title:
        ax.set_title(title, fontsize=TITLE)
    if own:
        fig.tight_layout()
    return fig


def loss_curves(
    curves: Mapping[str, Sequence[float]], *, title: str = "", ax: Axes | None = None
) -> Figure:
    """One loss curve per recipe, on one axis."""
    fig, ax, own = axes(ax, (7.5, 4), layout=None)
    for (name, losses), colour in zip(curves.items(), FORMAT_COLOURS * 3, strict=False):
        style = "-" if name == "bf16" else "--" if "sr" in name else "-"
        ax.plot(range(1, len(losses) + 1), losses, style, color=colour, label=name, gid=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=SMALL, ncol=2)
    if title:
        ax.set_title(title, fontsize=TITLE)
    if own:
        fig.tight_layout()
    return fig

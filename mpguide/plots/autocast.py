"""The autocast chapter: autocast's class of every op on every device."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mpguide.plots.style import CLASS_COLOURS, SMALL, TEXT, axes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from mpguide.autocast.policy import Devices


def policy_map(devices: Devices, only_differing: bool = False, *, ax: Axes | None = None) -> Figure:
    """The autocast class of every op (columns) on every device (rows), coloured by class."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from mpguide.autocast.policy import CLASSES

    table = devices.table()
    rows = [r for r in table.rows if r[-1] or not only_differing]
    ops = [r[0] for r in rows]
    grid = [[CLASSES.index(r[2 + d]) for r in rows] for d in range(len(devices.policies))]
    size = (max(6.0, 0.16 * len(ops) + 1.5), 0.45 * len(grid) + 2.6)
    fig, ax, own = axes(ax, size, layout=None)
    ax.imshow(
        grid,
        cmap=ListedColormap(CLASS_COLOURS),
        vmin=0,
        vmax=len(CLASSES) - 1,
        aspect="auto",
        interpolation="nearest",
    )
    ax.set_xticks(range(len(ops)), ops, rotation=90, fontsize=SMALL)
    ax.set_yticks(range(len(grid)), devices.labels, fontsize=TEXT)
    ax.set_xticks([x - 0.5 for x in range(1, len(ops))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(grid))], minor=True)
    ax.grid(which="minor", color="white", linewidth=0.6)
    ax.tick_params(which="minor", length=0)
    ax.legend(
        handles=[Patch(color=c, label=k) for c, k in zip(CLASS_COLOURS, CLASSES, strict=True)],
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=len(CLASSES),
        fontsize=TEXT,
        frameon=False,
    )
    if own:
        fig.tight_layout()
    return fig

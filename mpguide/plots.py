"""Figures in one style for every chapter: each takes a result object and returns the figure."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from mpguide.policy import Devices

# One colour per autocast class, in the order of mpguide.policy.CLASSES.
CLASS_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#d9d9d9", "#c44e52", "#8172b2")


def policy_map(devices: Devices, only_differing: bool = False) -> Figure:
    """The autocast class of every op (columns) on every device (rows), coloured by class."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from mpguide.policy import CLASSES

    table = devices.table()
    rows = [r for r in table.rows if r[-1] or not only_differing]
    ops = [r[0] for r in rows]
    grid = [[CLASSES.index(r[2 + d]) for r in rows] for d in range(len(devices.policies))]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.16 * len(ops) + 1.5), 0.45 * len(grid) + 2.6))
    ax.imshow(
        grid,
        cmap=ListedColormap(CLASS_COLOURS),
        vmin=0,
        vmax=len(CLASSES) - 1,
        aspect="auto",
        interpolation="nearest",
    )
    ax.set_xticks(range(len(ops)), ops, rotation=90, fontsize=7)
    ax.set_yticks(range(len(grid)), devices.labels, fontsize=8)
    ax.set_xticks([x - 0.5 for x in range(1, len(ops))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(grid))], minor=True)
    ax.grid(which="minor", color="white", linewidth=0.6)
    ax.tick_params(which="minor", length=0)
    ax.legend(
        handles=[Patch(color=c, label=k) for c, k in zip(CLASS_COLOURS, CLASSES, strict=True)],
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=len(CLASSES),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    return fig

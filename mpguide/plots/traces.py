"""The profiler chapter: call trees as icicles, cast time by cause and by module."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from mpguide import MPGuideError
from mpguide.plots.charts import bars
from mpguide.plots.style import (
    CAST_COLOUR,
    OP_COLOUR,
    SERIES_COLOURS,
    SMALL,
    TEXT,
    TITLE,
    axes,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from mpguide.traces.calltree import Node
    from mpguide.traces.casts import CastReport


def icicle(
    roots: Node | Sequence[Node],
    report: CastReport | None = None,
    *,
    scale: str = "time",
    title: str = "",
    ax: Axes | None = None,
) -> Figure:
    """A call tree as an icicle chart: one rectangle per CPU op, one row per depth below
    ``roots``, each op under its caller; the casts of ``report`` and the ops inside them are
    orange. ``scale="time"`` draws each op from its start to its end (µs);
    ``scale="ops"`` gives each op without children one unit of width, so that the shape of
    the tree does not depend on a noisy clock. Names are written where they fit."""
    from matplotlib.patches import Patch, Rectangle

    if scale not in ("time", "ops"):
        raise MPGuideError(f"scale must be 'time' or 'ops', not {scale!r}")
    roots = list(roots) if isinstance(roots, list | tuple) else [roots]
    cast_ids = {c.id for c in report} if report is not None else set()
    # Depth first: (node, depth, inside a cast, index of the parent in ``drawn``).
    drawn = []
    stack = [(r, 0, r.id in cast_ids, -1) for r in reversed(roots)]
    while stack:
        node, depth, in_cast, parent = stack.pop()
        drawn.append((node, depth, in_cast, parent))
        here = len(drawn) - 1
        kids = [c for c in node.children if not c.is_gpu]
        stack.extend((c, depth + 1, in_cast or c.id in cast_ids, here) for c in reversed(kids))
    if scale == "time":
        t0 = roots[0].start
        boxes = [(n.start - t0, n.dur) for n, *_ in drawn]
    else:
        leaves = [0] * len(drawn)
        for k in range(len(drawn) - 1, -1, -1):
            leaves[k] = max(leaves[k], 1)
            if drawn[k][3] >= 0:
                leaves[drawn[k][3]] += leaves[k]
        boxes, next_x = [], {-1: 0.0}
        for k, (_, _, _, parent) in enumerate(drawn):
            boxes.append((next_x[parent], float(leaves[k])))
            next_x[parent] += leaves[k]
            next_x[k] = boxes[-1][0]
    span = max(x + w for x, w in boxes)
    levels = max(d for _, d, _, _ in drawn) + 1
    width_in = 10.0
    fig, ax, own = axes(ax, (width_in, 0.42 * levels + 1.6))
    # The axes take ~90% of the width of a figure made here.
    axes_in = width_in * 0.9 if own else ax.get_window_extent().width / fig.figure.dpi
    for (node, depth, in_cast, _), (x, w) in zip(drawn, boxes, strict=True):
        box = Rectangle((x, depth), w, 0.92, edgecolor="white", linewidth=0.6)
        box.set_facecolor(CAST_COLOUR if in_cast else OP_COLOUR)
        box.set_gid(str(node.id))
        ax.add_patch(box)
        # About 0.065 inch per character at fontsize 7.
        if w / span * axes_in > 0.065 * len(node.name) + 0.05:
            ax.text(
                x + w / 2,
                depth + 0.46,
                node.name,
                ha="center",
                va="center",
                fontsize=SMALL,
                clip_on=True,
            )
    ax.set_xlim(0, span)
    ax.set_ylim(levels, 0)
    ax.set_yticks([d + 0.46 for d in range(levels)], [str(d) for d in range(levels)], fontsize=TEXT)
    ax.set_ylabel("depth")
    if scale == "time":
        ax.set_xlabel("time since the first op started (µs)")
    else:
        ax.set_xticks([])
        ax.set_xlabel("ops in call order (width: the ops without children below each op)")
    ax.legend(
        handles=[Patch(color=OP_COLOUR, label="op"), Patch(color=CAST_COLOUR, label="cast")],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=2,
        fontsize=TEXT,
        frameon=False,
    )
    if title:
        ax.set_title(title, fontsize=TITLE, loc="left")
    return fig


def cast_costs(report: CastReport, *, title: str = "", ax: Axes | None = None) -> Figure:
    """The time of the casts of ``report`` by cause (one bar each, largest first), split into
    down-casts and up-casts: kernel time when the trace has GPU events, else CPU op time."""
    found = list(report)
    clock = "gpu_us" if report.gpu else "cpu_us"
    total: dict[str, float] = {}
    for c in found:
        total[c.cause] = total.get(c.cause, 0.0) + getattr(c, clock)
    causes = sorted(total, key=lambda k: -total[k])
    fig, ax, _ = axes(ax, (8.0, 0.4 * len(causes) + 1.6))
    left = [0.0] * len(causes)
    labels = [k.replace("autograd::engine::evaluate_function: ", "backward: ") for k in causes]
    for direction, colour in (("down-cast", SERIES_COLOURS[0]), ("up-cast", SERIES_COLOURS[1])):
        widths = [
            sum(getattr(c, clock) for c in found if c.cause == k and c.direction == direction)
            for k in causes
        ]
        ax.barh(labels, widths, left=left, color=colour, label=direction)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_ylim(len(causes) - 0.5, -0.5)
    ax.tick_params(axis="y", labelsize=TEXT)
    ax.set_xlabel(f"cast time ({'GPU kernel' if report.gpu else 'CPU op'} µs)")
    if title:
        ax.set_title(title, fontsize=TITLE, loc="left")
    ax.legend(fontsize=TEXT, loc="lower right")
    return fig


def cast_time_by_module(
    reports: Mapping[str, CastReport], *, title: str = "", ax: Axes | None = None
) -> Figure:
    """The cast time of each report (a bar each, labelled by the mapping's keys) per module,
    largest first, then the casts fused into kernels per kind: kernel time where the trace
    has GPU events, else CPU time. Casts outside any module are ``(no module)``."""
    from mpguide.traces.casts import FUSED_KINDS, NO_MODULE

    values: dict[str, dict[str, float]] = {}
    for label, report in reports.items():
        clock = report.gpu_us if report.gpu else report.cpu_us
        for k, module in enumerate(report.modules):
            mine = float(clock[report.module == k].sum())
            if mine:
                values.setdefault(module or NO_MODULE, {})[label] = mine
        fused = report.fused
        for k, kind in enumerate(FUSED_KINDS):
            spent = float(fused.us[fused.kind == k].sum())
            if spent:
                values.setdefault(f"fused: {kind}", {})[label] = spent
    if not values:
        raise MPGuideError("no casts in these reports: nothing to draw")

    def first(group: str) -> tuple[bool, float]:
        return group.startswith("fused: "), -max(values[group].values())

    ordered = {g: values[g] for g in sorted(values, key=first)}
    units = "GPU kernel" if all(r.gpu for r in reports.values()) else "GPU kernel or CPU op"
    return bars(ordered, xlabel=f"cast time ({units} µs)", title=title, log=True, ax=ax)

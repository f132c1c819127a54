"""The your-model chapter: the per-module report's error, call by call, and the error budget of
a diff (what each layer inherits and what it adds itself)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from mpguide import MPGuideError
from mpguide.plots.style import (
    INK,
    LOST_COLOUR,
    SERIES_COLOURS,
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

    from mpguide.models.diff import Diff
    from mpguide.models.per_module import Report


def module_errors(
    reports: Mapping[str, Report], *, title: str = "", ax: Axes | None = None
) -> Figure:
    """The output error (``max |error| / mean |ref|``) of every module call, in the call order
    of the first report, one line per report (labelled by its key) on a log axis that is
    linear near zero. A call whose output holds an infinity or NaN has no error: it is marked
    with a red cross at the top instead, and the first module where one appears is named."""
    import math

    from matplotlib.lines import Line2D

    if not reports:
        raise MPGuideError("no reports to draw")
    for name, r in reports.items():
        if r.simulated:
            raise MPGuideError(f"{name!r} is simulated: it has no errors to draw")
    calls = next(iter(reports.values())).calls
    keys = [c.key for c in calls]
    by_key = {name: {c.key: c for c in r.calls} for name, r in reports.items()}

    def error(c):
        e = None if c is None or c.error is None or c.nonfinite else c.error.max_rel
        return e if e is not None and math.isfinite(e) else math.nan

    series = {name: [error(found.get(k)) for k in keys] for name, found in by_key.items()}
    positive = [e for ys in series.values() for e in ys if e > 0]
    top = max(positive, default=1.0) * 4
    fig, ax, own = axes(ax, (max(8.0, 0.2 * len(keys) + 2.5), 5.2))
    handles = []
    for (name, r), colour, marker in zip(reports.items(), SERIES_COLOURS, "os^vD", strict=False):
        (line,) = ax.plot(series[name], marker=marker, ms=4, lw=1, color=colour, label=name)
        line.set_gid(name)
        handles.append(line)
        bad = [i for i, k in enumerate(keys) if k in by_key[name] and by_key[name][k].nonfinite]
        if bad:
            (crosses,) = ax.plot(bad, [top] * len(bad), "x", color=LOST_COLOUR, ms=7, mew=1.5)
            crosses.set_gid(f"{name}: inf or NaN")
        origin = r.first_nonfinite
        if origin is not None and origin.key in keys:
            ax.annotate(
                f"{name}: first inf/NaN in {origin.label}",
                (keys.index(origin.key), top),
                xytext=(4, 8),
                textcoords="offset points",
                fontsize=TEXT,
                color=LOST_COLOUR,
            )
    if any(c.nonfinite for r in reports.values() for c in r.calls):
        handles.append(Line2D([], [], color=LOST_COLOUR, marker="x", ls="none", label="inf or NaN"))
    ax.set_yscale("symlog", linthresh=min(positive, default=1.0) / 2)
    ax.set_ylim(0, top * 6)
    ax.set_xticks(range(len(keys)), [c.label for c in calls], rotation=90, fontsize=SMALL)
    ax.set_xlim(-0.5, len(keys) - 0.5)
    value_axis(ax, "output max |error| / mean |float64 ref|")
    legend_below(fig, ax, own, handles, ncol=len(handles))
    heading(fig, ax, own, title)
    return fig


def error_budget(
    found: Diff, *, modules: Sequence[str] | None = None, title: str = "", ax: Axes | None = None
) -> Figure:
    """Where the error of each layer comes from, one stacked bar per module call, split as an
    op's error is (:class:`mpguide.models.diff.ModuleError`): below, the error it *inherited*
    (its inputs' error, carried through it: ``‖b − a‖ / ‖a‖``), on top the error it adds
    itself (*local*, ``‖t − b‖ / ‖a‖``), and a dot at its output's error, the *total*: since
    ``t − a = (t − b) + (b − a)`` the dot is never above the bar's top. A call that could not
    be re-run has no bar, only its dot and a cross at 0. ``modules``: the qualified names to
    draw (each call of each); default: the numbered children of the model's longest list of
    modules (``model.layers.0``, ...), else the model's children."""
    import re

    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    calls = list(found.modules)
    if modules is None:
        numbered = [m for m in calls if re.search(r"\.\d+$", m.name)]
        depths = sorted({m.depth for m in numbered})
        chosen = [m for m in numbered if depths and m.depth == depths[0]]
        chosen = chosen or [m for m in calls if m.depth == 1]
    else:
        unknown = [n for n in modules if n not in {m.name for m in calls}]
        if unknown:
            raise MPGuideError(f"no module {unknown[0]!r} ran in this diff")
        chosen = [m for m in calls if m.name in modules]
    if not chosen:
        raise MPGuideError("no module calls to draw")
    nan = float("nan")
    labels = [m.label for m in chosen]
    inherited = [nan if m.inherited is None else m.inherited for m in chosen]
    local = [nan if m.local is None else m.local for m in chosen]
    total = [nan if m.output is None else m.output for m in chosen]
    fig, ax, own = axes(ax, (max(6.0, 0.6 * len(chosen) + 3), 4.4))
    x = range(len(chosen))
    ax.bar(x, inherited, color=SERIES_COLOURS[0], width=0.6, gid="inherited")
    ax.bar(x, local, bottom=inherited, color=SERIES_COLOURS[1], width=0.6, gid="local")
    ax.plot(x, total, "o", color=INK, ms=5, gid="total")
    handles = [
        Patch(color=SERIES_COLOURS[0], label="inherited: received"),
        Patch(color=SERIES_COLOURS[1], label="local: added itself"),
        Line2D([], [], color=INK, marker="o", ls="none", label="total"),
    ]
    unsplit = [i for i, m in enumerate(chosen) if m.local is None]
    if unsplit:
        (crosses,) = ax.plot(unsplit, [0] * len(unsplit), "x", color=LOST_COLOUR, ms=7, mew=1.5)
        crosses.set_gid("not re-run")
        handles.append(Line2D([], [], color=LOST_COLOUR, marker="x", ls="none", label="not re-run"))
    ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=SMALL)
    value_axis(ax, "‖error‖ / ‖float64 ref‖")
    legend_below(fig, ax, own, handles, ncol=len(handles))
    heading(fig, ax, own, title)
    return fig

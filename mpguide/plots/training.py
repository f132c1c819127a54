"""The autograd and training chapters: master weights, loss scaling, optimizer precision,
recipes, layers with state, summed gradients and communication."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from mpguide import MPGuideError
from mpguide.plots.style import (
    DTYPE_COLOURS,
    GROUP_COLOURS,
    LOST_COLOUR,
    SERIES_COLOURS,
    SMALL,
    TEXT,
    TITLE,
    as_float64,
    axes,
    fig_title,
    grid,
    heading,
    legend_below,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from mpguide.training import distributed, grad_sums, loop, norm_layers
    from mpguide.training.master_weights import Curve


def training_curves(
    curves: Mapping[str, Curve], title: str = "", *, ax: Sequence[Axes] | None = None
) -> Figure:
    """The loss (log scale) and the share of updates the weights lost, per step, one line per
    :class:`~mpguide.training.master_weights.Curve`, labelled by its key. ``ax``: the two
    axes."""
    if len(curves) > len(GROUP_COLOURS):
        raise MPGuideError(f"at most {len(GROUP_COLOURS)} curves, got {len(curves)}")
    fig, (ax_loss, ax_lost), own = grid(ax, 1, 2, (9, 3.8))
    styles = ("-", "--", "-.", ":")
    for (label, c), colour, style in zip(curves.items(), GROUP_COLOURS, styles, strict=False):
        ax_loss.semilogy(c.losses, style, color=colour, label=label)
        ax_lost.plot(c.lost_share, style, color=colour, label=label)
    ax_loss.set(xlabel="step", ylabel="mean squared error", title="loss")
    ax_lost.set(xlabel="step", ylabel="share of updates lost", title="updates the weights lost")
    for a in (ax_loss, ax_lost):
        a.title.set_fontsize(TITLE)
        a.xaxis.label.set_fontsize(TEXT)
        a.yaxis.label.set_fontsize(TEXT)
        a.tick_params(labelsize=TEXT)
        a.spines[["top", "right"]].set_visible(False)
    legend_below(fig, ax_loss, own, ax_loss.get_lines(), ncol=len(curves))
    fig_title(fig, title)
    return fig


def magnitude_histogram(
    series: Mapping[str, Sequence[float]],
    marks: Mapping[str, float],
    *,
    title: str = "",
    ax: Axes | None = None,
) -> Figure:
    """A histogram of ``log2 |value|`` of the nonzero values of each series (one outline
    each, in one set of bins), with a dashed line at each mark, labelled with its name; the
    bins left of the smallest mark are shaded."""
    import numpy as np

    if not series or len(series) > len(SERIES_COLOURS):
        raise MPGuideError(f"need 1 to {len(SERIES_COLOURS)} series, got {len(series)}")
    logs = {}
    for label, values in series.items():
        mags = np.abs(as_float64(values))
        if not (mags > 0).any():
            raise MPGuideError(f"series {label!r} has no nonzero value")
        logs[label] = np.log2(mags[mags > 0])
    low = min(min(v.min() for v in logs.values()), *map(np.log2, marks.values()))
    high = max(max(v.max() for v in logs.values()), *map(np.log2, marks.values()))
    edges = np.arange(np.floor(low) - 1, np.ceil(high) + 2)
    fig, ax, _ = axes(ax, (8.0, 3.8))
    for (label, values), colour in zip(logs.items(), SERIES_COLOURS, strict=False):
        ax.hist(values, bins=edges, histtype="step", color=colour, linewidth=1.5, label=label)
    if marks:
        ax.axvspan(edges[0], np.log2(min(marks.values())), color=LOST_COLOUR, alpha=0.08)
    for name, value in marks.items():
        ax.axvline(np.log2(value), color=LOST_COLOUR, linestyle="--", linewidth=1)
        ax.text(
            np.log2(value),
            0.97,
            f" {name}",
            transform=ax.get_xaxis_transform(),
            rotation=90,
            va="top",
            ha="right",
            fontsize=TEXT,
            color=LOST_COLOUR,
        )
    ax.set_xlabel("log2 |value|")
    ax.set_ylabel("count")
    ax.legend(fontsize=TEXT, loc="upper left", frameon=False)
    if title:
        ax.set_title(title, fontsize=TITLE, loc="left")
    return fig


def scale_trace(run: loop.Run, *, title: str = "", ax: Axes | None = None) -> Figure:
    """The loss scale a GradScaler used at each step of a run (log2 axis), with the steps it
    skipped, whose scaled gradients held an inf or NaN, marked in red."""
    import numpy as np

    if not run.scales:
        raise MPGuideError(f"the run {run.name!r} had no GradScaler")
    steps = np.arange(len(run.scales))
    logs = np.log2(run.scales)
    fig, ax, own = axes(ax, (8.0, 3.4))
    ax.step(steps, logs, where="post", color=SERIES_COLOURS[0], label="loss scale")
    hit = [i for i, inf in enumerate(run.found_inf) if inf]
    ax.scatter(
        hit,
        logs[hit],
        marker="x",
        color=LOST_COLOUR,
        zorder=3,
        label=f"inf/NaN in the scaled gradients: step skipped ({len(hit)})",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("log2 of the loss scale")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=TEXT, loc="upper right", frameon=False)
    heading(fig, ax, own, title)
    return fig


def accumulation(
    histories: Mapping[str, Sequence[Sequence[float]]],
    *,
    title: str = "",
    ax: Axes | None = None,
) -> Figure:
    """The value of weights after each of a series of updates, one line per way of adding
    them (the mean over the weights), with the range from the lowest to the highest weight
    shaded where the weights differ."""
    import numpy as np

    if not histories or len(histories) > len(SERIES_COLOURS):
        raise MPGuideError(f"need 1 to {len(SERIES_COLOURS)} histories, got {len(histories)}")
    fig, ax, own = axes(ax, (8.0, 3.8))
    for (label, rows), colour in zip(histories.items(), SERIES_COLOURS, strict=False):
        values = as_float64(rows).reshape(len(rows), -1)
        steps = np.arange(len(values))
        ax.plot(steps, values.mean(axis=1), color=colour, label=label)
        if (values.min(axis=1) != values.max(axis=1)).any():
            ax.fill_between(
                steps, values.min(axis=1), values.max(axis=1), color=colour, alpha=0.2, lw=0
            )
    ax.set_xlabel("updates added")
    ax.set_ylabel("weight")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=TEXT, loc="upper left", frameon=False)
    heading(fig, ax, own, title)
    return fig


def training_runs(
    runs: loop.Runs,
    *,
    unchanged: bool = False,
    title: str = "",
    ax: Sequence[Axes] | None = None,
) -> Figure:
    """The held-out loss of each run against the step, and its difference from the first
    run's; with ``unchanged``, also the shares of weights and of ``exp_avg_sq`` entries with a
    nonzero gradient that each step left as they were. ``ax``: two axes, four with
    ``unchanged``."""
    if len(runs.runs) > len(SERIES_COLOURS):
        raise MPGuideError(f"at most {len(SERIES_COLOURS)} runs, got {len(runs.runs)}")
    rows = 2 if unchanged else 1
    fig, panels, own = grid(ax, rows, 2, (10, 3.4 * rows))
    first = dict(runs.runs[0].evals)
    styles = ("-", "--", "-.", ":", "-", "--")
    for r, colour, style in zip(runs.runs, SERIES_COLOURS, styles, strict=False):
        steps = [s for s, _ in r.evals]
        line = {"color": colour, "linestyle": style, "label": r.name}
        panels[0].plot(steps, [v for _, v in r.evals], **line)
        panels[1].plot(steps, [v - first[s] for s, v in r.evals], **line)
        if unchanged:
            panels[2].plot(r.weights_unchanged, **line)
            panels[3].plot(r.states_unchanged, **line)
    labels = [
        ("held-out loss", "cross-entropy"),
        (f"held-out loss minus {runs.runs[0].name}'s", "difference"),
        ("weights a step left unchanged", "share of weights with a gradient"),
        ("exp_avg_sq entries a step left unchanged", "share of entries with a gradient"),
    ]
    for a, (name, ylabel) in zip(panels, labels, strict=False):
        a.set_title(name, fontsize=TITLE)
        a.set_xlabel("step", fontsize=TEXT)
        a.set_ylabel(ylabel, fontsize=TEXT)
        a.tick_params(labelsize=TEXT)
        a.grid(True, alpha=0.3)
    legend_below(fig, panels[0], own, panels[0].get_lines(), ncol=min(len(runs.runs), 3))
    fig_title(fig, title)
    return fig


def running_means(
    result: norm_layers.RunningMeans, *, title: str = "", ax: Axes | None = None
) -> Figure:
    """The running mean a BatchNorm kept after each step, one line per buffer dtype coloured
    as that dtype, the mean it was fed dashed, and a dot where each line stopped moving."""
    from mpguide.core import dtypes

    fig, ax, own = axes(ax, (8.0, 3.8))
    for dt in result.buffers:
        values = result.trace(dt)
        colour = DTYPE_COLOURS.get(dtypes.name(dt), SERIES_COLOURS[-1])
        ax.plot(range(1, len(values) + 1), values, color=colour, label=f"{dtypes.name(dt)} buffers")
        settled = result.settled_at(dt)
        if settled is not None:
            ax.plot(settled + 1, values[settled], "o", color=colour)
            ax.annotate(
                f"stops {result.gap(dt):.3g} below",
                (settled + 1, values[settled]),
                textcoords="offset points",
                xytext=(4, -12),
                fontsize=TEXT,
                color=colour,
            )
    ax.axhline(result.mean, color="gray", linestyle="--", linewidth=1, label="mean of every batch")
    ax.set_xlabel("training step")
    ax.set_ylabel("running mean")
    ax.set_ylim(result.mean - 4 * max(map(result.gap, result.buffers)), result.mean * 1.01)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=TEXT, loc="lower right", frameon=False)
    heading(fig, ax, own, title)
    return fig


def sum_errors(sweep: grad_sums.Sweep, *, title: str = "", ax: Axes | None = None) -> Figure:
    """The error of a summed gradient against the count of contributions (log axis), one line
    per way of summing; the error axis is linear near zero, where exact sums sit."""
    if len(sweep.ways) > len(SERIES_COLOURS):
        raise MPGuideError(f"at most {len(SERIES_COLOURS)} ways, got {len(sweep.ways)}")
    fig, ax, own = axes(ax, (8.0, 3.8))
    markers = "os^vDx"
    for way, colour, marker in zip(sweep.ways, SERIES_COLOURS, markers, strict=False):
        ax.plot(sweep.counts, sweep.errors(way), marker=marker, color=colour, label=way)
    nonzero = [e for way in sweep.ways for e in sweep.errors(way) if e > 0]
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=min(nonzero, default=1.0) / 2)
    ax.set_xlabel(sweep.counted)
    ax.set_ylabel("max |error| / mean |float64 sum|")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=TEXT, loc="upper left", frameon=False)
    heading(fig, ax, own, title or sweep.what)
    return fig


def communication_costs(
    result: distributed.Communication, *, title: str = "", ax: Sequence[Axes] | None = None
) -> Figure:
    """Per setup of a :class:`~mpguide.training.distributed.Communication`: the bytes handed to the
    collectives in one step, split by dtype and coloured as the dtype (left), and the
    error communication added to the gradient at each loss scale (right, log axis, ``0``
    written where it added none). ``ax``: the two axes."""
    from matplotlib.patches import Patch

    from mpguide.core import dtypes

    setups = list(dict.fromkeys(r.setup for r in result.runs))
    scales = result.scales
    if len(scales) > len(SERIES_COLOURS):
        raise MPGuideError(f"at most {len(SERIES_COLOURS)} scales, got {len(scales)}")
    fig, (ax_bytes, ax_err), own = grid(ax, 1, 2, (10.0, 0.45 * len(setups) + 1.8), sharey=True)
    used = []
    for y, setup in enumerate(setups):
        left = 0
        run = result.get(setup, scales[0])
        for dt in run.comm_dtypes:
            width = sum(c.nbytes for c in run.collectives if c.dtype == dt)
            key = dtypes.name(dt)
            used.append(key)
            ax_bytes.barh(y, width, left=left, color=DTYPE_COLOURS.get(key, "#999999"))
            left += width
        ax_bytes.text(left, y, f" {left}", va="center", fontsize=TEXT)
    height = 0.8 / len(scales)
    nonzero = [r.comm_error.max_rel for r in result.runs if r.comm_error.max_rel > 0]
    floor = min(nonzero, default=1.0) / 10
    for s, (scale, colour) in enumerate(zip(scales, SERIES_COLOURS, strict=False)):
        ys = [y - 0.4 + height * (s + 0.5) for y in range(len(setups))]
        values = [result.get(setup, scale).comm_error.max_rel for setup in setups]
        drawn = ax_err.barh(
            ys,
            [max(v - floor, 0.0) for v in values],
            height=height * 0.9,
            left=floor,
            color=colour,
            label=f"loss x {scale:g}",
        )
        ax_err.bar_label(drawn, [f"{v:.2g}" for v in values], padding=3, fontsize=SMALL)
    ax_err.set_xscale("log")
    ax_err.margins(x=0.2)
    ax_bytes.set_yticks(range(len(setups)), setups, fontsize=TEXT)
    ax_bytes.set_ylim(len(setups) - 0.5, -0.5)
    if not own:  # the caller's axes may not share y
        ax_err.set_ylim(ax_bytes.get_ylim())
    ax_bytes.set_xlabel("bytes handed to collectives in one step")
    ax_bytes.margins(x=0.25)
    ax_err.set_xlabel("error communication added (max |error| / mean |ref|)")
    for a in (ax_bytes, ax_err):
        a.grid(True, axis="x", alpha=0.3)
        a.tick_params(labelsize=TEXT)
        a.xaxis.label.set_fontsize(TEXT)
    handles = [Patch(color=DTYPE_COLOURS[k], label=k) for k in DTYPE_COLOURS if k in used]
    ax_bytes.legend(handles=handles, fontsize=TEXT, loc="lower right", frameon=False)
    ax_err.legend(fontsize=TEXT, loc="lower right", frameon=False)
    fig_title(fig, title)
    return fig

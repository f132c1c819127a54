"""Figures in one style for every chapter: each takes a result object and returns the figure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mpguide import MPGuideError

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    from mpguide.autocast.policy import Devices
    from mpguide.compiled import backends
    from mpguide.compiled.graphs import Graphs
    from mpguide.core.switches import Effect
    from mpguide.core.table import Table
    from mpguide.models.inference import Result
    from mpguide.models.per_module import Report as ModuleReport
    from mpguide.precision.formats import Format
    from mpguide.precision.numerics import KSweep, MatmulErrors
    from mpguide.traces.calltree import Node
    from mpguide.traces.casts import CastReport
    from mpguide.training import distributed, grad_sums, loop, norm_layers
    from mpguide.training.autograd import DtypeLog
    from mpguide.training.master_weights import Curve

# One colour per autocast class, in the order of mpguide.autocast.policy.CLASSES.
CLASS_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#d9d9d9", "#c44e52", "#8172b2")


def policy_map(devices: Devices, only_differing: bool = False) -> Figure:
    """The autocast class of every op (columns) on every device (rows), coloured by class."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from mpguide.autocast.policy import CLASSES

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


# -- dtypes, as grids and strips --------------------------------------------------------------

# One colour per dtype, and per outcome that is not a dtype, in every dtype figure; the outcomes
# share their colour with the autocast class of the same meaning in CLASS_COLOURS.
DTYPE_COLOURS = {
    "float64": "#64b5cd",
    "float32": "#4c72b0",
    "bfloat16": "#dd8452",
    "float16": "#55a868",
    "error": "#c44e52",
    "needs hardware": "#8172b2",
    "none": "#d9d9d9",
    "other": "#f2f2f2",
}
_CONVERSION_EDGE = "#222222"


def dtype_key(value: Any) -> str:
    """The key of :data:`DTYPE_COLOURS` a value stands for: a dtype (``torch.bfloat16``,
    ``'bfloat16'``, ``'bf16[8, 4]'``), ``'error'`` (an error or ``'raised'``), ``'needs
    hardware'``, ``'none'`` (nothing, ``''``), or ``'other'``."""
    from mpguide.core import dtypes
    from mpguide.core.table import cell

    text = cell(value).strip()
    word = dtypes.canonical(text.split("[", 1)[0])
    if word in (*dtypes.FLOATS, "needs hardware", "none"):
        return word
    if not text or text == "-":
        return "none"
    if text.startswith(("error", "raise")):
        return "error"
    return "other"


def _short(key: str) -> str | None:
    """``bf16`` for the key ``bfloat16``, ``error`` for ``error``, else ``None``."""
    import torch

    from mpguide.core import dtypes

    return (
        dtypes.short(getattr(torch, key))
        if key in dtypes.FLOATS
        else "error"
        if key == "error"
        else None
    )


def _ink(key: str) -> str:
    """Text colour that reads on a cell of ``key``'s colour."""
    return (
        "white" if key in ("float32", "bfloat16", "float16", "error", "needs hardware") else "black"
    )


def _dtype_legend(fig: Figure, keys: Sequence[str], conversions: bool = False) -> None:
    from matplotlib.patches import Patch

    used = [k for k in DTYPE_COLOURS if k in keys and k != "other"]
    handles = [Patch(facecolor=DTYPE_COLOURS[k], label=k) for k in used]
    if conversions:
        handles.append(
            Patch(facecolor="white", edgecolor=_CONVERSION_EDGE, linewidth=2, label="conversion")
        )
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=min(len(handles), 4),
        fontsize=8,
        frameon=False,
    )


def _title(fig: Figure, text: str, fontsize: float = 9) -> Text | None:
    """A title over the whole figure, wrapped to its width (none for an empty ``text``)."""
    import textwrap

    if not text:
        return None
    chars = int(fig.get_figwidth() * 72 / (0.6 * fontsize))
    return fig.suptitle(textwrap.fill(text, chars), fontsize=fontsize)


def dtype_grid(table: Table, columns: Sequence[str] | None = None, title: str = "") -> Figure:
    """The cells of ``columns`` (default: every column but the first) of each row of ``table``,
    labelled by the row's first cell, each coloured by the dtype or outcome it names
    (:func:`dtype_key`) and showing it (a dtype by its short name, ``bf16``)."""
    import textwrap

    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from mpguide.core.table import cell

    columns = list(columns or table.columns[1:])
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise MPGuideError(f"no column {missing[0]!r}; the table has {', '.join(table.columns)}")
    index = [table.columns.index(c) for c in columns]
    labels = [cell(r[0]) for r in table.rows]
    keys = [[dtype_key(r[i]) for i in index] for r in table.rows]
    label_in = 0.065 * max(map(len, labels), default=1) + 0.3
    fig, ax = plt.subplots(
        figsize=(max(4.5, label_in + 1.05 * len(columns) + 0.3), 0.3 * len(labels) + 1.9),
        layout="constrained",
    )
    for y, (row, row_keys) in enumerate(zip(table.rows, keys, strict=True)):
        for x, (i, key) in enumerate(zip(index, row_keys, strict=True)):
            ax.add_patch(
                Rectangle((x, y), 1, 1, facecolor=DTYPE_COLOURS[key], edgecolor="white", lw=1.5)
            )
            text = _short(key) or textwrap.shorten(cell(row[i]), 18, placeholder="…")
            ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=8, color=_ink(key))
    ax.set_xlim(0, len(columns))
    ax.set_ylim(len(labels), 0)
    ax.set_xticks([x + 0.5 for x in range(len(columns))], [textwrap.fill(c, 16) for c in columns])
    ax.set_yticks([y + 0.5 for y in range(len(labels))], labels)
    ax.xaxis.tick_top()
    ax.tick_params(length=0, labelsize=8)
    ax.spines[:].set_visible(False)
    _title(fig, title)
    _dtype_legend(fig, [k for row in keys for k in row])
    return fig


# One box of a strip: its label, its dtype (or outcome), and whether it is a conversion.
Box = tuple[str, Any, bool]


def dtype_strips(strips: Mapping[str, Sequence[Box]], title: str = "") -> Figure:
    """One strip per entry: a box per step (an op, a stage), coloured by its dtype
    (:func:`dtype_key`), labelled underneath, and outlined where it is a conversion."""
    import textwrap

    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from mpguide.core import dtypes

    # At least 12 slots, so that a short strip keeps small boxes; narrow, so that the labels
    # stay legible when a phone scales the figure down.
    n = max(12, *(len(boxes) for boxes in strips.values()))
    width = 0.32 * n + 0.6
    fig, axes = plt.subplots(
        len(strips), 1, figsize=(width, 2.0 * len(strips)), layout="constrained", squeeze=False
    )
    keys = []
    for ax, (name, boxes) in zip(axes[:, 0], strips.items(), strict=True):
        for x, (_, dtype, conversion) in enumerate(boxes):
            key = dtype_key(dtype)
            keys.append(key)
            ax.add_patch(
                Rectangle(
                    (x + 0.06, 0),
                    0.88,
                    1,
                    facecolor=DTYPE_COLOURS[key],
                    edgecolor=_CONVERSION_EDGE if conversion else "none",
                    lw=2.2 if conversion else 0,
                )
            )
            if key in dtypes.FLOATS:
                ax.text(
                    x + 0.5,
                    0.5,
                    _short(key),
                    ha="center",
                    va="center",
                    fontsize=6.5,
                    rotation=90,
                    color=_ink(key),
                )
        ax.set_xlim(0, n)
        ax.set_ylim(0, 1)
        ax.set_xticks([x + 0.5 for x in range(len(boxes))], [b[0] for b in boxes], rotation=90)
        ax.set_yticks([])
        ax.tick_params(length=0, labelsize=7)
        ax.spines[:].set_visible(False)
        ax.set_title(textwrap.fill(name, int(fig.get_figwidth() * 16)), fontsize=8, loc="left")
    suptitle = _title(fig, title)
    _dtype_legend(fig, keys, conversions=True)
    # Square boxes: the height is what the labels, titles and legend measure, plus the boxes;
    # every strip gets the room of the one with the longest label.
    renderer = fig.canvas.get_renderer()

    def inches(*texts):
        return sum(t.get_window_extent(renderer).height for t in texts) / fig.dpi

    labels = [t for ax in axes[:, 0] for t in ax.get_xticklabels()]
    strip = max(map(inches, labels), default=0) + inches(axes[0, 0].title) + (width - 0.3) / n
    heading = inches(fig.legends[0], *([suptitle] if suptitle else []))
    fig.set_figheight(heading + len(strips) * (strip + 0.25) + 0.3)
    return fig


def _op_label(op: str) -> str:
    return op.removeprefix("aten.").removeprefix("prims.").removesuffix(".default")


def graph_strips(
    *captures: Graphs, which: str | Sequence[str] = "forward", title: str = ""
) -> Figure:
    """The dtype flow of captured graphs: one strip per capture and graph (``which``: forward,
    backward or both; a capture without that graph is left out), a box per op node coloured by
    the dtype it returns, conversions outlined (those :meth:`Graphs.flow` calls conversions)."""
    import torch

    def first_dtype(node):
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        return next((v.dtype for v in vals if isinstance(v, torch.Tensor)), None)

    whiches = (which,) if isinstance(which, str) else tuple(which)
    strips = {}
    for g in captures:
        for w in whiches:
            if w not in g.graphs():
                continue
            converted = {r["node"] for r in g.flow(w).records() if r["change"] == "conversion"}
            strips[f"{g.label}: {w}"] = [
                (_op_label(str(n.target)), first_dtype(n), n.name in converted)
                for n in g.graphs()[w].graph.nodes
                if n.op == "call_function"
            ]
    return dtype_strips(strips, title)


def log_strips(log: DtypeLog, phases: Sequence[str] | None = None, title: str = "") -> Figure:
    """The ops a :class:`~mpguide.training.autograd.DtypeLog` saw, one strip per phase (default: every
    phase, in order), a box per op coloured by its output dtype, casts outlined; a backward op
    that produces a parameter's gradient names the parameter."""
    strips = {
        phase: [
            (
                _op_label(r.op) + (f" ({r.param})" if r.param else ""),
                r.outputs[0].dtype if r.outputs else None,
                r.is_cast,
            )
            for r in log.select(phase)
        ]
        for phase in (phases or log.phases())
    }
    return dtype_strips(strips, title)


# -- backends -----------------------------------------------------------------------------------

# One colour per group of bars, in order.
GROUP_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#8172b2")


def backend_bars(
    values: Mapping[str, Mapping[str, float | None]],
    ylabel: str,
    title: str = "",
    log: bool = True,
) -> Figure:
    """Grouped bars: one group per backend (in order of first appearance), one bar per entry
    of ``values`` (``{group: {backend: value}}``), each labelled with its value. ``None`` is a
    backend that raised, marked ``raised``; on a log scale a zero is marked ``0``."""

    import matplotlib.pyplot as plt

    if len(values) > len(GROUP_COLOURS):
        raise MPGuideError(f"at most {len(GROUP_COLOURS)} groups of bars, got {len(values)}")
    backends = list(dict.fromkeys(b for v in values.values() for b in v))
    positive = [x for v in values.values() for x in v.values() if x]
    floor = min(positive, default=1.0) / 10 if log else 0.0
    width = 0.8 / len(values)
    fig, ax = plt.subplots(
        figsize=(max(4.5, 1.25 * len(backends) + 1.0), 3.6), layout="constrained"
    )
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
                fontsize=7,
                color=DTYPE_COLOURS["error"] if v is None else "black",
            )
    if log:
        ax.set_yscale("log")
        ax.set_ylim(bottom=floor, top=max(positive, default=1.0) * 8)
    ax.set_xticks(range(len(backends)), [b.replace("+", "+\n") for b in backends], fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    ax.spines[["top", "right"]].set_visible(False)
    if len(values) > 1:
        fig.legend(loc="outside lower center", ncol=len(values), fontsize=8, frameon=False)
    _title(fig, title)
    return fig


# The statistics of an Outcome a bar chart can show, with the names Comparison.table gives them.
METRICS = {"max_abs": "max |error|", "max_rel": "max |error| / mean |ref|"}


def comparison_bars(
    comparisons: Mapping[str, backends.Comparison], metric: str = "max_abs", title: str = ""
) -> Figure:
    """:func:`backend_bars` of one statistic (a key of :data:`METRICS`) of each backend's
    outcome, one group per :class:`~mpguide.compiled.backends.Comparison`; a backend that raised is
    marked ``raised``. The title ends with the machine the first comparison ran on."""
    if metric not in METRICS:
        raise MPGuideError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    values = {
        name: {o.backend: getattr(o, metric) for o in c.outcomes} for name, c in comparisons.items()
    }
    machine = next(iter(comparisons.values())).machine.caption() if comparisons else ""
    return backend_bars(values, METRICS[metric], ", ".join(t for t in (title, machine) if t))


# -- training -----------------------------------------------------------------------------------


def training_curves(curves: Mapping[str, Curve], title: str = "") -> Figure:
    """The loss (log scale) and the share of updates the weights lost, per step, one line per
    :class:`~mpguide.training.master_weights.Curve`, labelled by its key."""
    import matplotlib.pyplot as plt

    if len(curves) > len(GROUP_COLOURS):
        raise MPGuideError(f"at most {len(GROUP_COLOURS)} curves, got {len(curves)}")
    fig, (ax_loss, ax_lost) = plt.subplots(1, 2, figsize=(9, 3.8), layout="constrained")
    styles = ("-", "--", "-.", ":")
    for (label, c), colour, style in zip(curves.items(), GROUP_COLOURS, styles, strict=False):
        ax_loss.semilogy(c.losses, style, color=colour, label=label)
        ax_lost.plot(c.lost_share, style, color=colour, label=label)
    ax_loss.set(xlabel="step", ylabel="mean squared error", title="loss")
    ax_lost.set(xlabel="step", ylabel="share of updates lost", title="updates the weights lost")
    for ax in (ax_loss, ax_lost):
        ax.title.set_fontsize(9)
        ax.xaxis.label.set_fontsize(8)
        ax.yaxis.label.set_fontsize(8)
        ax.tick_params(labelsize=8)
        ax.spines[["top", "right"]].set_visible(False)
    fig.legend(
        handles=ax_loss.get_lines(),
        loc="outside lower center",
        ncol=len(curves),
        fontsize=8,
        frameon=False,
    )
    _title(fig, title)
    return fig


# Figures of the numerics, inference and profiler chapters. One palette: a value that is lost
# or wrong is red, a cast is orange, an op is pale blue.
FIELD_COLOURS = {"sign": "#c44e52", "exponent": "#4c72b0", "mantissa": "#55a868"}
SERIES_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#8172b2", "#c44e52", "#937860")
CAST_COLOUR, OP_COLOUR, LOST_COLOUR, SAME_COLOUR = "#dd8452", "#c6d4e8", "#c44e52", "#d9d9d9"


def bit_layout(formats: Sequence[Format]) -> Figure:
    """One row of boxes per format, one box per bit: sign, exponent and mantissa."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    widest = max(f.bits for f in formats)
    fig, ax = plt.subplots(figsize=(9.0, 0.42 * len(formats) + 1.3), layout="constrained")
    for row, fmt in enumerate(formats):
        fields = (
            ("sign", fmt.sign_bits),
            ("exponent", fmt.exponent_bits),
            ("mantissa", fmt.mantissa_bits),
        )
        x = 0
        for field, n in fields:
            for _ in range(n):
                box = Rectangle((x, row - 0.35), 1, 0.7, edgecolor="white", linewidth=0.5)
                box.set_facecolor(FIELD_COLOURS[field])
                box.set_gid(field)
                ax.add_patch(box)
                x += 1
        parts = f"{fmt.sign_bits}+{fmt.exponent_bits}+{fmt.mantissa_bits}"
        text = f"{parts} bits, max {fmt.max:.2g}, eps {fmt.eps:.2g}"
        ax.text(x + 0.8, row, text, va="center", fontsize=8)
    ax.set_xlim(0, widest + 26)
    ax.set_ylim(len(formats) - 0.5, -0.5)
    ax.set_yticks(range(len(formats)), [f.name for f in formats], fontsize=9)
    ax.set_xticks([])
    ax.spines[["top", "right", "bottom"]].set_visible(False)
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in FIELD_COLOURS.items()],
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=3,
        fontsize=9,
        frameon=False,
    )
    return fig


def bars(
    values: Mapping[str, Mapping[str, float]],
    *,
    xlabel: str,
    title: str = "",
    log: bool = False,
    fmt: str = "{:.3g}",
) -> Figure:
    """Horizontal bars: one group per outer key (top to bottom), one bar per inner key, each
    labelled with its value; an inner key has the same colour in every group."""
    import matplotlib.pyplot as plt

    series = list(dict.fromkeys(k for inner in values.values() for k in inner))
    groups = list(values)
    height = 0.8 / len(series)
    fig, ax = plt.subplots(
        figsize=(8.0, 0.28 * sum(map(len, values.values())) + 0.2 * len(groups) + 1.5),
        layout="constrained",
    )
    for s, (name, colour) in enumerate(zip(series, SERIES_COLOURS, strict=False)):
        mine = [g for g in groups if name in values[g]]
        ys = [groups.index(g) - 0.4 + height * (s + 0.5) for g in mine]
        widths = [values[g][name] for g in mine]
        drawn = ax.barh(ys, widths, height=height * 0.9, color=colour, label=name)
        ax.bar_label(drawn, [fmt.format(w) for w in widths], padding=3, fontsize=8)
    ax.set_yticks(range(len(groups)), groups, fontsize=9)
    ax.set_ylim(len(groups) - 0.5, -0.5)
    if log:
        ax.set_xscale("log")
        ax.margins(x=0.25)
    else:
        ax.set_xlim(0, max(w for inner in values.values() for w in inner.values()) * 1.22)
    ax.set_xlabel(xlabel)
    ax.grid(True, axis="x", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    if len(series) > 1:
        ax.legend(
            fontsize=8,
            loc="lower center",
            bbox_to_anchor=(0.5, 1.0 if not title else 1.06),
            ncol=min(len(series), 3),
            frameon=False,
        )
    return fig


def matmul_error_bars(result: MatmulErrors) -> Figure:
    """Max error over mean ``|ref|`` of each mode (a group, labelled with how it ran) at each
    shape (a bar), on a log axis."""
    values: dict[str, dict[str, float]] = {}
    for r in result.rows:
        label = f"{r.mode} ({r.how.split(':')[0]})"
        values.setdefault(label, {})[" x ".join(map(str, r.shape))] = r.stats.max_rel
    return bars(values, xlabel="max |error| / mean |float64 result| (log scale)", log=True)


def switch_effects(effects: Sequence[Effect]) -> Figure:
    """Each setting (rows) against each probe (columns): grey where the result is
    bit-identical to IEEE fp32, orange and labelled with the largest relative difference
    where it changed."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    probes = [name for name, _ in effects[0].differences]
    fig, ax = plt.subplots(figsize=(8.0, 0.5 * len(effects) + 1.4), layout="constrained")
    for row, e in enumerate(effects):
        for col, (probe, diff) in enumerate(e.differences):
            cell = Rectangle((col, row), 1, 1, edgecolor="white", linewidth=2)
            cell.set_facecolor(CAST_COLOUR if diff > 0 else SAME_COLOUR)
            cell.set_gid(probe)
            ax.add_patch(cell)
            text = f"differs by {diff:.2g}" if diff > 0 else "bit-identical"
            ax.text(col + 0.5, row + 0.5, text, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(probes))
    ax.set_ylim(len(effects), 0)
    ax.set_xticks([c + 0.5 for c in range(len(probes))], probes, fontsize=9)
    ax.xaxis.tick_top()
    ax.set_yticks([r + 0.5 for r in range(len(effects))], [e.call for e in effects], fontsize=8)
    ax.tick_params(length=0)
    ax.spines[:].set_visible(False)
    ax.legend(
        handles=[
            Patch(color=SAME_COLOUR, label="bit-identical to IEEE fp32"),
            Patch(color=CAST_COLOUR, label="changed: max relative difference"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=2,
        fontsize=8,
        frameon=False,
    )
    return fig


def overflow_histogram(values: Sequence[float], limit: float, *, label: str) -> Figure:
    """A histogram of ``|values|`` with a format's largest finite value marked; the bins past
    it (values the format turns into infinity) are red."""
    import matplotlib.pyplot as plt
    import numpy as np

    mags = np.abs(np.asarray(values, dtype=float))
    top = max(mags.max(), limit) * 1.05
    edges = np.union1d(np.linspace(0, top, 31), [limit])
    fig, ax = plt.subplots(figsize=(8.0, 3.8), layout="constrained")
    _, _, patches = ax.hist(mags, bins=edges, color=OP_COLOUR, edgecolor="#4c72b0")
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
        fontsize=8,
        color=LOST_COLOUR,
    )
    ax.set_xlabel(label)
    ax.set_ylabel("count")
    return fig


def icicle(
    roots: Node | Sequence[Node],
    report: CastReport | None = None,
    *,
    scale: str = "time",
    title: str = "",
) -> Figure:
    """A call tree as an icicle chart: one rectangle per CPU op, one row per depth below
    ``roots``, each op under its caller; the casts of ``report`` and the ops inside them are
    orange. ``scale="time"`` draws each op from its start to its end (µs);
    ``scale="ops"`` gives each op without children one unit of width, so that the shape of
    the tree does not depend on a noisy clock. Names are written where they fit."""
    import matplotlib.pyplot as plt
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
    fig, ax = plt.subplots(figsize=(width_in, 0.42 * levels + 1.6), layout="constrained")
    for (node, depth, in_cast, _), (x, w) in zip(drawn, boxes, strict=True):
        box = Rectangle((x, depth), w, 0.92, edgecolor="white", linewidth=0.6)
        box.set_facecolor(CAST_COLOUR if in_cast else OP_COLOUR)
        box.set_gid(str(node.id))
        ax.add_patch(box)
        # About 0.065 inch per character at fontsize 7; the axes take ~90% of the width.
        if w / span * width_in * 0.9 > 0.065 * len(node.name) + 0.05:
            ax.text(
                x + w / 2,
                depth + 0.46,
                node.name,
                ha="center",
                va="center",
                fontsize=7,
                clip_on=True,
            )
    ax.set_xlim(0, span)
    ax.set_ylim(levels, 0)
    ax.set_yticks([d + 0.46 for d in range(levels)], [str(d) for d in range(levels)], fontsize=8)
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
        fontsize=8,
        frameon=False,
    )
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    return fig


def k_sweep(sweep: KSweep) -> Figure:
    """Error against the reduction length ``K`` on log-log axes, one curve per format and
    accumulation: RMS error on the left, max error over mean ``|result|`` on the right, each
    with a dotted ``sqrt(K)`` line. TF32 is drawn hollow, so that fp16 shows through it."""
    import matplotlib.pyplot as plt

    fig, (ax_abs, ax_rel) = plt.subplots(1, 2, figsize=(11, 5.5), layout="constrained")
    markers = {"float32": "o", "tf32": "D", "bfloat16": "s", "float16": "^"}
    ks: list[int] = []
    for fmt, acc in sweep.curves():
        ks, stats = sweep.series(fmt, acc)
        style = {
            "linestyle": "-" if acc == "fp32" else "--",
            "marker": markers.get(fmt, "x"),
            "markersize": 9 if fmt == "tf32" else 6,
            "markerfacecolor": "none" if fmt == "tf32" else None,
            "label": f"{fmt} inputs, {acc} accumulation",
        }
        ax_abs.loglog(ks, [s.rms for s in stats], **style)
        ax_rel.loglog(ks, [s.max_rel for s in stats], **style)
    first = {curve: sweep.series(*curve)[1][0] for curve in sweep.curves()}
    anchors = (
        (ax_abs, 10 * first["float32", "fp32"].rms),
        (ax_rel, max(s.max_rel for s in first.values())),
    )
    for ax, anchor in anchors:
        growth = [anchor * (k / ks[0]) ** 0.5 for k in ks]
        ax.loglog(ks, growth, ":", color="gray", label="sqrt(K) growth" if ax is ax_abs else None)
        ax.set_xlabel("reduction length K")
        ax.grid(True, which="major", alpha=0.3)
    ax_abs.set_ylabel("RMS error")
    ax_rel.set_ylabel("max |error| / mean |result|")
    fig.legend(*ax_abs.get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=9)
    fig.suptitle(sweep.caption, fontsize=10)
    return fig


def latency_error(runs: Sequence[Sequence[Result]], *, title: str = "") -> Figure:
    """One point per served variant: its median latency, with a bar from the first to the
    third quartile, against the largest error of its output; each run of variants (timed
    together) has its own marker. The error axis is linear near zero, where fp32 sits."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.0, 4.8), layout="constrained")
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
        ax.set_title(title, fontsize=9, loc="left")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    return fig


def cast_costs(report: CastReport, *, title: str = "") -> Figure:
    """The time of the casts of ``report`` by cause (one bar each, largest first), split into
    down-casts and up-casts: kernel time when the trace has GPU events, else CPU op time."""
    import matplotlib.pyplot as plt

    found = list(report)
    clock = "gpu_us" if report.gpu else "cpu_us"
    total: dict[str, float] = {}
    for c in found:
        total[c.cause] = total.get(c.cause, 0.0) + getattr(c, clock)
    causes = sorted(total, key=lambda k: -total[k])
    fig, ax = plt.subplots(figsize=(8.0, 0.4 * len(causes) + 1.6), layout="constrained")
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
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlabel(f"cast time ({'GPU kernel' if report.gpu else 'CPU op'} µs)")
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    ax.legend(fontsize=8, loc="lower right")
    return fig


# --- Training chapter: loss scaling, optimizers, recipes ---


def magnitude_histogram(
    series: Mapping[str, Sequence[float]], marks: Mapping[str, float], *, title: str = ""
) -> Figure:
    """A histogram of ``log2 |value|`` of the nonzero values of each series (one outline
    each, in one set of bins), with a dashed line at each mark, labelled with its name; the
    bins left of the smallest mark are shaded."""
    import matplotlib.pyplot as plt
    import numpy as np

    if not series or len(series) > len(SERIES_COLOURS):
        raise MPGuideError(f"need 1 to {len(SERIES_COLOURS)} series, got {len(series)}")
    logs = {}
    for label, values in series.items():
        mags = np.abs(np.asarray(values, dtype=float))
        if not (mags > 0).any():
            raise MPGuideError(f"series {label!r} has no nonzero value")
        logs[label] = np.log2(mags[mags > 0])
    low = min(min(v.min() for v in logs.values()), *map(np.log2, marks.values()))
    high = max(max(v.max() for v in logs.values()), *map(np.log2, marks.values()))
    edges = np.arange(np.floor(low) - 1, np.ceil(high) + 2)
    fig, ax = plt.subplots(figsize=(8.0, 3.8), layout="constrained")
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
            fontsize=8,
            color=LOST_COLOUR,
        )
    ax.set_xlabel("log2 |value|")
    ax.set_ylabel("count")
    ax.legend(fontsize=8, loc="upper left", frameon=False)
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    return fig


def scale_trace(run: loop.Run, *, title: str = "") -> Figure:
    """The loss scale a GradScaler used at each step of a run (log2 axis), with the steps it
    skipped, whose scaled gradients held an inf or NaN, marked in red."""
    import matplotlib.pyplot as plt
    import numpy as np

    if not run.scales:
        raise MPGuideError(f"the run {run.name!r} had no GradScaler")
    steps = np.arange(len(run.scales))
    logs = np.log2(run.scales)
    fig, ax = plt.subplots(figsize=(8.0, 3.4), layout="constrained")
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
    ax.legend(fontsize=8, loc="upper right", frameon=False)
    _title(fig, title)
    return fig


def accumulation(histories: Mapping[str, Sequence[Sequence[float]]], *, title: str = "") -> Figure:
    """The value of weights after each of a series of updates, one line per way of adding
    them (the mean over the weights), with the range from the lowest to the highest weight
    shaded where the weights differ."""
    import matplotlib.pyplot as plt
    import numpy as np

    if not histories or len(histories) > len(SERIES_COLOURS):
        raise MPGuideError(f"need 1 to {len(SERIES_COLOURS)} histories, got {len(histories)}")
    fig, ax = plt.subplots(figsize=(8.0, 3.8), layout="constrained")
    for (label, rows), colour in zip(histories.items(), SERIES_COLOURS, strict=False):
        values = np.asarray(rows, dtype=float).reshape(len(rows), -1)
        steps = np.arange(len(values))
        ax.plot(steps, values.mean(axis=1), color=colour, label=label)
        if (values.min(axis=1) != values.max(axis=1)).any():
            ax.fill_between(
                steps, values.min(axis=1), values.max(axis=1), color=colour, alpha=0.2, lw=0
            )
    ax.set_xlabel("updates added")
    ax.set_ylabel("weight")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", frameon=False)
    _title(fig, title)
    return fig


def training_runs(runs: loop.Runs, *, unchanged: bool = False, title: str = "") -> Figure:
    """The held-out loss of each run against the step, and its difference from the first
    run's; with ``unchanged``, also the shares of weights and of ``exp_avg_sq`` entries with a
    nonzero gradient that each step left as they were."""
    import matplotlib.pyplot as plt

    if len(runs.runs) > len(SERIES_COLOURS):
        raise MPGuideError(f"at most {len(SERIES_COLOURS)} runs, got {len(runs.runs)}")
    rows = 2 if unchanged else 1
    fig, axes = plt.subplots(rows, 2, figsize=(10, 3.4 * rows), layout="constrained")
    axes = axes.flatten()
    first = dict(runs.runs[0].evals)
    styles = ("-", "--", "-.", ":", "-", "--")
    for r, colour, style in zip(runs.runs, SERIES_COLOURS, styles, strict=False):
        steps = [s for s, _ in r.evals]
        line = {"color": colour, "linestyle": style, "label": r.name}
        axes[0].plot(steps, [v for _, v in r.evals], **line)
        axes[1].plot(steps, [v - first[s] for s, v in r.evals], **line)
        if unchanged:
            axes[2].plot(r.weights_unchanged, **line)
            axes[3].plot(r.states_unchanged, **line)
    labels = [
        ("held-out loss", "cross-entropy"),
        (f"held-out loss minus {runs.runs[0].name}'s", "difference"),
        ("weights a step left unchanged", "share of weights with a gradient"),
        ("exp_avg_sq entries a step left unchanged", "share of entries with a gradient"),
    ]
    for ax, (name, ylabel) in zip(axes, labels, strict=False):
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(True, alpha=0.3)
    fig.legend(
        handles=axes[0].get_lines(),
        loc="outside lower center",
        ncol=min(len(runs.runs), 3),
        fontsize=8,
        frameon=False,
    )
    _title(fig, title)
    return fig


# --- Training chapter: layers with state, recompute, communication ---


def running_means(result: norm_layers.RunningMeans, *, title: str = "") -> Figure:
    """The running mean a BatchNorm kept after each step, one line per buffer dtype coloured
    as that dtype, the mean it was fed dashed, and a dot where each line stopped moving."""
    import matplotlib.pyplot as plt

    from mpguide.core import dtypes

    fig, ax = plt.subplots(figsize=(8.0, 3.8), layout="constrained")
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
                fontsize=8,
                color=colour,
            )
    ax.axhline(result.mean, color="gray", linestyle="--", linewidth=1, label="mean of every batch")
    ax.set_xlabel("training step")
    ax.set_ylabel("running mean")
    ax.set_ylim(result.mean - 4 * max(map(result.gap, result.buffers)), result.mean * 1.01)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right", frameon=False)
    _title(fig, title)
    return fig


def sum_errors(sweep: grad_sums.Sweep, *, title: str = "") -> Figure:
    """The error of a summed gradient against the count of contributions (log axis), one line
    per way of summing; the error axis is linear near zero, where exact sums sit."""
    import matplotlib.pyplot as plt

    if len(sweep.ways) > len(SERIES_COLOURS):
        raise MPGuideError(f"at most {len(SERIES_COLOURS)} ways, got {len(sweep.ways)}")
    fig, ax = plt.subplots(figsize=(8.0, 3.8), layout="constrained")
    markers = "os^vDx"
    for way, colour, marker in zip(sweep.ways, SERIES_COLOURS, markers, strict=False):
        ax.plot(sweep.counts, sweep.errors(way), marker=marker, color=colour, label=way)
    nonzero = [e for way in sweep.ways for e in sweep.errors(way) if e > 0]
    ax.set_xscale("log", base=2)
    ax.set_yscale("symlog", linthresh=min(nonzero, default=1.0) / 2)
    ax.set_xlabel(sweep.counted)
    ax.set_ylabel("max |error| / mean |float64 sum|")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", frameon=False)
    _title(fig, title or sweep.what)
    return fig


def communication_costs(result: distributed.Communication, *, title: str = "") -> Figure:
    """Per setup of a :class:`~mpguide.training.distributed.Communication`: the bytes handed to the
    collectives in one step, split by dtype and coloured as the dtype (left), and the
    error communication added to the gradient at each loss scale (right, log axis, ``0``
    written where it added none)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from mpguide.core import dtypes

    setups = list(dict.fromkeys(r.setup for r in result.runs))
    scales = result.scales
    if len(scales) > len(SERIES_COLOURS):
        raise MPGuideError(f"at most {len(SERIES_COLOURS)} scales, got {len(scales)}")
    fig, (ax_bytes, ax_err) = plt.subplots(
        1, 2, figsize=(10.0, 0.45 * len(setups) + 1.8), layout="constrained", sharey=True
    )
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
        ax_bytes.text(left, y, f" {left}", va="center", fontsize=8)
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
        ax_err.bar_label(drawn, [f"{v:.2g}" for v in values], padding=3, fontsize=7)
    ax_err.set_xscale("log")
    ax_err.margins(x=0.2)
    ax_bytes.set_yticks(range(len(setups)), setups, fontsize=8)
    ax_bytes.set_ylim(len(setups) - 0.5, -0.5)
    ax_bytes.set_xlabel("bytes handed to collectives in one step")
    ax_bytes.margins(x=0.25)
    ax_err.set_xlabel("error communication added (max |error| / mean |ref|)")
    for ax in (ax_bytes, ax_err):
        ax.grid(True, axis="x", alpha=0.3)
        ax.tick_params(labelsize=8)
        ax.xaxis.label.set_fontsize(8)
    handles = [Patch(color=DTYPE_COLOURS[k], label=k) for k in DTYPE_COLOURS if k in used]
    ax_bytes.legend(handles=handles, fontsize=8, loc="lower right", frameon=False)
    ax_err.legend(fontsize=8, loc="lower right", frameon=False)
    _title(fig, title)
    return fig


# --- Your model: the per-module report ---


def module_errors(reports: Mapping[str, ModuleReport], *, title: str = "") -> Figure:
    """The output error (``max |error| / mean |ref|``) of every module call, in the call order
    of the first report, one line per report (labelled by its key) on a log axis that is
    linear near zero. A call whose output holds an infinity or NaN has no error: it is marked
    with a red cross at the top instead, and the first module where one appears is named."""
    import math

    import matplotlib.pyplot as plt
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
    fig, ax = plt.subplots(figsize=(max(8.0, 0.2 * len(keys) + 2.5), 5.2), layout="constrained")
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
                fontsize=8,
                color=LOST_COLOUR,
            )
    if any(c.nonfinite for r in reports.values() for c in r.calls):
        handles.append(Line2D([], [], color=LOST_COLOUR, marker="x", ls="none", label="inf or NaN"))
    ax.set_yscale("symlog", linthresh=min(positive, default=1.0) / 2)
    ax.set_ylim(0, top * 6)
    ax.set_xticks(range(len(keys)), [c.label for c in calls], rotation=90, fontsize=7)
    ax.set_xlim(-0.5, len(keys) - 0.5)
    ax.set_ylabel("output max |error| / mean |float64 ref|", fontsize=8)
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)
    fig.legend(
        handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False
    )
    _title(fig, title)
    return fig


# --- Real traces: casts by module, fused casts, ranks ---


def cast_time_by_module(reports: Mapping[str, CastReport], *, title: str = "") -> Figure:
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
    return bars(ordered, xlabel=f"cast time ({units} µs)", title=title, log=True)

"""Dtypes as grids and strips, for every chapter: a table's dtype cells, the dtype flow of
captured graphs and of an autograd log."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mpguide import MPGuideError
from mpguide.plots.style import (
    CONVERSION_EDGE,
    DTYPE_COLOURS,
    SMALL,
    TEXT,
    TINY,
    axes,
    fig_title,
    grid,
    heading,
    legend_below,
    width,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from mpguide.compiled.graphs import Graphs
    from mpguide.core.table import Table
    from mpguide.training.autograd import DtypeLog


def dtype_key(value: Any) -> str:
    """The key of :data:`~mpguide.plots.style.DTYPE_COLOURS` a value stands for: a dtype
    (``torch.bfloat16``, ``'bfloat16'``, ``'bf16[8, 4]'``), ``'error'`` (an error or
    ``'raised'``), ``'needs hardware'``, ``'none'`` (nothing, ``''``), or ``'other'``."""
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


def _dtype_legend(fig: Figure, ax: Axes, own: bool, keys: Sequence[str], conversions=False):
    from matplotlib.patches import Patch

    used = [k for k in DTYPE_COLOURS if k in keys and k != "other"]
    handles = [Patch(facecolor=DTYPE_COLOURS[k], label=k) for k in used]
    if conversions:
        handles.append(
            Patch(facecolor="white", edgecolor=CONVERSION_EDGE, linewidth=2, label="conversion")
        )
    legend_below(fig, ax, own, handles, ncol=min(len(handles), 4))


def dtype_grid(
    table: Table,
    columns: Sequence[str] | None = None,
    title: str = "",
    *,
    ax: Axes | None = None,
) -> Figure:
    """The cells of ``columns`` (default: every column but the first) of each row of ``table``,
    labelled by the row's first cell, each coloured by the dtype or outcome it names
    (:func:`dtype_key`) and showing it (a dtype by its short name, ``bf16``)."""
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
    fig, ax, own = axes(
        ax, (max(4.5, label_in + 1.05 * len(columns) + 0.3), 0.3 * len(labels) + 1.9)
    )
    for y, (row, row_keys) in enumerate(zip(table.rows, keys, strict=True)):
        for x, (i, key) in enumerate(zip(index, row_keys, strict=True)):
            ax.add_patch(
                Rectangle((x, y), 1, 1, facecolor=DTYPE_COLOURS[key], edgecolor="white", lw=1.5)
            )
            text = _short(key) or textwrap.shorten(cell(row[i]), 18, placeholder="…")
            ax.text(
                x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=TEXT, color=_ink(key)
            )
    ax.set_xlim(0, len(columns))
    ax.set_ylim(len(labels), 0)
    ax.set_xticks([x + 0.5 for x in range(len(columns))], [textwrap.fill(c, 16) for c in columns])
    ax.set_yticks([y + 0.5 for y in range(len(labels))], labels)
    ax.xaxis.tick_top()
    ax.tick_params(length=0, labelsize=TEXT)
    ax.spines[:].set_visible(False)
    heading(fig, ax, own, title)
    _dtype_legend(fig, ax, own, [k for row in keys for k in row])
    return fig


# One box of a strip: its label, its dtype (or outcome), and whether it is a conversion.
Box = tuple[str, Any, bool]


def dtype_strips(
    strips: Mapping[str, Sequence[Box]],
    title: str = "",
    *,
    ax: Axes | Sequence[Axes] | None = None,
) -> Figure:
    """One strip per entry: a box per step (an op, a stage), coloured by its dtype
    (:func:`dtype_key`), labelled underneath, and outlined where it is a conversion.
    ``ax``: one axes per strip."""
    from matplotlib.patches import Rectangle

    from mpguide.core import dtypes

    # At least 12 slots, so that a short strip keeps small boxes; narrow, so that the labels
    # stay legible when a phone scales the figure down.
    n = max(12, *(len(boxes) for boxes in strips.values()))
    wide = 0.32 * n + 0.6
    fig, all_axes, own = grid(ax, len(strips), 1, (wide, 2.0 * len(strips)))
    keys = []
    for panel, (name, boxes) in zip(all_axes, strips.items(), strict=True):
        for x, (_, dtype, conversion) in enumerate(boxes):
            key = dtype_key(dtype)
            keys.append(key)
            panel.add_patch(
                Rectangle(
                    (x + 0.06, 0),
                    0.88,
                    1,
                    facecolor=DTYPE_COLOURS[key],
                    edgecolor=CONVERSION_EDGE if conversion else "none",
                    lw=2.2 if conversion else 0,
                )
            )
            if key in dtypes.FLOATS:
                panel.text(
                    x + 0.5,
                    0.5,
                    _short(key),
                    ha="center",
                    va="center",
                    fontsize=TINY,
                    rotation=90,
                    color=_ink(key),
                )
        panel.set_xlim(0, n)
        panel.set_ylim(0, 1)
        panel.set_xticks([x + 0.5 for x in range(len(boxes))], [b[0] for b in boxes], rotation=90)
        panel.set_yticks([])
        panel.tick_params(length=0, labelsize=SMALL)
        panel.spines[:].set_visible(False)
        panel.set_title(textwrap.fill(name, int(width(fig) * 16)), fontsize=TEXT, loc="left")
    suptitle = fig_title(fig, title)
    _dtype_legend(fig, all_axes[-1], own, keys, conversions=True)
    if not own:
        return fig
    # Square boxes: the height is what the labels, titles and legend measure, plus the boxes;
    # every strip gets the room of the one with the longest label.
    renderer = fig.canvas.get_renderer()

    def inches(*texts):
        return sum(t.get_window_extent(renderer).height for t in texts) / fig.dpi

    labels = [t for a in all_axes for t in a.get_xticklabels()]
    strip = max(map(inches, labels), default=0) + inches(all_axes[0].title) + (wide - 0.3) / n
    head = inches(fig.legends[0], *([suptitle] if suptitle else []))
    fig.set_figheight(head + len(strips) * (strip + 0.25) + 0.3)
    return fig


def _op_label(op: str) -> str:
    return op.removeprefix("aten.").removeprefix("prims.").removesuffix(".default")


def graph_strips(
    *captures: Graphs,
    which: str | Sequence[str] = "forward",
    title: str = "",
    ax: Axes | Sequence[Axes] | None = None,
) -> Figure:
    """The dtype flow of captured graphs: one strip per capture and graph (``which``: forward,
    backward or both; a capture without that graph is left out), a box per op node coloured by
    the dtype it returns, conversions outlined (those :meth:`Graphs.flow` calls conversions).
    ``ax``: one axes per strip."""
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
    return dtype_strips(strips, title, ax=ax)


def log_strips(
    log: DtypeLog,
    phases: Sequence[str] | None = None,
    title: str = "",
    *,
    ax: Axes | Sequence[Axes] | None = None,
) -> Figure:
    """The ops a :class:`~mpguide.training.autograd.DtypeLog` saw, one strip per phase (default:
    every phase, in order), a box per op coloured by its output dtype, casts outlined; a
    backward op that produces a parameter's gradient names the parameter. ``ax``: one axes
    per strip."""
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
    return dtype_strips(strips, title, ax=ax)

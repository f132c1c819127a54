"""The numerics chapter: formats bit by bit, matmul errors, precision switches, error against
the reduction length."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mpguide.plots.charts import bars
from mpguide.plots.style import (
    CAST_COLOUR,
    FIELD_COLOURS,
    HEADING,
    SAME_COLOUR,
    TEXT,
    TITLE,
    axes,
    grid,
    legend_below,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from mpguide.core.switches import Effect
    from mpguide.precision.formats import Format
    from mpguide.precision.numerics import KSweep, MatmulErrors


def bit_layout(formats: Sequence[Format], *, ax: Axes | None = None) -> Figure:
    """One row of boxes per format, one box per bit: sign, exponent and mantissa."""
    from matplotlib.patches import Patch, Rectangle

    widest = max(f.bits for f in formats)
    fig, ax, _ = axes(ax, (9.0, 0.42 * len(formats) + 1.3))
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
        ax.text(x + 0.8, row, text, va="center", fontsize=TEXT)
    ax.set_xlim(0, widest + 26)
    ax.set_ylim(len(formats) - 0.5, -0.5)
    ax.set_yticks(range(len(formats)), [f.name for f in formats], fontsize=TITLE)
    ax.set_xticks([])
    ax.spines[["top", "right", "bottom"]].set_visible(False)
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in FIELD_COLOURS.items()],
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=3,
        fontsize=TITLE,
        frameon=False,
    )
    return fig


def matmul_error_bars(result: MatmulErrors, *, ax: Axes | None = None) -> Figure:
    """Max error over mean ``|ref|`` of each mode (a group, labelled with how it ran) at each
    shape (a bar), on a log axis."""
    values: dict[str, dict[str, float]] = {}
    for r in result.rows:
        label = f"{r.mode} ({r.how.split(':')[0]})"
        values.setdefault(label, {})[" x ".join(map(str, r.shape))] = r.stats.max_rel
    return bars(values, xlabel="max |error| / mean |float64 result| (log scale)", log=True, ax=ax)


def switch_effects(effects: Sequence[Effect], *, ax: Axes | None = None) -> Figure:
    """Each setting (rows) against each probe (columns): grey where the result is
    bit-identical to IEEE fp32, orange and labelled with the largest relative difference
    where it changed."""
    from matplotlib.patches import Patch, Rectangle

    probes = [name for name, _ in effects[0].differences]
    fig, ax, _ = axes(ax, (8.0, 0.5 * len(effects) + 1.4))
    for row, e in enumerate(effects):
        for col, (probe, diff) in enumerate(e.differences):
            cell = Rectangle((col, row), 1, 1, edgecolor="white", linewidth=2)
            cell.set_facecolor(CAST_COLOUR if diff > 0 else SAME_COLOUR)
            cell.set_gid(probe)
            ax.add_patch(cell)
            text = f"differs by {diff:.2g}" if diff > 0 else "bit-identical"
            ax.text(col + 0.5, row + 0.5, text, ha="center", va="center", fontsize=TEXT)
    ax.set_xlim(0, len(probes))
    ax.set_ylim(len(effects), 0)
    ax.set_xticks([c + 0.5 for c in range(len(probes))], probes, fontsize=TITLE)
    ax.xaxis.tick_top()
    ax.set_yticks([r + 0.5 for r in range(len(effects))], [e.call for e in effects], fontsize=TEXT)
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
        fontsize=TEXT,
        frameon=False,
    )
    return fig


def k_sweep(sweep: KSweep, *, ax: Sequence[Axes] | None = None) -> Figure:
    """Error against the reduction length ``K`` on log-log axes, one curve per format and
    accumulation: RMS error on the left, max error over mean ``|result|`` on the right, each
    with a dotted ``sqrt(K)`` line. TF32 is drawn hollow, so that fp16 shows through it.
    ``ax``: the two axes."""
    fig, (ax_abs, ax_rel), own = grid(ax, 1, 2, (11, 5.5))
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
    for panel, anchor in anchors:
        growth = [anchor * (k / ks[0]) ** 0.5 for k in ks]
        panel.loglog(
            ks, growth, ":", color="gray", label="sqrt(K) growth" if panel is ax_abs else None
        )
        panel.set_xlabel("reduction length K")
        panel.grid(True, which="major", alpha=0.3)
    ax_abs.set_ylabel("RMS error")
    ax_rel.set_ylabel("max |error| / mean |result|")
    handles = ax_abs.get_legend_handles_labels()[0]
    legend_below(fig, ax_abs, own, handles, ncol=3, fontsize=TITLE, frameon=True)
    fig.suptitle(sweep.caption, fontsize=HEADING)
    return fig

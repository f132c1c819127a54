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


# Figures of the numerics, inference and profiler chapters. One palette: a value that is lost
# or wrong is red, a cast is orange, an op is pale blue.
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from mpguide.casts import CastReport
    from mpguide.formats import Format
    from mpguide.numerics import MatmulErrors
    from mpguide.switches import Effect
    from mpguide.trace import Node

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
        raise ValueError(f"scale must be 'time' or 'ops', not {scale!r}")
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


if TYPE_CHECKING:
    from mpguide.inference import Result
    from mpguide.numerics import KSweep


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

import matplotlib

matplotlib.use("Agg")

import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
import pytest
import torch

from mpguide import MPGuideError, plots
from mpguide.autocast import policy
from mpguide.core.table import Table


def _drawn_on(draw, n=1):
    """Call ``draw(ax=...)`` with the ``n`` axes of a new figure: it draws on each, returns
    that figure and makes no other; a figure of one axes gets no figure legend."""
    fig, axes = plt.subplots(1, n, squeeze=False)
    axes = list(axes.flat)
    before = plt.get_fignums()
    assert draw(ax=axes if n > 1 else axes[0]) is fig
    assert plt.get_fignums() == before
    assert all(a.has_data() for a in axes)
    if n == 1:
        assert not fig.legends
    return axes


def test_policy_map_colours_each_op_on_each_device():
    ops = [op for op in policy.CATALOGUE if op.name in ("matmul", "sum", "softmax")]
    devices = policy.across(torch.bfloat16, ["cpu", "cuda"], ops, simulate=True)
    fig = plots.policy_map(devices)
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["matmul", "softmax", "sum"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["cpu (simulated)", "cuda (simulated)"]
    grid = ax.images[0].get_array().tolist()
    lower, float32, unchanged = (
        policy.CLASSES.index(k) for k in (policy.LOWER, policy.FLOAT32, policy.UNCHANGED)
    )
    assert grid == [[lower, unchanged, unchanged], [lower, float32, float32]]  # catalogue order
    only = plots.policy_map(devices, only_differing=True).axes[0]
    assert [t.get_text() for t in only.get_xticklabels()] == ["softmax", "sum"]
    (ax,) = _drawn_on(lambda ax: plots.policy_map(devices, ax=ax))
    assert ax.images[0].get_array().tolist() == grid
    plt.close("all")


# -- dtype grids and strips, backend bars -----------------------------------------------------


def _colours(patches):
    return [mcolors.to_hex(p.get_facecolor()) for p in patches]


def test_dtype_key_reads_dtypes_short_names_and_outcomes():
    assert plots.dtype_key(torch.bfloat16) == "bfloat16"
    assert plots.dtype_key("bf16[8, 4]") == "bfloat16" and plots.dtype_key("fp16") == "float16"
    assert plots.dtype_key("f32") == "float32"
    assert plots.dtype_key("error: RuntimeError: no") == plots.dtype_key("raised") == "error"
    assert plots.dtype_key("needs hardware") == "needs hardware"
    assert plots.dtype_key("") == plots.dtype_key(None) == plots.dtype_key("none") == "none"
    assert plots.dtype_key("DTensor") == "other"


def test_dtype_grid_colours_and_labels_each_cell():
    table = Table(
        ("op", "cpu", "cuda", "note"),
        (("sum", torch.bfloat16, "f32[4]", "x"), ("mv", "error: RuntimeError: no", "", "y")),
    )
    fig = plots.dtype_grid(table, ("cpu", "cuda"), title="a title")
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["sum", "mv"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["cpu", "cuda"]
    want = ["bfloat16", "float32", "error", "none"]
    assert _colours(ax.patches) == [plots.DTYPE_COLOURS[k] for k in want]
    assert [t.get_text() for t in ax.texts] == ["bf16", "f32", "error", ""]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "float32",
        "bfloat16",
        "error",
        "none",
    ]
    assert fig.get_suptitle() == "a title"
    assert len(plots.dtype_grid(table).axes[0].patches) == 6  # every column but the first
    with pytest.raises(MPGuideError, match="no column 'gpu'"):
        plots.dtype_grid(table, ("gpu",))
    (ax,) = _drawn_on(lambda ax: plots.dtype_grid(table, ("cpu", "cuda"), "a title", ax=ax))
    assert _colours(ax.patches) == [plots.DTYPE_COLOURS[k] for k in want]
    assert ax.get_title(loc="left") == "a title"
    assert "float32" in [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close("all")


def test_dtype_strips_draw_a_box_per_step_and_outline_conversions():
    fig = plots.dtype_strips(
        {
            "forward": [
                ("x", torch.float32, False),
                ("to", torch.bfloat16, True),
                ("mm", "bf16", False),
            ],
            "stages": [("shard", "float32", False)],
        }
    )
    forward, stages = fig.axes
    assert [ax.get_title(loc="left") for ax in fig.axes] == ["forward", "stages"]
    assert [t.get_text() for t in forward.get_xticklabels()] == ["x", "to", "mm"]
    assert _colours(forward.patches) == [
        plots.DTYPE_COLOURS[k] for k in ("float32", "bfloat16", "bfloat16")
    ]
    assert [p.get_linewidth() > 0 for p in forward.patches] == [False, True, False]
    assert len(stages.patches) == 1
    assert "conversion" in [t.get_text() for t in fig.legends[0].get_texts()]
    strips = {"forward": [("x", torch.float32, False)], "stages": [("to", "bf16", True)]}
    _, second = _drawn_on(lambda ax: plots.dtype_strips(strips, ax=ax), n=2)
    assert "conversion" in [t.get_text() for t in second.get_legend().get_texts()]
    with pytest.raises(MPGuideError, match="draws on 2 axes; ax holds 1"):
        plots.dtype_strips(strips, ax=second)
    sub = plt.figure(layout="constrained").subfigures(1, 2)[1]  # axes on a subfigure
    assert plots.dtype_strips(strips, "a title", ax=sub.subplots(2, 1)) is sub
    plt.close("all")


def test_graph_strips_follow_the_dtype_of_each_node():
    from mpguide.compiled import graphs

    def round_trip(x):
        return (x.to(torch.bfloat16) * 2).float()

    g = graphs.capture(round_trip, torch.randn(4, requires_grad=True), backend="aot_eager")
    fig = plots.graph_strips(g, which=("forward", "backward", "nothing"))
    assert [ax.get_title(loc="left") for ax in fig.axes] == [
        f"{g.label}: forward",
        f"{g.label}: backward",
    ]
    forward = fig.axes[0]
    ops = [op for op, _ in g.nodes()]
    assert [t.get_text() for t in forward.get_xticklabels()] == [
        op.removeprefix("aten.").removeprefix("prims.") for op in ops
    ]
    conversions = [r["node"] for r in g.flow().records() if r["change"] == "conversion"]
    assert sum(p.get_linewidth() > 0 for p in forward.patches) == len(conversions) == 2
    assert _colours(forward.patches) == [
        plots.DTYPE_COLOURS[plots.dtype_key(t)] for _, t in g.nodes()
    ]
    _drawn_on(lambda ax: plots.graph_strips(g, ax=ax))
    plt.close("all")


def test_log_strips_draw_each_phase_of_a_log():
    from mpguide.training import autograd

    lin = torch.nn.Linear(4, 2)
    with autograd.DtypeLog(lin) as log:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = lin(torch.randn(3, 4))
        out.float().sum().backward()
    fig = plots.log_strips(log)
    assert [ax.get_title(loc="left") for ax in fig.axes] == log.phases() == ["forward", "backward"]
    for ax, phase in zip(fig.axes, log.phases(), strict=True):
        records = log.select(phase)
        assert len(ax.patches) == len(records)
        assert [p.get_linewidth() > 0 for p in ax.patches] == [r.is_cast for r in records]
    labels = [t.get_text() for t in fig.axes[1].get_xticklabels()]
    assert "_to_copy (weight)" in labels
    assert len(plots.log_strips(log, ["backward"]).axes) == 1
    _drawn_on(lambda ax: plots.log_strips(log, ax=ax), n=2)
    plt.close("all")


def test_backend_bars_draw_one_bar_per_group_and_backend():
    values = {
        "round trip": {"eager": None, "aot_eager": 4e-3, "inductor": 0.0},
        "rope": {"aot_eager": 0.02134, "inductor": 1.5e-7},
    }
    fig = plots.backend_bars(values, "max abs error", title="errors")
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["eager", "aot_eager", "inductor"]
    assert _colours(ax.patches) == [plots.GROUP_COLOURS[0]] * 3 + [plots.GROUP_COLOURS[1]] * 2
    assert [t.get_text() for t in ax.texts] == ["raised", "0.004", "0", "0.0213", "1.5e-07"]
    assert ax.get_yscale() == "log"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["round trip", "rope"]
    linear = plots.backend_bars({"counts": {"eager": 0, "inductor": 65432}}, "n", log=False)
    assert [p.get_height() for p in linear.axes[0].patches] == [0, 65432]
    assert [t.get_text() for t in linear.axes[0].texts] == ["0", "65432"]
    with pytest.raises(MPGuideError, match="at most 4 groups"):
        plots.backend_bars({str(i): {"eager": 1.0} for i in range(5)}, "x")
    (ax,) = _drawn_on(lambda ax: plots.backend_bars(values, "max abs error", ax=ax))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["round trip", "rope"]
    plt.close("all")


def test_comparison_bars_draw_one_statistic_of_each_outcome():
    from mpguide.compiled import backends

    def rounds(x):
        return x.to(torch.bfloat16).float() * 3

    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    c = backends.compare(rounds, (x,), backends=("eager", "aot_eager"))
    fig = plots.comparison_bars({"round trip": c}, "max_rel", title="t")
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["eager", "aot_eager"]
    assert [t.get_text() for t in ax.texts] == [f"{o.max_rel:.3g}" for o in c.outcomes]
    assert ax.get_ylabel() == plots.METRICS["max_rel"] == c.table().columns[3]
    assert fig.get_suptitle().replace("\n", " ") == f"t, {c.machine.caption()}"
    with pytest.raises(MPGuideError, match="unknown metric 'mean'"):
        plots.comparison_bars({"round trip": c}, "mean")
    (ax,) = _drawn_on(lambda ax: plots.comparison_bars({"round trip": c}, "max_rel", "t", ax=ax))
    assert ax.get_title(loc="left") == f"t, {c.machine.caption()}"
    plt.close("all")


def test_training_curves_draw_loss_and_lost_share_per_curve():
    from mpguide.training import master_weights

    curves = {w: master_weights.train(w, steps=20) for w in ("float32", "bfloat16")}
    fig = plots.training_curves(curves, title="sgd")
    loss, lost = fig.axes
    assert [list(line.get_ydata()) for line in loss.get_lines()] == [
        list(c.losses) for c in curves.values()
    ]
    assert [list(line.get_ydata()) for line in lost.get_lines()] == [
        list(c.lost_share) for c in curves.values()
    ]
    assert [mcolors.to_hex(line.get_color()) for line in loss.get_lines()] == list(
        plots.GROUP_COLOURS[:2]
    )
    assert loss.get_yscale() == "log"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["float32", "bfloat16"]
    with pytest.raises(MPGuideError, match="at most 4 curves"):
        plots.training_curves({str(i): curves["float32"] for i in range(5)})
    loss, _ = _drawn_on(lambda ax: plots.training_curves(curves, ax=ax), n=2)
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["float32", "bfloat16"]
    plt.close("all")


def _hex(patch):
    from matplotlib.colors import to_hex

    return to_hex(patch.get_facecolor())


def test_bit_layout_draws_one_box_per_bit_coloured_by_field():
    from mpguide.precision import formats

    fmts = [formats.get(n) for n in ("float32", "bfloat16", "float16", "float8_e4m3fn")]
    ax = plots.bit_layout(fmts).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f.name for f in fmts]
    boxes = ax.patches
    assert len(boxes) == 32 + 16 + 16 + 8
    for field, colour in plots.FIELD_COLOURS.items():
        mine = [b for b in boxes if b.get_gid() == field]
        assert {_hex(b) for b in mine} == {colour}
        assert len(mine) == sum(getattr(f, f"{field}_bits") for f in fmts)
    # bf16's row: 1 sign box at x=0, exponent boxes at 1..8, mantissa boxes after them.
    bf16_row = sorted((b.get_x(), b.get_gid()) for b in boxes if abs(b.get_y() - (1 - 0.35)) < 1e-9)
    assert [g for _, g in bf16_row] == ["sign"] + ["exponent"] * 8 + ["mantissa"] * 7
    assert ax.texts[1].get_text() == "1+8+7 bits, max 3.4e+38, eps 0.0078"
    (ax,) = _drawn_on(lambda ax: plots.bit_layout(fmts, ax=ax))
    assert len(ax.patches) == 32 + 16 + 16 + 8
    plt.close("all")


def test_bars_groups_series_with_values_and_labels():
    values = {"a": {"x": 1.0, "y": 3.0}, "b": {"x": 2.0}}
    ax = plots.bars(values, xlabel="count", fmt="{:.1f}").axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
    widths = [p.get_width() for p in ax.patches]
    assert widths == [1.0, 2.0, 3.0]  # series x (a, b), then series y (a)
    colours = [_hex(p) for p in ax.patches]
    assert colours[0] == colours[1] != colours[2]
    assert [t.get_text() for t in ax.texts] == ["1.0", "2.0", "3.0"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["x", "y"]
    assert ax.get_xlabel() == "count" and ax.get_xscale() == "linear"
    (ax,) = _drawn_on(lambda ax: plots.bars(values, xlabel="count", ax=ax))
    assert [p.get_width() for p in ax.patches] == [1.0, 2.0, 3.0]
    plt.close("all")


def test_matmul_error_bars_one_bar_per_row_labelled_with_how():
    from mpguide.precision.numerics import EMULATED, HARDWARE, ErrorStats, MatmulErrors, MatmulRow

    def row(mode, shape, how, rel):
        return MatmulRow(mode, shape, how, ErrorStats(rel, rel, rel, 0.0), None)

    result = MatmulErrors(
        (
            row("fp32", (2, 3, 4), HARDWARE, 1e-6),
            row("tf32", (2, 3, 4), EMULATED, 1e-3),
            row("fp32", (5, 6, 7), HARDWARE, 2e-6),
            row("tf32", (5, 6, 7), EMULATED, 2e-3),
        ),
        "caption",
    )
    ax = plots.matmul_error_bars(result).axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["fp32 (hardware)", "tf32 (emulated)"]
    assert [p.get_width() for p in ax.patches] == [1e-6, 1e-3, 2e-6, 2e-3]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["2 x 3 x 4", "5 x 6 x 7"]
    assert ax.get_xscale() == "log"
    _drawn_on(lambda ax: plots.matmul_error_bars(result, ax=ax))
    plt.close("all")


def test_switch_effects_colours_changed_cells():
    from mpguide.core.switches import Effect

    effects = [
        Effect((("fp32_precision", "tf32"),), "cuda", (("matmul", 1e-3), ("conv2d", 0.0)), True),
        Effect((("fp32_precision", "bf16"),), "cuda", (("matmul", 0.0), ("conv2d", 0.0)), True),
    ]
    ax = plots.switch_effects(effects).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["matmul", "conv2d"]
    assert [t.get_text() for t in ax.get_yticklabels()] == [e.call for e in effects]
    colours = [_hex(p) for p in ax.patches]
    assert colours == [plots.CAST_COLOUR] + [plots.SAME_COLOUR] * 3
    assert [t.get_text() for t in ax.texts] == ["differs by 0.001"] + ["bit-identical"] * 3
    _drawn_on(lambda ax: plots.switch_effects(effects, ax=ax))
    plt.close("all")


def test_overflow_histogram_reddens_the_bins_past_the_limit():
    values = [1.0, -2.0, 3.0, 9.0, -11.0, 12.0]
    ax = plots.overflow_histogram(values, 8.0, label="|x|").axes[0]
    red = [p for p in ax.patches if _hex(p) == plots.LOST_COLOUR]
    assert sum(p.get_height() for p in ax.patches) == len(values)
    assert sum(p.get_height() for p in red) == 3
    assert all(p.get_x() >= 8.0 for p in red)
    assert "3 of 6 past it" in ax.texts[0].get_text()
    (ax,) = _drawn_on(lambda ax: plots.overflow_histogram(values, 8.0, label="|x|", ax=ax))
    assert sum(p.get_height() for p in ax.patches) == len(values)
    plt.close("all")


def test_icicle_draws_every_cpu_op_and_colours_the_casts():
    from pathlib import Path

    from mpguide.traces import casts, trace

    tree = trace.load(Path(__file__).parent / "data" / "autocast_matmul.json.gz").tree()
    report = casts.report(tree)
    (root,) = tree.find(predicate=lambda n: n.name.startswith("ProfilerStep#"))
    nodes = [n for n in root.walk() if not n.is_gpu]
    in_cast = {
        str(m.id)
        for c in report
        for m in tree.node(c.id).walk()
        if root in tree.node(c.id).ancestors()
    }
    assert in_cast
    for scale in ("time", "ops"):
        ax = plots.icicle(root, report, scale=scale).axes[0]
        boxes = {p.get_gid(): p for p in ax.patches}
        assert set(boxes) == {str(n.id) for n in nodes}
        assert {g for g, p in boxes.items() if _hex(p) == plots.CAST_COLOUR} == in_cast
        # Every op sits one row below its caller and inside it.
        for n in nodes[1:]:
            box, up = boxes[str(n.id)], boxes[str(n.parent.id)]
            assert box.get_y() == up.get_y() + 1
            assert (
                up.get_x() - 1e-6
                <= box.get_x()
                <= box.get_x() + box.get_width()
                <= (up.get_x() + up.get_width() + 1e-6)
            )
    # By ops, an op is as wide as the ops without children below it.
    leaves = sum(1 for n in nodes if not [c for c in n.children if not c.is_gpu])
    assert boxes[str(root.id)].get_width() == leaves
    assert ax.texts[0].get_text() == root.name
    with pytest.raises(ValueError, match="scale"):
        plots.icicle(root, scale="bytes")
    (ax,) = _drawn_on(lambda ax: plots.icicle(root, report, scale="ops", ax=ax))
    assert {p.get_gid() for p in ax.patches} == {str(n.id) for n in nodes}
    plt.close("all")


def test_k_sweep_draws_each_curve_on_both_axes():
    from mpguide.precision.numerics import ErrorStats, KSweep, SweepRow

    rows = tuple(
        SweepRow(fmt, acc, k, ErrorStats(0.0, scale * k**0.5, scale * k, 0.0))
        for k in (16, 64)
        for fmt, acc, scale in (("float32", "fp32", 1e-7), ("float16", "float16", 1e-3))
    )
    fig = plots.k_sweep(KSweep(rows, "caption"))
    ax_abs, ax_rel = fig.axes
    for ax in (ax_abs, ax_rel):
        assert ax.get_xscale() == ax.get_yscale() == "log"
        assert len(ax.lines) == 3  # two curves and the sqrt(K) line
        assert list(ax.lines[0].get_xdata()) == [16, 64]
    assert list(ax_abs.lines[1].get_ydata()) == [1e-3 * 16, 1e-3 * 64]
    assert list(ax_rel.lines[0].get_ydata()) == [1e-7 * 4, 1e-7 * 8]
    assert ax_abs.lines[1].get_linestyle() == "--"  # accumulated in its own format
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == [
        "float32 inputs, fp32 accumulation",
        "float16 inputs, float16 accumulation",
        "sqrt(K) growth",
    ]
    ax_abs, _ = _drawn_on(lambda ax: plots.k_sweep(KSweep(rows, "caption"), ax=ax), n=2)
    assert [t.get_text() for t in ax_abs.get_legend().get_texts()] == labels
    plt.close("all")


def test_latency_error_places_each_variant_at_its_median_and_error():
    from mpguide.core.timing import Latency
    from mpguide.models.inference import Result, Variant

    def result(name, error, times):
        return Result(
            Variant(name), torch.float32, error, error, 1.0, 0, 0, 0, Latency(name, times, "cpu")
        )

    first = [result("fp32", 0.0, (1e-3, 2e-3, 3e-3)), result("bf16", 0.5, (4e-3, 5e-3, 6e-3))]
    ax = plots.latency_error([first, [result("compiled", 0.25, (1e-3,) * 3)]]).axes[0]
    points = [(c.lines[0].get_xdata()[0], c.lines[0].get_ydata()[0]) for c in ax.containers]
    assert points == [(2.0, 0.0), (5.0, 0.5), (1.0, 0.25)]
    assert [c.lines[0].get_marker() for c in ax.containers] == ["o", "o", "s"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["fp32", "bf16", "compiled"]
    assert ax.get_yscale() == "symlog" and ax.get_xscale() == "log"
    _drawn_on(lambda ax: plots.latency_error([first], ax=ax))
    plt.close("all")


def test_cast_costs_stacks_directions_per_cause():
    import json

    from mpguide.traces import casts, trace

    def op(name, ts, dur, **args):
        return {
            "ph": "X",
            "cat": "cpu_op",
            "name": name,
            "pid": 1,
            "tid": 1,
            "ts": ts,
            "dur": dur,
            "args": args,
        }

    def cast(ts, dur, src, dst):
        return op("aten::to", ts, dur, **{"Input type": [src], "Input Dims": [[4, 4]]}), op(
            "aten::copy_", ts + 1, dur - 2, **{"Input type": [dst, src], "Input Dims": [[4, 4]] * 2}
        )

    events = [
        op("aten::linear", 0, 100),
        *cast(1, 30, "float", "c10::BFloat16"),
        op("aten::layer_norm", 200, 100),
        *cast(201, 10, "c10::BFloat16", "float"),
        *cast(220, 20, "float", "c10::BFloat16"),
    ]
    report = casts.report(trace.parse(json.dumps({"traceEvents": events}).encode()).tree())
    ax = plots.cast_costs(report).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["aten::linear", "aten::layer_norm"]
    down, up = ax.containers
    assert [p.get_width() for p in down] == [30, 20]
    assert [p.get_width() for p in up] == [0, 10]
    assert [p.get_x() for p in up] == [30, 20]
    assert ax.get_xlabel() == "cast time (CPU op µs)"
    _drawn_on(lambda ax: plots.cast_costs(report, ax=ax))
    plt.close("all")


# --- Training chapter: loss scaling, optimizers, recipes ---


def _run(name, evals, scales=(), found_inf=(), unchanged=(0.0, 0.5)):
    from torch import nn

    from mpguide.core import timing
    from mpguide.training import loop

    return loop.Run(
        recipe=loop.Recipe(name),
        losses=(1.0, 0.5),
        evals=evals,
        scales=scales,
        found_inf=found_inf,
        skipped=tuple(i for i, inf in enumerate(found_inf) if inf),
        weights_unchanged=unchanged,
        states_unchanged=tuple(1 - u for u in unchanged),
        state_dtypes=(),
        bytes_per_parameter=12.0,
        latency=timing.Latency(name, (0.1, 0.2), "cpu"),
        model=nn.Identity(),
    )


def test_magnitude_histogram_bins_log2_magnitudes_and_marks_limits():
    import numpy as np

    values = [2.0**-30, 2.0**-30, 2.0**-3, 0.0, -(2.0**-3)]
    fig = plots.magnitude_histogram(
        {"raw": values, "scaled": [v * 2**16 for v in values]},
        {"tiny": 2.0**-24, "small": 2.0**-14},
        title="t",
    )
    ax = fig.axes[0]
    outlines = [p for p in ax.patches if p.get_label() in ("raw", "scaled")]
    assert [p.get_label() for p in outlines] == ["raw", "scaled"]
    raw_heights = outlines[0].get_xy()[:, 1]
    assert sorted(set(np.round(raw_heights, 6))) == [0.0, 2.0]  # two values per occupied bin
    assert [line.get_xdata()[0] for line in ax.get_lines()] == [-24.0, -14.0]
    assert [t.get_text() for t in ax.texts] == [" tiny", " small"]
    shade = [p for p in ax.patches if p not in outlines]
    assert len(shade) == 1 and shade[0].get_x() + shade[0].get_width() == -24.0
    with pytest.raises(MPGuideError, match="no nonzero value"):
        plots.magnitude_histogram({"zero": [0.0]}, {})
    with pytest.raises(MPGuideError, match="need 1 to 6 series"):
        plots.magnitude_histogram({}, {})
    _drawn_on(lambda ax: plots.magnitude_histogram({"raw": values}, {"tiny": 2.0**-24}, ax=ax))
    plt.close("all")


def test_scale_trace_draws_the_scale_and_marks_skipped_steps():
    run = _run(
        "fp16", ((0, 2.0),), scales=(8.0, 4.0, 4.0, 8.0), found_inf=(True, False, False, False)
    )
    ax = plots.scale_trace(run).axes[0]
    (line,) = ax.get_lines()
    assert list(line.get_ydata()) == [3.0, 2.0, 2.0, 3.0]
    (marks,) = ax.collections
    assert marks.get_offsets().tolist() == [[0.0, 3.0]]
    assert ax.get_legend().get_texts()[1].get_text().endswith("skipped (1)")
    with pytest.raises(MPGuideError, match="had no GradScaler"):
        plots.scale_trace(_run("fp32", ((0, 2.0),)))
    (ax,) = _drawn_on(lambda ax: plots.scale_trace(run, title="t", ax=ax))
    assert ax.get_title(loc="left") == "t"
    plt.close("all")


def test_accumulation_draws_means_and_shades_spread():
    histories = {"same": [[1.0, 1.0], [1.0, 1.0]], "spread": [[1.0, 1.0], [1.0, 3.0]]}
    ax = plots.accumulation(histories).axes[0]
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[1.0, 1.0], [1.0, 2.0]]
    assert len(ax.collections) == 1  # only the series whose weights differ
    with pytest.raises(MPGuideError, match="need 1 to 6 histories"):
        plots.accumulation({})
    _drawn_on(lambda ax: plots.accumulation(histories, ax=ax))
    plt.close("all")


def test_training_runs_draw_losses_differences_and_unchanged_shares():
    from mpguide.core import device
    from mpguide.training import loop

    runs = loop.Runs(
        (_run("a", ((0, 4.0), (10, 2.0))), _run("b", ((0, 4.0), (10, 2.5)), unchanged=(0.2, 0.9))),
        "task",
        device.describe("cpu"),
    )
    fig = plots.training_runs(runs, unchanged=True, title="t")
    loss, diff, weights, states = fig.axes
    assert [list(line.get_ydata()) for line in loss.get_lines()] == [[4.0, 2.0], [4.0, 2.5]]
    assert [list(line.get_ydata()) for line in diff.get_lines()] == [[0.0, 0.0], [0.0, 0.5]]
    assert list(weights.get_lines()[1].get_ydata()) == [0.2, 0.9]
    assert [round(v, 6) for v in states.get_lines()[1].get_ydata()] == [0.8, 0.1]
    assert diff.get_title() == "held-out loss minus a's"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a", "b"]
    assert len(plots.training_runs(runs).axes) == 2
    many = loop.Runs(runs.runs * 4, "task", runs.machine)
    with pytest.raises(MPGuideError, match="at most 6 runs"):
        plots.training_runs(many)
    loss, *_ = _drawn_on(lambda ax: plots.training_runs(runs, unchanged=True, ax=ax), n=4)
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["a", "b"]
    plt.close("all")


# --- Training chapter: layers with state, recompute, communication ---


def test_running_means_draws_a_line_per_buffer_dtype_and_marks_where_it_stopped():
    from mpguide.training import norm_layers

    bf16 = torch.bfloat16
    means = norm_layers.RunningMeans(
        3.0, 0.1, "cpu", ((torch.float32, (1.0, 2.0, 2.9, 2.99)), (bf16, (1.0, 2.0, 2.5, 2.5)))
    )
    fig = plots.running_means(means, title="means")
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    for dt, name in ((torch.float32, "float32"), (bf16, "bfloat16")):
        line = lines[f"{name} buffers"]
        assert list(line.get_ydata()) == list(means.trace(dt))
        assert list(line.get_xdata()) == [1, 2, 3, 4]
        assert mcolors.to_hex(line.get_color()) == plots.DTYPE_COLOURS[name]
    (dot,) = [line for line in ax.get_lines() if line.get_marker() == "o"]
    assert (list(dot.get_xdata()), list(dot.get_ydata())) == ([3], [2.5])
    assert [t.get_text() for t in ax.texts] == ["stops 0.5 below"]
    assert list(lines["mean of every batch"].get_ydata()) == [3.0, 3.0]
    assert fig.get_suptitle() == "means"
    _drawn_on(lambda ax: plots.running_means(means, ax=ax))
    plt.close("all")


def _stats(*values):
    from mpguide.precision.numerics import ErrorStats

    return tuple(ErrorStats(v, v, v, 0.0) for v in values)


def test_sum_errors_draws_each_way_against_the_count():
    from mpguide.training import grad_sums

    sweep = grad_sums.Sweep(
        "a sum", "terms", (1, 4, 16), ("exact", "rounded"), (_stats(0, 0, 0), _stats(0, 0.1, 0.3))
    )
    fig = plots.sum_errors(sweep)
    (ax,) = fig.axes
    assert [list(line.get_xdata()) for line in ax.get_lines()] == [[1, 4, 16]] * 2
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[0, 0, 0], [0, 0.1, 0.3]]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["exact", "rounded"]
    assert (ax.get_xscale(), ax.get_yscale(), ax.get_xlabel()) == ("log", "symlog", "terms")
    assert fig.get_suptitle() == "a sum"
    many = grad_sums.Sweep("x", "n", (1,), tuple("abcdefg"), tuple(_stats(0) for _ in range(7)))
    with pytest.raises(MPGuideError, match="at most 6 ways, got 7"):
        plots.sum_errors(many)
    (ax,) = _drawn_on(lambda ax: plots.sum_errors(sweep, ax=ax))
    assert ax.get_title(loc="left") == "a sum"
    plt.close("all")


def test_communication_costs_split_bytes_by_dtype_and_write_each_error():
    from mpguide.training import distributed

    bf16, f32 = torch.bfloat16, torch.float32
    gather, scatter = "c10d._allgather_base_", "c10d._reduce_scatter_base_"

    def run(setup, scale, collectives, error):
        return distributed.CommRun(
            setup, scale, collectives, f32, bf16, _stats(error)[0], _stats(error)[0], 0.0, True
        )

    sharded = (
        distributed.Collective(gather, bf16, 100),
        distributed.Collective(scatter, f32, 300),
        distributed.Collective(gather, bf16, 100),
    )
    plain = (distributed.Collective("c10d.allreduce_", f32, 400),)
    comm = distributed.Communication(
        2,
        100,
        (
            run("DDP", 1.0, plain, 1e-7),
            run("DDP", 0.5, plain, 2e-7),
            run("FSDP2", 1.0, sharded, 0.0),
            run("FSDP2", 0.5, sharded, 0.0),
        ),
    )
    fig = plots.communication_costs(comm, title="comm")
    left, right = fig.axes
    assert [t.get_text() for t in left.get_yticklabels()] == ["DDP", "FSDP2"]
    bars = [(p.get_y() + p.get_height() / 2, p.get_x(), p.get_width()) for p in left.patches]
    assert bars == [(0, 0, 400), (1, 0, 200), (1, 200, 300)]
    assert _colours(left.patches) == [
        plots.DTYPE_COLOURS[k] for k in ("float32", "bfloat16", "float32")
    ]
    assert [t.get_text() for t in left.texts] == [" 400", " 500"]
    assert [t.get_text() for t in right.texts] == ["1e-07", "0", "2e-07", "0"]
    assert [t.get_text() for t in right.get_legend().get_texts()] == ["loss x 1", "loss x 0.5"]
    assert right.get_xscale() == "log"
    scales = tuple(run("DDP", 2.0**-i, plain, 0.0) for i in range(7))
    with pytest.raises(MPGuideError, match="at most 6 scales, got 7"):
        plots.communication_costs(distributed.Communication(2, 100, scales))
    left, right = _drawn_on(lambda ax: plots.communication_costs(comm, ax=ax), n=2)
    assert right.get_ylim() == left.get_ylim() == (1.5, -0.5)
    plt.close("all")


# --- Your model: the per-module report ---


def test_module_errors_draws_each_calls_error_and_marks_the_non_finite():
    import math

    from torch import nn

    from mpguide.models import per_module

    class Huge(nn.Module):
        def forward(self, x):
            return x * 1e5

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Huge(), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    fp16 = per_module.report(model, x, autocast="fp16", device="cpu")
    bf16 = per_module.report(model, x, autocast="bf16", device="cpu")
    fig = plots.module_errors({"fp16": fp16, "bf16": bf16}, title="t")
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["(root)", "0", "1", "2"]
    lines = {line.get_gid(): line for line in ax.get_lines()}
    assert list(lines["bf16"].get_ydata()) == [c.error.max_rel for c in bf16.calls]
    drawn = list(lines["fp16"].get_ydata())
    assert drawn[1] == fp16["0"].error.max_rel and all(math.isnan(y) for y in drawn[2:] + drawn[:1])
    bad = [i for i, c in enumerate(fp16.calls) if c.nonfinite]
    assert list(lines["fp16: inf or NaN"].get_xdata()) == bad == [0, 2, 3]
    assert "bf16: inf or NaN" not in lines
    assert [t.get_text() for t in ax.texts] == ["fp16: first inf/NaN in 1"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["fp16", "bf16", "inf or NaN"]
    assert ax.get_yscale() == "symlog"
    legend = plots.module_errors({"bf16": bf16}).legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["bf16"]
    simulated = per_module.report(model, x, device="cuda", simulate=True)
    with pytest.raises(MPGuideError, match="'sim' is simulated"):
        plots.module_errors({"sim": simulated})
    (ax,) = _drawn_on(lambda ax: plots.module_errors({"fp16": fp16, "bf16": bf16}, ax=ax))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["fp16", "bf16", "inf or NaN"]
    plt.close("all")


# --- Real traces: casts by module, fused casts, ranks ---


def test_cast_time_by_module_draws_each_trace_per_module_and_fused_kind():
    from pathlib import Path

    from mpguide.traces import casts, trace

    gpu = Path(__file__).parent / "data" / "gpu"

    def report(name):
        path = gpu / name
        return casts.report(trace.load(path, args_of=casts.needs_args).tree(python=True))

    reports = {
        "H100": report("h100_qwen1.5-0.5b_bf16_inference.json.gz"),
        "MI300X": report("mi300x_qwen1.5-0.5b_bf16_inference.json.gz"),
        "B200": report("b200_vllm_gpt-oss_eager_window.json.gz"),
    }
    ax = plots.cast_time_by_module(reports, title="t").axes[0]
    groups = [t.get_text() for t in ax.get_yticklabels()]
    assert groups == [
        "Qwen2RMSNorm",
        "Qwen2RotaryEmbedding",
        "fused: copy kernel",
        "fused: vendor",
        "fused: quantize",
    ]
    assert ax.get_xscale() == "log"
    h100, mi300, b200 = ax.containers  # one series per trace, in the mapping's order
    for bars, r in zip((h100, mi300), (reports["H100"], reports["MI300X"]), strict=True):
        widths = [p.get_width() for p in bars]
        norm = r.gpu_us[r.module == r.modules.index("Qwen2RMSNorm")].sum()
        assert widths[0] == pytest.approx(norm) and widths[2] == pytest.approx(r.fused.total_us)
    b200_fused = reports["B200"].fused.table().records()
    widths = [p.get_width() for p in b200]
    assert widths == pytest.approx(
        [sum(r["kernel us"] for r in b200_fused if r["kind"] == k) for k in ("vendor", "quantize")]
    )
    with pytest.raises(MPGuideError, match="no casts"):
        plots.cast_time_by_module({"none": report("a100_alexnet_no_shapes.json.gz")})
    (ax,) = _drawn_on(lambda ax: plots.cast_time_by_module(reports, ax=ax))
    assert [t.get_text() for t in ax.get_yticklabels()] == groups
    plt.close("all")

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import torch

from mpguide import plots, policy


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
    plt.close("all")


# -- dtype grids and strips, backend bars -----------------------------------------------------

import matplotlib.colors as mcolors
import pytest

from mpguide import MPGuideError
from mpguide.table import Table


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
    plt.close("all")


def test_graph_strips_follow_the_dtype_of_each_node():
    from mpguide import graphs

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
    plt.close("all")


def test_log_strips_draw_each_phase_of_a_log():
    from mpguide import autograd

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
    plt.close("all")


def test_comparison_bars_draw_one_statistic_of_each_outcome():
    from mpguide import backends

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
    plt.close("all")


def test_training_curves_draw_loss_and_lost_share_per_curve():
    from mpguide import master_weights

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
    plt.close("all")

import matplotlib.pyplot as plt

from mpguide import plots
from mpguide.core.table import Table
from mpguide.precision import lowbit


def test_element_grids_draw_each_format():
    shown = [lowbit.get("e4m3"), lowbit.get("fp4")]
    fig = plots.element_grids(shown)
    assert [c.get_gid() for c in fig.axes[0].collections if c.get_gid()] == [f.name for f in shown]
    plt.close(fig)
    fig, (top, bottom) = plt.subplots(2, 1)
    assert plots.element_grids(shown, ax=(top, bottom)) is fig
    assert [c.get_gid() for c in top.collections if c.get_gid()] == [f.name for f in shown]
    assert top.get_xlim() == bottom.get_xlim()  # aligned, though the caller's axes are not shared
    plt.close(fig)


def test_error_bars_draw_one_bar_per_cell():
    table = Table(("recipe", "block", "err"), (("a", 16, 0.1), ("a", 32, 0.2), ("b", 16, 0.3)))
    fig = plots.error_bars(table, "err", by="recipe", group="block")
    heights = {p.get_gid(): [] for p in fig.axes[0].patches}
    for p in fig.axes[0].patches:
        heights[p.get_gid()].append(p.get_height())
    assert heights["a"] == [0.1, 0.2] and heights["b"][0] == 0.3
    plt.close(fig)
    fig, ax = plt.subplots()
    assert plots.error_bars(table, "err", by="recipe", group="block", ax=ax) is fig
    assert len(ax.patches) == 4 and plt.get_fignums() == [fig.number]
    plt.close(fig)


def test_loss_curves_one_line_per_recipe():
    fig = plots.loss_curves({"bf16": [3, 2, 1], "nvfp4 (sr)": [3, 2.5, 2]})
    assert [line.get_gid() for line in fig.axes[0].lines] == ["bf16", "nvfp4 (sr)"]
    plt.close(fig)
    fig, ax = plt.subplots()
    assert plots.loss_curves({"bf16": [3, 2, 1]}, ax=ax) is fig
    assert [line.get_gid() for line in ax.lines] == ["bf16"]
    plt.close(fig)

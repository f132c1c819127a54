"""
Matmul error against the reduction length K
===========================================

Each output of a matmul sums ``K`` products. Does the error grow with ``K``? We sweep ``K``
over three decades, measure each format against float64 and plot on log-log axes with a
square-root growth line. With fp32 accumulation (what tensor cores and CPU kernels do) the
absolute error grows like ``sqrt(K)``, but so does the result, and the relative error stays
flat. Accumulating in the low-precision format itself is another story.
"""

# %%
# Setup
# -----
import matplotlib.pyplot as plt
import numpy as np

from mpguide import device, numerics

dev = device.pick()
device.describe(dev)

# %%
# The sweep
# ---------
# A ``32 x K`` by ``K x 32`` matmul for ``K`` from 16 to 16384; the inputs of a shorter ``K``
# are the first columns of the longest one's. Rows accumulated in ``fp32`` round only the
# inputs; rows accumulated in ``bfloat16`` or ``float16`` also round every partial sum, adding
# one product at a time (:func:`mpguide.numerics.accumulate`).
ks = [4**i for i in range(2, 8)]
sweep = numerics.k_sweep(ks, dev=dev)
sweep

# %%
# Log-log plot
# ------------
# Left: RMS error, absolute. Right: max error relative to the mean ``|result|``. The dotted
# gray lines grow like ``sqrt(K)``. TF32 (hollow diamonds) lies under fp16: same mantissa.


def slope(values):
    """The exponent of ``K`` in a least-squares power-law fit."""
    return float(np.polyfit(np.log(ks), np.log(values), 1)[0])


fig, (ax_abs, ax_rel) = plt.subplots(1, 2, figsize=(11, 5.5), layout="constrained")
markers = {"float32": "o", "tf32": "D", "bfloat16": "s", "float16": "^"}
slopes = {}
for fmt, acc in sweep.curves():
    _, stats = sweep.series(fmt, acc)
    rms, rel = [s.rms for s in stats], [s.max_rel for s in stats]
    slopes[fmt, acc] = (slope(rms), slope(rel))
    style = {
        "linestyle": "-" if acc == "fp32" else "--",
        "marker": markers[fmt],
        "markersize": 9 if fmt == "tf32" else 6,
        "markerfacecolor": "none" if fmt == "tf32" else None,
        "label": f"{fmt} inputs, {acc} accumulation",
    }
    ax_abs.loglog(ks, rms, **style)
    ax_rel.loglog(ks, rel, **style)
anchors = (
    (ax_abs, 10 * sweep.series("float32")[1][0].rms),
    (ax_rel, sweep.series("float16", "float16")[1][0].max_rel),
)
for ax, anchor in anchors:
    growth = [anchor * (k / ks[0]) ** 0.5 for k in ks]
    ax.loglog(ks, growth, ":", color="gray", label="sqrt(K) growth" if ax is ax_abs else None)
    ax.set_xlabel("reduction length K")
    ax.grid(True, which="major", alpha=0.3)
ax_abs.set_ylabel("RMS error")
ax_rel.set_ylabel("max |error| / mean |result|")
fig.legend(*ax_abs.get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=9)
fig.suptitle(sweep.caption)
plt.show()

# %%
# Growth exponents
# ----------------
# The slope of each curve on the log-log plot, fitted by least squares: 0.5 is ``sqrt(K)``.
for (fmt, acc), (abs_slope, rel_slope) in slopes.items():
    print(
        f"{fmt:>9} inputs, {acc:>8} accumulation: RMS error ~ K^{abs_slope:.2f}, "
        f"relative error ~ K^{rel_slope:.2f}"
    )
for (fmt, acc), (abs_slope, rel_slope) in slopes.items():
    if acc == "fp32" and fmt != "float32":
        assert 0.35 < abs_slope < 0.65, (fmt, abs_slope)
        assert abs(rel_slope) < 0.15, (fmt, rel_slope)
    if acc != "fp32":
        assert rel_slope > 0.25, (fmt, rel_slope)
        worst = sweep.series(fmt, acc)[1][-1].max_rel
        assert worst > 10 * sweep.series(fmt)[1][-1].max_rel, fmt

# %%
# What we saw
# -----------
# - With fp32 accumulation, the RMS error of every format grows close to ``sqrt(K)`` (the
#   rounding errors of the inputs add up like a random walk), while the error relative to the
#   result stays flat, because the result grows like ``sqrt(K)`` too.
# - Accumulating in bf16 or fp16 makes the relative error grow with ``K``, and at the longest
#   ``K`` it is more than ten times the fp32-accumulated error of the same inputs: the
#   accumulator, not the input format, is what long reductions need in fp32.
#
# .. admonition:: References
#
#    :torchdoc:`notes/numerical_accuracy.html`,
#    :torchdoc:`notes/cuda.html#reduced-precision-reduction-in-fp16-gemms`

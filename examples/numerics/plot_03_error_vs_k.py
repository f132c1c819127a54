"""
Matmul error against the reduction length K
===========================================

Each output of a matmul sums ``K`` products. Does the error grow with ``K``? We sweep ``K``
over three decades, measure each format against float64 and plot on log-log axes with a
square-root growth line. With fp32 accumulation the absolute error grows like ``sqrt(K)``, but
so does the result, and the relative error stays flat; accumulating in the low-precision format
itself makes the relative error grow with ``K``. This device's own bf16 matmul, measured beside
the two emulations, follows the fp32-accumulation curve. GPU tensor cores are not measured on
a CPU build.
"""

# %%
# Setup
# -----
import numpy as np

from mpguide import plots
from mpguide.core import device
from mpguide.precision import numerics

dev = device.pick()
device.describe(dev)

# %%
# The sweep
# ---------
# A ``32 x K`` by ``K x 32`` matmul for ``K`` from 16 to 16384; the inputs of a shorter ``K``
# are the first columns of the longest one's. Rows accumulated in ``fp32`` round only the
# inputs; rows accumulated in ``bfloat16`` or ``float16`` also round every partial sum, adding
# one product at a time (:func:`mpguide.precision.numerics.accumulate`).
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


slopes = {}
for fmt, acc in sweep.curves():
    _, stats = sweep.series(fmt, acc)
    slopes[fmt, acc] = (slope([s.rms for s in stats]), slope([s.max_rel for s in stats]))
fig = plots.k_sweep(sweep)
assert len(fig.axes[0].lines) == len(sweep.curves()) + 1

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
# This device's bf16 matmul
# -------------------------
# Which curve does a real bf16 matmul follow? We multiply bf16 inputs with ``torch.matmul`` on
# this device and compare with two emulations on the same bf16 values: products summed in
# float32 and rounded once to bf16 at the end, and products summed one ``k`` at a time in bf16
# (:func:`mpguide.precision.numerics.accumulate`). The float32 emulation is also compared bit for bit.
import torch

from mpguide.core.table import Table

gen = torch.Generator(device=dev).manual_seed(1)
a_full = torch.randn(32, max(ks), generator=gen, device=dev).to(torch.bfloat16)
b_full = torch.randn(max(ks), 32, generator=gen, device=dev).to(torch.bfloat16)


def rel_error(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().mean()).item()


measured = []
for k in ks:
    a, b = a_full[:, :k], b_full[:k]
    ref = a.double() @ b.double()
    hardware = a @ b
    fp32_acc = (a.float() @ b.float()).to(torch.bfloat16)
    bf16_acc = numerics.accumulate(a.float(), b.float(), "bfloat16")
    differing = int((hardware != fp32_acc).sum())
    measured.append(
        (k, rel_error(hardware, ref), rel_error(fp32_acc, ref), rel_error(bf16_acc, ref),
         differing)
    )
print("elements differing from the fp32 emulation, per K:", [row[4] for row in measured])
Table(
    ("K", "bf16 matmul on this device", "fp32 accumulation, rounded once",
     "bf16 accumulation", "elements differing from fp32 accumulation"),
    tuple(measured),
    f"max error / mean |ref| of a 32 x K by K x 32 bf16 matmul, on {dev.type}",
)

# %%
# The measured error stays within a few percent of the fp32-accumulation emulation at every
# ``K`` and does not grow, while bf16 accumulation's does (on a GPU, whose bf16 GEMM may also
# reduce partial sums in bf16, the allowance is wider). On the CPU the results match the
# fp32 emulation bit for bit in all but a few of the 1024 elements (the summation order
# differs); a GPU's bf16 GEMM may reduce in another order, so there only the error is compared.
hw_slope = slope([row[1] for row in measured])
print(f"bf16 matmul on {dev.type}: relative error ~ K^{hw_slope:.2f}; at K={ks[-1]} it is "
      f"{measured[-1][1]:.3g} against {measured[-1][2]:.3g} (fp32 accumulation) and "
      f"{measured[-1][3]:.3g} (bf16 accumulation)")
assert abs(hw_slope) < 0.15, hw_slope
for k, hw, fp32_acc_err, bf16_acc_err, differing in measured:
    assert abs(hw / fp32_acc_err - 1) < (0.05 if dev.type == "cpu" else 0.5), (k, hw)
    if k >= 1024:
        assert bf16_acc_err > 10 * hw, (k, hw, bf16_acc_err)
    if dev.type == "cpu":
        assert differing <= 1024 // 100, (k, differing)

# %%
# What we saw
# -----------
# - With fp32 accumulation, the RMS error of every format grows close to ``sqrt(K)`` (the
#   rounding errors of the inputs add up like a random walk), while the error relative to the
#   result stays flat, because the result grows like ``sqrt(K)`` too.
# - Accumulating in bf16 or fp16 makes the relative error grow with ``K``, and at the longest
#   ``K`` it is more than ten times the fp32-accumulated error of the same inputs: the
#   accumulator, not the input format, is what long reductions need in fp32.
# - This device's own bf16 matmul has the error of fp32 accumulation rounded once to bf16, flat
#   in ``K``, and on the CPU it matches that emulation bit for bit in all but at most 1% of the
#   elements. How GPU tensor cores accumulate is not measured on a CPU build.
#
# .. admonition:: References
#
#    :torchdoc:`notes/numerical_accuracy.html`,
#    :torchdoc:`notes/cuda.html#reduced-precision-reduction-in-fp16-gemms`,
#    :torchapi:`torch.matmul`

"""
The low-bit formats, from every code
====================================

fp8 e4m3 and e5m2, the e8m0 scales of the microscaling formats, fp6 e2m3 and e3m2 and fp4 e2m1:
what range and spacing does each have, where are its subnormals, and what happens past its max?
:class:`torch.finfo` describes the fp8 dtypes but not fp6 or fp4, so we decode every code of every
format (at most 256), read the facts off the values, confirm them against torch where torch has
the dtype, and round values with both roundings the recipes use.
"""

# %%
# Setup
# -----
import math

import torch

from mpguide.core import device
from mpguide.precision import lowbit

device.describe(torch.device("cpu"))

# %%
# The table
# ---------
# Every row is computed from the decoded codes: the largest finite value, the smallest normal
# and positive values, how many positive subnormals there are, the gap above 1, the range in
# binades (powers of two), whether the format has infinities and how many codes are NaN. The
# last column is *live*: what this torch's cast does with a finite value four times past the
# max (``no cast`` where torch has no cast to the format).
table = lowbit.table()
fmt = {f.name: f for f in lowbit.ELEMENTS.values()}
e4m3, e5m2, e8m0 = fmt["float8_e4m3fn"], fmt["float8_e5m2"], fmt["float8_e8m0fnu"]
e2m3, e3m2, e2m1 = fmt["fp6_e2m3"], fmt["fp6_e3m2"], fmt["fp4_e2m1"]
assert (e4m3.max, e5m2.max, e2m3.max, e3m2.max, e2m1.max) == (448, 57344, 7.5, 28, 6)
assert e2m1.finite[e2m1.finite.index(0) :] == (0, 0.5, 1, 1.5, 2, 3, 4, 6)
assert not e4m3.infinities and e5m2.infinities and e4m3.nan_codes == 2
assert e8m0.min_positive == 2.0**-127 and e8m0.max == 2.0**127 and e8m0.subnormals == 0
assert all(not f.infinities and f.nan_codes == 0 for f in (e2m3, e3m2, e2m1))
table

# %%
# Where the values lie
# --------------------
# One tick per positive value on a log2 axis (hollow: subnormals), and the gap to the next value
# relative to the value. e4m3 spends its bits on precision (gap 1/8 in every binade), e5m2 on
# range (gap 1/4, 32 binades); fp4 has eight magnitudes in all, and its gap is half the value
# or the whole value. e8m0 (every power of two from 2^-127 to 2^127) is left out: it holds scales.
from mpguide import plots

shown = [e4m3, e5m2, e2m3, e3m2, e2m1]
fig = plots.element_grids(shown)
drawn = [c.get_gid() for c in fig.axes[0].collections if c.get_gid()]
assert drawn == [f.name for f in shown]
assert e4m3.spacing_at_one == 2.0**-3 and e5m2.spacing_at_one == 2.0**-2
assert e2m1.spacing_at_one == 0.5
print(
    f"e4m3 spans {e4m3.dynamic_range:.1f} binades, e5m2 {e5m2.dynamic_range:.1f}, "
    f"fp4 {e2m1.dynamic_range:.1f}"
)

# %%
# Past the max: saturate, inf or NaN
# ----------------------------------
# A format without infinities cannot overflow to inf. Rounded to nearest, a value becomes NaN
# (e4m3) or is clamped (saturated) to ±max; e5m2 has infinities. What torch's own cast does is a
# fact about the running release, checked live here: the recipes on the next pages never rely on
# it, they clamp to ±max before casting, as torchao and Transformer Engine do.
from mpguide.core import versions

past = torch.tensor([e4m3.max * 4, math.inf])
cast = past.to(torch.float8_e4m3fn).float().tolist()
saturating = versions.change("fp8_e4m3fn_cast_saturates")
if saturating.holds:
    assert cast == [e4m3.max, e4m3.max]
else:
    assert all(math.isnan(v) for v in cast)
print(f"float8_e4m3fn cast of 4 × max and of inf: {cast}: {saturating.describe()}")
assert lowbit.overflow_on_cast(e5m2) == "inf"
rounded = lowbit.round_to(past, e4m3, saturate=False)
assert rounded.isnan().all()
print(
    f"e4m3 rounded without saturation: {rounded.tolist()}; with: "
    f"{lowbit.round_to(past, e4m3).tolist()}"
)

# %%
# Where the NaN starts: rounded to nearest without saturation, a value past 448 goes to 448 until
# half a step past it. The next step, 480, is e4m3fn's NaN code, so 464 is a tie, which rounds
# to the even code, 448, and the values above it in this list become NaN. Torch's cast of
# values around that boundary (live), beside that rounding computed by
# :func:`mpguide.precision.lowbit.round_to`:
edge = torch.tensor([450.0, 464.0, 464.5, 465.0, -465.0])
torch_cast = edge.to(torch.float8_e4m3fn).float()
nearest_cast = lowbit.round_to(edge, e4m3, saturate=False)
top_step = 2.0 ** math.floor(math.log2(e4m3.max)) * torch.finfo(torch.float8_e4m3fn).eps
print(f"the step above {e4m3.max:g} is {top_step:g}: the next code, {e4m3.max + top_step:g}, is "
      f"e4m3fn's NaN, and {e4m3.max + top_step / 2:g} is the tie")
for v, t, n in zip(edge.tolist(), torch_cast.tolist(), nearest_cast.tolist(), strict=True):
    print(f"{v:7.1f}: torch {torch.__version__} casts to {t}; round to nearest, no saturation: {n}")
assert nearest_cast[:2].tolist() == [e4m3.max, e4m3.max] and nearest_cast[2:].isnan().all()
if saturating.holds:
    assert torch_cast.abs().eq(e4m3.max).all()
else:  # the rounding of the releases before the change: NaN only past 464
    assert torch_cast[:2].tolist() == [e4m3.max, e4m3.max] and torch_cast[2:].isnan().all()

# %%
# Two roundings
# -------------
# Round to nearest (ties to even) is what a cast does; it is biased for a value that sits between
# two codes every time, such as a small gradient added again and again. Stochastic rounding goes
# up with probability equal to the distance from the value below, so its mean is the value. Here
# 0.3 in fp4 (between 0 and 0.5), rounded 100 000 times each way:
gen = torch.Generator().manual_seed(0)
x = torch.full((100_000,), 0.3)
nearest = lowbit.round_to(x, e2m1)
stochastic = lowbit.round_to(x, e2m1, "stochastic", generator=gen)
assert nearest.unique().tolist() == [0.5]
assert set(stochastic.unique().tolist()) == {0.0, 0.5}
assert abs(stochastic.double().mean().item() - 0.3) < 0.01
print(
    f"nearest: mean {nearest.double().mean().item():.4f}; "
    f"stochastic: mean {stochastic.double().mean().item():.4f}; value 0.3"
)

# %%
# What we saw
# -----------
# - The fp8 facts computed from the codes agree with :class:`torch.finfo`; fp6 and fp4 have no
#   infinities, no NaNs and one to seven subnormals; e8m0 is every power of two from 2^-127
#   to 2^127, with one NaN code and no zero.
# - e4m3 has a gap of 1/8 per binade over about 18 binades, e5m2 1/4 over 32; fp4 has eight
#   magnitudes, 0 to 6.
# - Past its max e4m3 has no infinity: rounded to nearest it becomes NaN, and torch's cast
#   behaviour is stated above for this release. Recipes clamp first.
# - Stochastic rounding keeps the mean; rounding to nearest does not.
#
# .. admonition:: References
#
#    - OCP 8-bit Floating Point Specification (OFP8), rev. 1.0.
#    - OCP Microscaling Formats (MX) Specification v1.0, section 5 (element and scale formats).
#    - :class:`torch.finfo`, :attr:`torch.float8_e4m3fn`, :attr:`torch.float8_e5m2`,
#      :attr:`torch.float8_e8m0fnu`, :attr:`torch.float4_e2m1fn_x2`.

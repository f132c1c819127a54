"""
fp16 overflow in an unscaled attention score
============================================

fp16 keeps more significand bits than bf16 but its largest finite value is small. Does an
attention score overflow when it is computed in fp16 without the ``1/sqrt(d)`` scale? We
compute the same scores in float32, fp16 and bf16 on this build's device, and look for
``inf`` and ``nan``: fp16 overflows, the softmax of its scores turns to ``nan``, bf16 does not
overflow, and scaling before the matmul keeps fp16 finite.
"""

# %%
# Setup
# -----
import torch

from mpguide.core import device

dev = device.pick()
device.describe(dev)

fp16_max = torch.finfo(torch.float16).max
bf16_max = torch.finfo(torch.bfloat16).max
print(f"largest finite fp16: {fp16_max:.6g}; largest finite bf16: {bf16_max:.6g}")

# %%
# Queries and keys with large activations
# ---------------------------------------
# One head of width 128, eight positions: standard normal queries scaled by 24 stand in for
# large activations. The keys equal the queries, so a diagonal score is a sum of 128 squares.
WIDTH = 128
gen = torch.Generator().manual_seed(0)  # drawn on the CPU: the same queries on every device
q = torch.randn(1, 1, 8, WIDTH, generator=gen).to(dev) * 24
k = q.clone()
scores32 = q @ k.transpose(-1, -2)
print(f"largest |score| in float32: {scores32.abs().max().item():.6g} "
      f"({scores32.abs().max().item() / fp16_max:.2f} x the fp16 limit)")
assert scores32.abs().max().item() > fp16_max

# %%
# The same scores in fp16 and bf16
# --------------------------------
# The inputs fit in fp16 (their largest value is far below the limit); the products overflow.
from mpguide.core.table import Table

rows = []
for dt in (torch.float16, torch.bfloat16):
    scores = q.to(dt) @ k.to(dt).transpose(-1, -2)
    probs = torch.softmax(scores, -1)
    rows.append((dt, q.to(dt).abs().max().item(), int(torch.isinf(scores).sum()),
                 int(torch.isnan(probs).sum()), scores.float().abs().max().item()))
overflow = Table(("dtype", "max |input|", "inf scores", "nan after softmax", "max |score|"),
                 tuple(rows), f"q @ k.T without scaling, width {WIDTH}, on {dev.type}")
overflow

# %%
fp16_row, bf16_row = overflow.records()
assert fp16_row["max |input|"] < fp16_max
assert fp16_row["inf scores"] > 0 and fp16_row["nan after softmax"] > 0
assert bf16_row["inf scores"] == 0 and bf16_row["nan after softmax"] == 0

# %%
# Where the scores fall
# ---------------------
# The float32 scores, by magnitude, against fp16's largest finite value: the bins past the
# line are the scores that fp16 turned into ``inf``, the diagonal sums of squares.
from mpguide import plots

fig = plots.overflow_histogram(
    scores32.flatten().tolist(), fp16_max, label="|score| of q @ k.T in float32"
)
red = sum(p.get_height() for p in fig.axes[0].patches if p.get_x() >= fp16_max)
assert red == fp16_row["inf scores"] == (scores32.abs() > fp16_max).sum().item()

# %%
# Scaling first keeps fp16 finite
# -------------------------------
# Dividing the queries by ``sqrt(d)`` before the matmul (what attention does) brings the
# largest score back below the limit; :func:`torch.nn.functional.scaled_dot_product_attention`
# applies the scale itself.
import math

import torch.nn.functional as F

scaled16 = (q.half() / math.sqrt(WIDTH)) @ k.half().transpose(-1, -2)
sdpa16 = F.scaled_dot_product_attention(q.half(), k.half(), k.half())
print(f"scaled fp16 scores: max {scaled16.abs().max().item():.6g}, "
      f"finite: {bool(torch.isfinite(scaled16).all())}")
print(f"scaled_dot_product_attention in fp16: finite: {bool(torch.isfinite(sdpa16).all())}")
assert torch.isfinite(scaled16).all()
assert torch.isfinite(sdpa16).all()

# %%
# What we saw
# -----------
# - Inputs well inside fp16's range gave attention scores above its largest finite value:
#   fp16 returned ``inf`` and the softmax turned them into ``nan``.
# - bf16, with float32's exponent range, computed the same scores without overflow, at a
#   coarser precision.
# - Scaling by ``1/sqrt(d)`` before the product, as ``scaled_dot_product_attention`` does,
#   kept the fp16 scores finite here.
#
# .. admonition:: References
#
#    :torchdoc:`type_info.html` (torch.finfo),
#    :torchapi:`torch.nn.functional.scaled_dot_product_attention`, :torchapi:`torch.softmax`

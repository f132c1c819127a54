"""
Finding an fp16 overflow
========================

A model that trains in bf16 returns NaN under fp16 autocast: which layer overflows? We give
:func:`mpguide.models.per_module.report` a small transformer whose attention scores are large (its query
and key projections are scaled up, as attention logits can grow in training) and computed
without the ``1/sqrt(d)`` scale. Under fp16 autocast the report names the attention module of
the first block as the first to return NaN while its inputs and its projections are finite:
the overflow is in the attention's own score product. bf16 stays finite but rounds the large
scores coarsely, and scaling before the product keeps fp16 finite.
"""

# %%
# Setup
# -----
import torch

from mpguide.core import device

dev = device.pick()
device.describe(dev)

# %%
# A transformer block with large attention scores
# -----------------------------------------------
# Two pre-norm blocks of width 256. The query and key projections are drawn with a standard
# deviation 40 times the usual ``1/sqrt(width)``, so their outputs have a standard deviation
# near 40, and ``scaled=False`` leaves out the division of the scores by ``sqrt(d)``.
import math

from torch import nn

WIDTH, GAIN = 256, 40.0


class Attention(nn.Module):
    def __init__(self, scaled: bool):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        for proj in (self.q, self.k):
            nn.init.normal_(proj.weight, std=GAIN / math.sqrt(WIDTH))
        self.scaled = scaled

    def forward(self, x):
        q, k = self.q(x), self.k(x)
        if self.scaled:
            q = q / math.sqrt(WIDTH)
        scores = q @ k.transpose(-1, -2)
        return self.out(torch.softmax(scores, -1) @ self.v(x))


class Block(nn.Module):
    def __init__(self, scaled: bool):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention(scaled)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def make(scaled: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(scaled), Block(scaled)).to(dev)


x = torch.randn(2, 64, WIDTH, device=dev)

# %%
# The report under fp16 autocast
# ------------------------------
# The first rows, in call order; the findings under the table name where the first
# non-finite value appeared: the first module call to finish with an infinity or NaN where the
# float64 reference has none, from a finite input.
from mpguide.models import per_module

fp16 = per_module.report(make(scaled=False), x, autocast="float16", device=dev)
fp16.table(limit=10)

# %%
origin = fp16.first_nonfinite
assert origin is not None and origin.name == "0.attn"
assert origin.input_nonfinite == 0 and origin.nan > 0 and origin.inf == 0
children = [fp16[f"0.attn.{p}"] for p in ("q", "k", "v")]
assert all(c.nonfinite == 0 for c in children)
assert origin.beyond_range == 0  # its output, in float64, is within fp16's range
assert fp16["0.attn.out"].input_nonfinite > 0
print(f"first NaN: {origin.label} ({origin.kind}), {origin.nan} NaN from a finite input; "
      f"q, k and v finite; the output projection received {fp16['0.attn.out'].input_nonfinite} "
      "non-finite values")

# %%
# The scores, recomputed
# ----------------------
# The attention's output is in range; its scores are not. Recomputed in float64 from the
# first block's own projections, a share of them exceeds fp16's largest finite value: fp16
# turns those into infinity and the softmax turns rows holding infinities into NaN.
block = make(scaled=False)[0]
with torch.no_grad():
    ref = block.double()
    normed = ref.norm1(x.double())
    scores = ref.attn.q(normed) @ ref.attn.k(normed).transpose(-1, -2)
fp16_max = torch.finfo(torch.float16).max
over = int((scores.abs() > fp16_max).sum())
print(f"{over} of {scores.numel()} scores beyond {fp16_max:g}; largest {scores.abs().max():.4g}")
assert over > 0

# %%
# bf16, and fp16 with the scale
# -----------------------------
# bf16 has float32's range: no score overflows, but a score near 1e5 is rounded to a multiple
# of several hundred, enough to change which keys the softmax picks. Scaling the queries by
# ``1/sqrt(d)`` before the product, as :func:`torch.nn.functional.scaled_dot_product_attention`
# does, keeps the fp16 scores in range.
bf16 = per_module.report(make(scaled=False), x, autocast="bfloat16", device=dev)
scaled = per_module.report(make(scaled=True), x, autocast="float16", device=dev)
assert bf16.first_nonfinite is None and all(c.nonfinite == 0 for c in bf16.calls)
assert scaled.first_nonfinite is None and all(c.nonfinite == 0 for c in scaled.calls)
ulp = 2.0 ** (math.floor(math.log2(scores.abs().max().item())) - 7)
print(f"bf16 spacing at the largest score: {ulp:g}")
assert 100 < ulp < 1000
for name, r in (("bf16", bf16), ("fp16, scaled", scaled)):
    print(f"{name}: logits error {r[''].error.max_rel:.3g}; {r.findings()[1]}")

from mpguide import plots

fig = plots.module_errors(
    {"fp16": fp16, "bf16": bf16, "fp16, scores scaled": scaled},
    title=f"two blocks with large attention scores: output error per module call, "
    f"{fp16.machine.caption()}",
)

# %%
# What we saw
# -----------
# Restated from the values computed above.
print(f"- Under fp16 autocast the first non-finite output came from {origin.label} "
      f"({origin.kind}): {origin.nan} NaN from a finite input, with its q, k and v projections "
      "finite, so the overflow was in its own ops.")
print(f"- Recomputed in float64, {over} of {scores.numel()} attention scores of the first block "
      f"exceed fp16's largest finite value, {fp16_max:g}.")
print(f"- bf16 stayed finite, with a logits error of {bf16[''].error.max_rel:.3g} of their mean "
      f"magnitude; fp16 with the scores scaled stayed finite too, at {scaled[''].error.max_rel:.3g}.")

# %%
# .. admonition:: References
#
#    :torchapi:`torch.autocast`, :torchdoc:`amp.html`, :torchdoc:`type_info.html`
#    (torch.finfo), :torchapi:`torch.nn.functional.scaled_dot_product_attention`,
#    :torchapi:`torch.softmax`

"""
A transformer's layers under each recipe
========================================

Activations, weights and gradients of a real architecture differ: weights are small and
well-behaved, activations carry outlier channels, gradients span many decades. We build a Qwen2
model from its configuration (random weights, nothing downloaded), give its normalization
weights the outlier channels that trained language models have, capture the input, weight and
output gradient of every linear layer, and quantize each under every recipe against float64.
The same per-layer report runs on your model from the command line.
"""

# %%
# Setup
# -----
import torch

from mpguide.core import device

device.describe(torch.device("cpu"))

# %%
# A Qwen2 model with outlier channels
# -----------------------------------
# Two decoder layers of width 256. Trained models' hidden states have a few channels far larger
# than the rest (Dettmers et al., LLM.int8(); Sun et al., Massive activations); we make two
# channels of every RMSNorm weight 50 times larger, so the inputs of the attention and MLP
# projections carry them.
from mpguide.models import zoo

model = zoo.qwen2(hidden=256, intermediate=512)
OUTLIERS = [5, 77]
with torch.no_grad():
    for layer in model.model.layers:
        layer.input_layernorm.weight[OUTLIERS] *= 50
        layer.post_attention_layernorm.weight[OUTLIERS] *= 50
inputs = zoo.token_inputs(model, 2, 64)

from mpguide.models import lowbit_report

captured = lowbit_report.capture(model, inputs, backward=True)
q_in = next(c.input for c in captured if c.name.endswith("0.self_attn.q_proj"))
channel = q_in.abs().amax(dim=(0, 1))
assert set(channel.topk(2).indices.tolist()) == set(OUTLIERS)
print(
    f"{len(captured)} linear layers; q_proj input amax: outlier channels "
    f"{channel[OUTLIERS].min():.0f} and {channel[OUTLIERS].max():.0f}, median channel "
    f"{channel.median():.2f}"
)

# %%
# Activations, weights, gradients
# -------------------------------
# The median error over the layers, and the worst layer, per recipe. Gradients are those of
# seeded standard-normal output gradients, flowing back through the model.
from mpguide.precision import recipes

table = lowbit_report.by_kind(captured, recipes.RECIPES)
med = {(r["tensors"], r["recipe"]): r["median rel error"] for r in table.records()}
for kind in ("activations", "weights", "gradients"):
    assert max(med[kind, r] for r in recipes.FP8_RECIPES) < med[kind, "nvfp4"]
    assert med[kind, "nvfp4"] < med[kind, "mxfp4"]
assert med["activations", "blockwise_1x128"] < med["activations", "tensorwise"]
table

# %%
# One report per layer
# --------------------
# Under NVFP4, every linear layer: the share of its input and weight values flushed to zero or
# past the max, their errors, and the error of the layer's GEMM on the quantized operands (its
# output). The layers with the largest output error are named first: the candidates to keep in
# bf16. The same table for your model: ``python -m mpguide model mymodel.py:make --target nvfp4``
# (``--backward`` adds the gradients' error; see :doc:`/docs/cli`).
report = lowbit_report.report(model, inputs, "nvfp4")
worst = max(report.rows, key=lambda r: r.output_error)
assert report.keep_first[0] == worst.module
print(f"keep first: {', '.join(report.keep_first)} (output error {worst.output_error:.3f})")
report

# %%
# A plain cast, without a scale
# -----------------------------
# Casting to e4m3 without any scale is what a careless ``.to(torch.float8_e4m3fn)`` does: small
# weights fall into the subnormals or to zero, and the outlier channels are still inside e4m3's
# range here, so nothing overflows but much is flushed. A scale all but cures this for the 8-bit
# recipes; the 4- and 6-bit ones flush small weights of their own, because a block's scale is set by
# its largest value and an element format with one to three mantissa bits and few exponents cannot
# reach far below it. The largest share of a layer's weights that becomes zero, per target (live,
# CPU):
TARGETS = ("float8_e4m3fn", *recipes.RECIPES)
w_zero = {
    t: max(r.weight.to_zero for r in lowbit_report.report(model, inputs, t).rows) for t in TARGETS
}
for t in TARGETS:
    print(f"{t:>18}: {100 * w_zero[t]:7.4f} % of a layer's weights become zero")
EIGHT_BIT = (*recipes.FP8_RECIPES, "mxfp8")
assert w_zero["float8_e4m3fn"] > 0.01
assert max(w_zero[t] for t in EIGHT_BIT) < w_zero["float8_e4m3fn"] / 100
assert min(w_zero["mxfp4"], w_zero["nvfp4"]) > w_zero["float8_e4m3fn"] > w_zero["mxfp6"]
print(
    f"plain e4m3 cast: {100 * w_zero['float8_e4m3fn']:.1f} %; the 8-bit recipes: at most "
    f"{100 * max(w_zero[t] for t in EIGHT_BIT):.4f} %; "
    f"mxfp6 {100 * w_zero['mxfp6']:.1f} %, nvfp4 {100 * w_zero['nvfp4']:.1f} %, "
    f"mxfp4 {100 * w_zero['mxfp4']:.1f} %"
)

# %%
# What we saw
# -----------
# - The outlier channels make activations the hard tensor: finer fp8 scales (1×128) halve the
#   error of one scale per tensor on them, while weights hardly care.
# - Every fp8 recipe stays well below NVFP4, and NVFP4 below MXFP4, on activations, weights and
#   gradients alike.
# - The report names the layers whose GEMM loses most, the first to keep in higher precision.
# - A plain e4m3 cast without a scale flushes small weights to zero. Of the recipes tried here,
#   the 8-bit ones (the four fp8 recipes and MXFP8) flush less than a hundredth of that;
#   MXFP4 and NVFP4 flush more than the plain e4m3 cast, MXFP6 less (figures printed above).
#
# .. admonition:: References
#
#    - Dettmers et al., *LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale*, 2022
#      (outlier features).
#    - Sun et al., *Massive Activations in Large Language Models*, 2024.
#    - :class:`transformers.Qwen2Config`, :func:`torch.Tensor.register_hook`.

"""
Scaling recipes, emulated bit for bit
=====================================

A format alone cannot hold a tensor: e4m3 stops at 448, fp4 at 6. A *recipe* picks scales that
bring each block of values into range: one per tensor, per row, per 1×128 or 128×128 block, from
the amax of earlier steps (delayed), or a power of two per 32 values (MX), or an e4m3 scale per
16 values under a float32 tensor scale (NVFP4). Every recipe is emulated here on the CPU. The
tests (``tests/test_recipes.py``) compare most of them element for element with torchao: the
tensorwise and rowwise fp8 recipes, the blockwise ones through torchao's rowwise scaling of the
tiles laid out as rows (its blockwise reference itself needs triton and is skipped on a CPU),
MXFP8, MXFP6 and MXFP4 under both scale modes, and NVFP4 with and without its tensor scale.
Two things are not compared: delayed scaling (torchao has no reference for it; the tests check
that it uses the previous amax), and MX blocks whose amax lies below about 2**-118, where
torchao departs from the spec (a test pins what torchao does there). We quantize one
activation with outlier channels under each recipe and measure what it costs against float64.
"""

# %%
# Setup
# -----
import math

import torch

from mpguide.core import device
from mpguide.precision import lowbit_errors, recipes

device.describe(torch.device("cpu"))
e8m0_min, e4m3_max = torch.finfo(torch.float8_e8m0fnu).tiny, torch.finfo(torch.float8_e4m3fn).max
print(f"MX's smallest scale (e8m0) is 2**{math.log2(e8m0_min):.0f}: an MXFP8 block meets it when "
      f"its amax lies below about 2**{math.log2(e8m0_min * e4m3_max):.0f}")

# %%
# An activation with outlier channels
# -----------------------------------
# 256 tokens × 1024 features, standard normal, except that every 97th feature is 50 times
# larger: the pattern of the hidden states of large language models, where a few channels
# carry values one to two orders of magnitude above the rest.
gen = torch.Generator().manual_seed(0)
x = torch.randn(256, 1024, generator=gen)
x[:, ::97] *= 50
ratio = (x.abs().max() / x.abs().median()).item()
assert ratio > 100
print(f"amax / median |x| = {ratio:.0f}")

# %%
# Every recipe on it
# ------------------
# ``bits/value`` counts the scales: a float32 scale per 128 values costs 0.25 bits, an e8m0 scale
# per 32 values 0.25 bits, an e4m3 per 16 values 0.5 bits. ``to zero`` is the share of nonzero
# values that quantize to zero; ``sat`` the share clamped to the element format's max.
table = lowbit_errors.tensor_errors({"activation": x})
err = dict(zip(table.column("recipe"), table.column("rel error"), strict=True))
bits = dict(zip(table.column("recipe"), table.column("bits/value"), strict=True))
assert err["blockwise_1x128"] < err["tensorwise"], "finer fp8 scales follow the outliers"
assert err["nvfp4"] < err["mxfp4"], "NVFP4's finer, non-power-of-two scales beat MXFP4"
assert max(err[r] for r in recipes.FP8_RECIPES) < min(err["mxfp4"], err["nvfp4"])
assert bits["mxfp8"] == bits["mxfp4"] + 4 == 8.25 and bits["nvfp4"] == 4.5 + 32 / x.numel()
table

# %%
# The MX scale: the spec's floor against rounding up
# --------------------------------------------------
# OCP MX v1.0 takes the scale ``2**(floor(log2 amax) - emax)``, with ``emax`` the exponent of the
# element format's largest power of two (8 for e4m3, whose max is ``1.75 * 2**8``). A block whose
# amax has a mantissa above 1.75 then lands above 448 and *saturates*. torchao's ``rceil`` mode
# rounds ``amax / 448`` up to a power of two instead: nothing saturates, the block uses a little
# less of the range. torchao's documentation gives cuBLAS's block quantization as the source of
# ``rceil``; no cuBLAS kernel ran for this page and no GPU output of it is recorded, so only the
# emulation (matched to torchao's ``rceil`` by the tests) is shown.
rows = []
for kind in ("mxfp8", "mxfp4"):
    for mode in recipes.MX_SCALE_MODES:
        q = recipes.mx(x, kind, scale_mode=mode)
        rows.append(
            {
                "recipe": kind,
                "scale": mode,
                "rel error": lowbit_errors.rel_error(q.values, x),
                "sat %": 100 * q.saturated.float().mean().item(),
            }
        )
from mpguide.core.table import from_records

mx_table = from_records(rows, "MX scales, floor (the spec) against rceil (live, on the CPU)")
by = {(r["recipe"], r["scale"]): r for r in rows}
assert by["mxfp8", "rceil"]["sat %"] == 0 < by["mxfp8", "floor"]["sat %"]
assert by["mxfp8", "rceil"]["rel error"] < by["mxfp8", "floor"]["rel error"]
mx_table

# %%
# Delayed scaling: the scale comes from the past
# ----------------------------------------------
# Transformer Engine's delayed scaling quantizes with the scale computed from the amax history of
# earlier steps. It saves a pass over the tensor, and costs when a step's amax jumps: here ten
# steps of the activation, the seventh with its outliers twice as large.
delayed = recipes.DelayedScaling(history=4)
steps = []
for step in range(10):
    xs = x * (2.0 if step == 6 else 1.0)
    q = delayed(xs)
    steps.append((step, lowbit_errors.rel_error(q.values, xs), q.saturated.float().mean().item()))
for step, rel, sat in steps:
    print(f"step {step}: rel error {rel:.4f}, saturated {100 * sat:.3f} %")
assert steps[0][2] == 0 and steps[6][2] > 0 and steps[6][1] > 3 * steps[5][1]
assert steps[7][2] == 0, "after the spike, the history holds the larger amax"

# %%
# Error against block size
# ------------------------
# Smaller blocks follow the values more closely and cost more scale bits. fp8 elements hardly
# care (e4m3's 17 binades hold a block either way); fp4 elements do. NVFP4's arithmetic at other
# block sizes (e4m3 scales over e2m1 elements) beats MXFP4's power-of-two scales at every size.
from mpguide import plots

sweep = lowbit_errors.block_sweep(x)
curve = {
    (r["recipe"], r["block"]): r["rel error"] for r in sweep.records()
}  # fmt: skip
assert curve["mxfp4", 8] < curve["mxfp4", 128] and curve["nvfp4", 8] < curve["nvfp4", 128]
assert all(curve["nvfp4", b] < curve["mxfp4", b] for b in (8, 16, 32, 64, 128))
fig = plots.error_bars(sweep, "rel error", by="recipe", group="block")
sweep

# %%
# GEMMs
# -----
# The shapes of the numerics chapter's matmul tables, both operands quantized along the inner
# dimension ``K`` and multiplied in float32, against the float64 product of the unquantized
# operands. With standard-normal operands every fp8 recipe loses about the same; fp4 loses four
# times as much, and NVFP4 less than MXFP4.
gemm = lowbit_errors.gemm_errors([(256, 2048, 256), (128, 8192, 128)])
g = {(r["shape"], r["recipe"]): r["rel error"] for r in gemm.records()}
for shape in ("256x2048x256", "128x8192x128"):
    assert g[shape, "nvfp4"] < g[shape, "mxfp4"]
    assert max(g[shape, r] for r in recipes.FP8_RECIPES) < g[shape, "nvfp4"] / 2
gemm

# %%
# What we saw
# -----------
# - On an activation with outlier channels, finer fp8 scales (1×128 blocks) lose less than one
#   scale per tensor; every fp8 recipe loses far less than the 4-bit formats.
# - The spec's MX scale (floor) saturates the blocks whose amax mantissa is above the element
#   format's; rounding the scale up (rceil) saturates nothing and errs less.
# - Delayed scaling saturates on the step whose amax jumps above its history.
# - Smaller blocks help fp4 much more than fp8; NVFP4's e4m3 scales beat MXFP4's powers of two
#   at every block size, for 0.25 more bits per value at their standard blocks.
#
# .. admonition:: References
#
#    - OCP Microscaling Formats (MX) Specification v1.0, section 6.3 (computing the scale).
#    - `torchao MX formats <https://github.com/pytorch/ao/tree/main/torchao/prototype/mx_formats>`_
#      and `float8 training <https://github.com/pytorch/ao/tree/main/torchao/float8>`_, the
#      reference implementations the tests compare with element for element (the recipes and
#      exceptions listed at the top of the page).
#    - `Transformer Engine, FP8 primer
#      <https://docs.nvidia.com/deeplearning/transformer-engine/user-guide/examples/fp8_primer.html>`_
#      (delayed scaling, amax history).
#    - DeepSeek-V3 technical report, section 3.3 (1×128 and 128×128 blockwise scaling).

"""
TF32 and low-precision matmul errors
====================================

How much does a float32 matmul lose when it runs in TF32, and how do bf16, fp16 and fp8
compare? We multiply seeded standard-normal float32 matrices in each mode, compare with the
float64 product of the same inputs, and report the max error relative to the mean ``|result|``
(the measure of PyTorch's TF32 notes), RMS and mean signed error. On a GPU the real hardware
modes run and are timed; on a CPU the low-precision modes are emulated, and any precision
switch that changes nothing on this hardware is marked as such.
"""

# %%
# Setup
# -----
import torch

from mpguide import device, numerics, switches

dev = device.pick()
device.describe(dev)

# %%
# Shapes
# ------
# ``M x K x N`` means an ``M x K`` matrix times a ``K x N`` one. The CPU sizes run in seconds
# on two cores; on a GPU we add the size of PyTorch's TF32 example, 10240 x 51200 times
# 51200 x 10240.
shapes = [(256, 2048, 256), (128, 8192, 128)]
if dev.type == "cuda":
    shapes.append((10240, 51200, 10240))
print("shapes:", ", ".join(" x ".join(map(str, s)) for s in shapes))

# %%
# The error table
# ---------------
# ``how`` says whether a row ran on the hardware or was emulated (inputs rounded to the
# format, products accumulated in IEEE fp32), and marks switches that changed nothing.
result = numerics.matmul_errors(shapes, dev=dev, repeats=3 if dev.type == "cuda" else 1)
result

# %%
# What the table shows, asserted
# ------------------------------
# TF32 keeps 10 of fp32's 23 mantissa bits: its error is more than ten times fp32's.
# bf16 keeps 7 bits, so its error is several times TF32's; fp8 is worse again. Where TF32 and
# fp16 are both emulated they round the inputs to the same 10 bits, and for inputs in fp16's
# range their errors agree.
for shape in shapes:
    rel = {r.mode: r.stats.max_rel for r in result.rows if r.shape == shape}
    tf32_row = result.row("tf32", shape)
    if tf32_row.how != numerics.NO_EFFECT:
        assert rel["tf32"] > 10 * rel["fp32"], shape
    assert rel["bfloat16"] > 3 * rel["tf32"] > 3 * rel["fp32"], shape
    assert rel["float8_e4m3fn"] > rel["bfloat16"], shape
    if tf32_row.how == result.row("float16", shape).how == numerics.EMULATED:
        assert abs(rel["float16"] / rel["tf32"] - 1) < 0.05, shape
    print(
        f"{' x '.join(map(str, shape))}: TF32 max error / mean |ref| is "
        f"{rel['tf32'] / rel['fp32']:.0f} x fp32's, bf16 {rel['bfloat16'] / rel['tf32']:.1f} x TF32's"
    )

# %%
# Switches that did nothing
# -------------------------
# The ``fp32_precision=...`` rows set the matmul switch of this device's backend to each value
# the installed torch accepts. A row marked ``switch had no effect`` produced results
# bit-identical to IEEE fp32: the switch was accepted, and nothing ran in lower precision.
dead = [r for r in result.rows if r.how == numerics.NO_EFFECT]
for row in dead:
    assert row.stats == result.row("fp32", row.shape).stats
print(f"{len(dead)} of {len(result.rows)} rows: switch had no effect on {dev.type}")

# %%
# The same check as a probe
# -------------------------
# :func:`mpguide.switches.effect` runs a matmul and a convolution in plain IEEE fp32 and with
# a setting, and compares the results bit for bit, so a reader learns whether TF32 really ran.
tf32_switch = switches.effect({"fp32_precision": "tf32"}, dev)
if dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 0):
    assert "matmul" in tf32_switch.changed
tf32_switch

# %%
# Speed, on a GPU
# ---------------
# Seconds are the median of CUDA-event timings after a warm-up; TFLOP/s count ``2 M K N``
# operations. On a CPU the hardware rows show wall-clock times, disturbed by whatever else
# the machine runs; the emulated rows are not timed.
if dev.type == "cuda":
    big = shapes[-1]
    fp32_row, tf32_row = result.row("fp32", big), result.row("tf32", big)
    if tf32_row.how == numerics.HARDWARE:
        assert tf32_row.seconds < fp32_row.seconds
    print(
        f"{' x '.join(map(str, big))}: fp32 {fp32_row.seconds:.4f} s "
        f"({fp32_row.tflops:.1f} TFLOP/s), TF32 {tf32_row.seconds:.4f} s "
        f"({tf32_row.tflops:.1f} TFLOP/s)"
    )
else:
    fp32_row = result.row("fp32", shapes[0])
    print(f"{dev.type}: fp32 {fp32_row.seconds:.4f} s for {' x '.join(map(str, shapes[0]))}")

# %%
# Recorded on a GPU
# -----------------
# On a CPU the low-precision rows are emulated. The hardware rows, with their times and
# TFLOP/s at the full 10240 x 51200 size, come from a recording made on a GPU machine with
# ``nox -s record``, labelled with its provenance (a GPU build shows its live table too).
from mpguide import record

record.beside(
    "numerics.matmul_errors",
    result.table() if dev.type == "cuda" else None,
    machine=device.describe(dev),
)

# %%
# What we saw
# -----------
# - The max error relative to the mean ``|result|`` rises from fp32 to TF32 by an order of
#   magnitude or more, and again from TF32 to bf16 and to fp8, as the mantissa shrinks.
# - Emulated TF32 and fp16 agree: same 10-bit mantissa.
# - Precision switches the hardware ignores are flagged instead of being reported as TF32.
#
# .. admonition:: References
#
#    :torchdoc:`notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices`,
#    :torchapi:`torch.set_float32_matmul_precision`,
#    :torchdoc:`notes/numerical_accuracy.html`

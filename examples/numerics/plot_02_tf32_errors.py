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
import math

import torch

from mpguide.core import device, switches
from mpguide.precision import numerics

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
# The errors side by side
# -----------------------
# The max error relative to the mean ``|result|`` of each mode, on a log axis, with how the
# mode ran on this device; each bar is one shape. Every step down in mantissa bits moves a
# bar right by about the factor asserted above.
from mpguide import plots

fig = plots.matmul_error_bars(result)
assert len(fig.axes[0].patches) == len(result.rows)

# %%
# Switches that did nothing
# -------------------------
# The ``fp32_precision=...`` rows set the matmul switch of this device's backend to each value
# the installed torch accepts. A row marked ``switch had no effect`` produced results
# bit-identical to IEEE fp32: the switch was accepted, and nothing ran in lower precision.
dead = [r for r in result.rows if r.how == numerics.NO_EFFECT]
print(f"{len(dead)} of {len(result.rows)} rows: switch had no effect on {dev.type}")
if dev.type == "cpu":
    # A CPU has no TF32 units: asking for TF32 is accepted and changes no bit.
    assert all(result.row("fp32_precision=tf32", s).how == numerics.NO_EFFECT for s in shapes)

# %%
# What ``fp32_precision=bf16`` could do on a CPU
# ----------------------------------------------
# On a CPU the switch asks oneDNN to let float32 matmuls run in bf16. Whether anything changes
# depends on the CPU (bf16 instructions) and on the kernel torch picks; where the row above
# says the switch had no effect, this CPU did not change the result at all, and what the kernel
# does elsewhere is not measured here. To bracket it, we emulate the bf16 schemes a kernel
# could use on the first shape's inputs, with float32 accumulation: inputs rounded once to
# bf16 (one product), and inputs split into bf16 terms, ``x = x1 + x2 + x3`` with each term
# the bf16 rounding of what is left, keeping the products ``x1 y1 + x1 y2 + x2 y1``
# ("bf16x3") or the six largest ("bf16x6").
m, k, n = shapes[0]
gen = torch.Generator(device=dev).manual_seed(0)
a = torch.randn(m, k, generator=gen, device=dev)
b = torch.randn(k, n, generator=gen, device=dev)
reference = a.double() @ b.double()


def bf16_terms(x):
    """``x`` as three bf16 values (held in float32) that add up to it."""
    terms, rest = [], x
    for _ in range(3):
        terms.append(rest.to(torch.bfloat16).float())
        rest = rest - terms[-1]
    return terms


def max_rel(out):
    return ((out.double() - reference).abs().max() / reference.abs().mean()).item()


(a1, a2, a3), (b1, b2, b3) = bf16_terms(a), bf16_terms(b)
with switches.precision(switches.inheriting()):
    schemes = {
        "fp32": max_rel(a @ b),
        "bf16, one product": max_rel(a1 @ b1),
        "bf16x3": max_rel(a1 @ b1 + (a1 @ b2 + a2 @ b1)),
        "bf16x6": max_rel(a1 @ b1 + (a1 @ b2 + a2 @ b1) + (a1 @ b3 + a2 @ b2 + a3 @ b1)),
    }
for name, rel in schemes.items():
    print(f"{name:>18}: max error / mean |ref| {rel:.3g}, {rel / schemes['fp32']:.3g} x fp32's")

# %%
# The emulations tell the schemes apart by orders of magnitude: one bf16 product is thousands
# of times fp32's error, bf16x3 more than five times, bf16x6 about fp32's. An error of a few
# times fp32's would sit between bf16x3 and bf16x6, and no scheme emulated here gives it, so a
# CPU that shows such a row under this switch is not explained by this page.
ratio = {name: rel / schemes["fp32"] for name, rel in schemes.items()}
assert abs(schemes["fp32"] / result.row("fp32", shapes[0]).stats.max_rel - 1) < 1e-6
assert ratio["bf16, one product"] > 1000
assert 5 < ratio["bf16x3"] < 50
assert ratio["bf16x6"] < 2
if dev.type == "cpu":
    bf16_switch = [r for r in dead if r.mode == "fp32_precision=bf16"]
    print(f"fp32_precision=bf16 on this CPU: {'no effect' if bf16_switch else 'changed results'}")

# %%
# The same check as a probe
# -------------------------
# :func:`mpguide.core.switches.effect` runs a matmul and a convolution in plain IEEE fp32 and with
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
from mpguide.core import record

record.beside(
    "numerics.matmul_errors",
    result.table() if dev.type == "cuda" else None,
    machine=device.describe(dev),
)

# %%
# Read from each recording: the errors grow as the mantissa shrinks on the GPU too (asserted
# per shape), the throughput of each mode that ran on hardware at the largest shape, and the
# modes the GPU could not run (emulated, with the reason torch gave).
ORDER = ("fp32", "tf32", "bfloat16", "float8_e4m3fn")
for rec in record.recordings():
    if "numerics.matmul_errors" not in rec.tables:
        continue
    t = rec.tables["numerics.matmul_errors"]
    rows = [dict(zip(t.columns, r, strict=True)) for r in t.rows]
    by_shape = {}
    for r in rows:
        by_shape.setdefault(r["M x K x N"], {})[r["mode"]] = r
    for shape, modes in by_shape.items():
        errs = [modes[m]["max err / mean |ref|"] for m in ORDER if m in modes]
        assert errs == sorted(errs), (rec.provenance.name, shape, errs)
    largest = max(by_shape, key=lambda s: math.prod(map(int, s.split(" x "))))
    fast = {m: r["TFLOP/s"] for m, r in by_shape[largest].items() if r["how"] == "hardware"}
    print(f"{rec.provenance.name} (torch {rec.provenance.torch}, recorded), {largest}: "
          + ", ".join(f"{m} {v:.0f} TFLOP/s" for m, v in fast.items()))
    for r in rows:
        if r["how"].startswith("emulated:") and r["M x K x N"] == largest:
            print(f"  {r['mode']}: {r['how']}")

# %%
# What we saw
# -----------
# - The max error relative to the mean ``|result|`` rises from fp32 to TF32 by an order of
#   magnitude or more, and again from TF32 to bf16 and to fp8, as the mantissa shrinks.
# - Emulated TF32 and fp16 agree: same 10-bit mantissa.
# - Precision switches the hardware ignores are flagged instead of being reported as TF32.
# - Emulated bf16 schemes for ``fp32_precision=bf16``: one bf16 product costs thousands of
#   times fp32's error, three products (bf16x3) more than five times, six about fp32's.
#
# .. admonition:: References
#
#    :torchdoc:`notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices`,
#    :torchapi:`torch.set_float32_matmul_precision`,
#    :torchdoc:`notes/numerical_accuracy.html`

"""
Number formats: range against precision
=======================================

bf16 keeps fp32's range and drops most of its digits; fp16 keeps more digits in a much
smaller range; TF32 is fp32's range with fp16's mantissa; the fp8 formats trade both. We
build the formats table from :class:`torch.finfo` and each format's bit layout, check every
limit by casting values on this build's device, then watch values overflow, round,
underflow and get lost in long sums.
"""

# %%
# Setup
# -----
import torch

from mpguide.core import device
from mpguide.core.table import from_records
from mpguide.precision import formats, numerics

dev = device.pick()
device.describe(dev)

# %%
# The formats table
# -----------------
# Sign, exponent and mantissa bits come from the format's layout; max and smallest normal
# from :class:`torch.finfo`; eps (the gap above 1) is ``2**-mantissa``, the smallest
# subnormal is ``smallest normal * eps``, the decimal digits ``(mantissa + 1) * log10(2)``.
table = formats.table()
by_name = {f.name: f for f in formats.formats()}
fp32, tf32, bf16, fp16 = (by_name[n] for n in ("float32", "tf32", "bfloat16", "float16"))
assert bf16.exponent_bits == tf32.exponent_bits == fp32.exponent_bits == 8
assert tf32.mantissa_bits == fp16.mantissa_bits == 10 and bf16.mantissa_bits == 7
assert bf16.max > 1e38 and fp16.max < 7e4
table

# %%
# The bit layouts
# ---------------
# The same layouts, one box per bit: exponent bits (blue) buy range, mantissa bits (green)
# buy precision. bf16 is fp32 with its last 16 mantissa bits cut off; TF32 keeps 10 of them,
# as many as fp16, whose exponent has only 5 bits.
from mpguide import plots

fig = plots.bit_layout(formats.formats())
drawn = [p.get_gid() for p in fig.axes[0].patches]
assert len(drawn) == sum(f.bits for f in formats.formats())
assert drawn.count("exponent") == sum(f.exponent_bits for f in formats.formats())
print(f"{len(formats.formats())} formats, {len(drawn)} bits drawn")

# %%
# Every limit, checked by casting
# -------------------------------
# For each torch dtype we cast on this device: ``1 + eps`` must survive and ``1 + eps/2``
# (a tie) must round to 1; the smallest subnormal must survive and half of it must vanish;
# ``max`` must survive. TF32 has no dtype: :func:`mpguide.precision.formats.round_mantissa` rounds fp32
# values to 10 mantissa bits, and the same checks run on it. float64 is left out: Python's
# own floats are float64, so its halfway values cannot even be written down.


def survives(fmt, value):
    x = torch.tensor([value], dtype=torch.float64, device=dev)
    if fmt.dtype is None:
        return fmt.round(x.float()).double().item() == value
    return x.to(fmt.dtype).double().item() == value


checked = []
for fmt in formats.formats():
    if fmt.dtype is torch.float64:
        continue
    if fmt.mantissa_bits:
        assert survives(fmt, 1 + fmt.eps) and not survives(fmt, 1 + fmt.eps / 2), fmt.name
    if fmt.smallest_subnormal is not None:
        assert survives(fmt, fmt.smallest_subnormal), fmt.name
        assert not survives(fmt, fmt.smallest_subnormal / 2), fmt.name
    assert survives(fmt, fmt.max), fmt.name
    checked.append(fmt.name)
print(f"limits confirmed by casts on {dev.type} for: {', '.join(checked)}")

# %%
# Where ``torch.finfo`` disagrees
# -------------------------------
# The table's note names the one dtype whose ``torch.finfo(...).eps`` differs from the gap
# above 1 that the casts above just confirmed: ``float8_e5m2fnuz``, whose finfo says 0.125
# while 1.125 rounds to 1 and 1.25 survives.
e5m2fnuz = formats.get("float8_e5m2fnuz")
print(f"torch.finfo(float8_e5m2fnuz).eps = {e5m2fnuz.finfo_eps}, casts show a gap of "
      f"{e5m2fnuz.eps} above 1")
assert e5m2fnuz.finfo_eps == 0.125 and e5m2fnuz.eps == 0.25
assert len(table.notes) == 1 and "float8_e5m2fnuz" in table.notes[0]
assert torch.tensor(1.125).to(torch.float8_e5m2fnuz).item() == 1.0

# %%
# Overflow: fp16 runs out just past its max
# -----------------------------------------
# Halfway between fp16's max and the next power of two is a tie; ties round to the even
# neighbour, which is infinity.
fp16_max = torch.tensor(fp16.max, dtype=torch.float16)
top_gap = fp16.max - torch.nextafter(fp16_max, torch.zeros_like(fp16_max)).item()
halfway = fp16.max + top_gap / 2
print(f"fp16 max {fp16.max:g}, gap below it {top_gap:g}, halfway to the next step {halfway:g}")
values = torch.tensor([fp16.max, halfway - 1, halfway, 1e30], device=dev)
as_fp16 = values.to(torch.float16)
as_bf16 = values.to(torch.bfloat16)
assert torch.isfinite(as_fp16[:2]).all() and torch.isinf(as_fp16[2:]).all()
assert torch.isfinite(as_bf16).all()
assert abs(as_bf16[3].item() / values[3].item() - 1) <= bf16.eps / 2
from_records(
    [
        {"value": f"{v:.9g}", "float16": f"{h:.9g}", "bfloat16": f"{b:.9g}"}
        for v, h, b in zip(values.tolist(), as_fp16.tolist(), as_bf16.tolist(), strict=True)
    ],
    caption="fp32 values cast to fp16 and bf16",
)

# %%
# Precision: bf16 loses ``1 + 2**-9``
# -----------------------------------
# The gap above 1 is ``2**-7`` in bf16 and ``2**-10`` in fp16 and TF32. Half a gap is a tie,
# which rounds to the even neighbour, 1: ``1 + 2**-8`` is a bf16 tie and ``1 + 2**-9`` lies
# below it, while fp16 and TF32 keep both and only drop their own tie, ``1 + 2**-11``.
small_steps = torch.tensor([1 + 2.0**-8, 1 + 2.0**-9, 1 + 2.0**-11], device=dev)
rows = []
for fmt in (bf16, tf32, fp16):
    rounded = fmt.round(small_steps)
    rows.append(
        {
            "format": fmt.name,
            **{
                f"1 + 2^{e}": f"{r:.9g}"
                for e, r in zip((-8, -9, -11), rounded.tolist(), strict=True)
            },
        }
    )
assert bf16.round(small_steps)[0].item() == bf16.round(small_steps)[1].item() == 1.0
assert fp16.round(small_steps)[1].item() == 1 + 2.0**-9 == tf32.round(small_steps)[1].item()
assert (fp16.round(small_steps)[2] == 1.0).item()
assert fp16.round(small_steps)[0].item() == 1 + 2.0**-8
assert bf16.eps == 2.0**-7 and fp16.eps == tf32.eps == 2.0**-10
from_records(rows, caption="1 plus a small step, rounded to each format")

# %%
# Underflow and subnormals
# ------------------------
# Below the smallest normal, fp16 keeps going with fewer significant bits (subnormals), then
# flushes to zero below half the smallest subnormal. bf16 reaches far smaller values.
tiny = torch.tensor(
    [fp16.smallest_normal, 1e-6, 1e-7, fp16.smallest_subnormal, 1e-8, 1e-30], device=dev
)
rows = []
for value, h, b in zip(
    tiny.tolist(), tiny.to(torch.float16).tolist(), tiny.to(torch.bfloat16).tolist(), strict=True
):
    rows.append(
        {"value": value, "float16": h, "fp16 relative error": abs(h - value) / value, "bfloat16": b}
    )
assert rows[0]["fp16 relative error"] == 0
assert rows[1]["fp16 relative error"] < rows[2]["fp16 relative error"]
assert rows[4]["float16"] == 0 and rows[5]["float16"] == 0 and rows[5]["bfloat16"] > 0
from_records(rows, caption="small fp32 values cast to fp16 and bf16")

# %%
# Summing many small numbers
# --------------------------
# Ten thousand copies of ``1e-4`` sum to about 1. :func:`torch.sum` on a low-precision tensor
# accumulates in fp32 internally and gets close; adding one value at a time and rounding every
# partial sum to the format (:func:`mpguide.precision.numerics.accumulate`) stalls once the spacing of
# the format near the running sum is more than twice ``1e-4``.
n = 10_000
x = torch.full((1, n), 1e-4, device=dev)
ones = torch.ones(n, 1, device=dev)
exact = x.double().sum().item()
rows = []
for fmt in (fp32, bf16, fp16):
    in_format = x.to(fmt.dtype)
    rows.append(
        {
            "format": fmt.name,
            "torch.sum": f"{in_format.sum().item():.6f}",
            "one at a time": f"{numerics.accumulate(x, ones, fmt.name).item():.6f}",
        }
    )
sums = {r["format"]: r for r in rows}
got = {(name, how): float(v) for name, r in sums.items() for how, v in r.items() if how != "format"}
for name in ("bfloat16", "float16"):
    assert abs(got[name, "torch.sum"] / exact - 1) < 0.01, name
assert got["float16", "one at a time"] < 0.5 * exact
assert got["bfloat16", "one at a time"] < got["float16", "one at a time"]
assert abs(got["float32", "one at a time"] / exact - 1) < 1e-3
print(f"exact sum of the fp32 inputs: {exact:.6f}")
from_records(rows, caption=f"sum of {n} copies of 1e-4")

# %%
# The same table on your machine
# ------------------------------
# ::
#
#     python -m mpguide formats --format markdown
#
# What we saw
# -----------
# - bf16 and TF32 share fp32's 8 exponent bits; TF32 and fp16 share 10 mantissa bits; every
#   limit in the table survives a cast on this device and the next value past it does not.
# - ``torch.finfo`` reports an eps that casts contradict for the dtypes named in the note.
# - fp16 turns values past its max into infinity; bf16 keeps ``1e30`` but rounds
#   ``1 + 2**-9`` to 1; fp16 loses relative precision in its subnormals and flushes to zero
#   below them.
# - Long sums need an fp32 accumulator: ``torch.sum`` has one, a one-at-a-time sum in fp16
#   or bf16 stalls far below the true value.
#
# .. admonition:: References
#
#    :torchapi:`torch.finfo`, :torchdoc:`type_info.html`,
#    :torchdoc:`notes/numerical_accuracy.html`

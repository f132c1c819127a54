"""
Positions and caches: RoPE under autocast, fp8 KV
=================================================

Two questions about what a long context does to low precision: whether rotary position
angles survive autocast, and how much an fp8 KV cache loses when the checkpoint ships no
calibrated scales. The angles are computed the four ways RoPE modules compute them, under
CPU autocast (live) and CUDA autocast (simulated: this build's dispatch rules on fake
tensors); the cache is emulated with torch's fp8 cast on the CPU (live). The answers on this
torch: the matmul form returns bf16 angles under autocast on both devices, so positions far
from 0 share an angle, and ``einsum`` does too on CUDA but not on the CPU; an fp8 cache at
scale 1.0 loses keys above 448 to saturation and small values to underflow, which amax
scales (per tensor, or per head) avoid.
"""

# %%
# Setup
# -----
import math

import torch

from mpguide.core import device
from mpguide.core.table import Table
from mpguide.precision import fp8_kv_cache, rope_angles

device.describe("cpu")
bf16 = torch.bfloat16

# %%
# Does autocast collapse my RoPE angles at large positions?
# ---------------------------------------------------------
# Asked in `diffusers#13922 <https://github.com/huggingface/diffusers/pull/13922>`__ ("the
# frequency matmul is on autocast's downcast list, so under ``torch.autocast("cuda",
# torch.bfloat16)`` it executes in bfloat16 anyway ... every image position in a ≤512-wide grid
# rounds to the same value"),
# `TransformerEngine#1245 <https://github.com/NVIDIA/TransformerEngine/issues/1245>`__ and
# `transformers#29285 <https://github.com/huggingface/transformers/pull/29285>`__ ("RoPE loses
# precision for Llama / Gemma"). First, which of the four ways of computing
# ``position * inv_freq`` from float32 operands autocast lowers, on each device:
ways = tuple(rope_angles.WAYS)
on = {(dev, dt): rope_angles.autocast_dtypes(dev, dt)
      for dev in ("cpu", "cuda") for dt in (bf16, torch.float16)}
heads = (f"{device.label(d, device.LIVE if d == 'cpu' else device.SIMULATED)} "
         f"{str(t).removeprefix('torch.')}" for d, t in on)
Table(("angles computed with", *heads),
      tuple((w, *(on[k][w] for k in on)) for w in ways),
      f"dtype of the angle table from float32 operands under autocast, torch {torch.__version__}")

# %%
matmul, outer, einsum, mul = ways
for key, got in on.items():
    assert got[matmul] == key[1] and got[outer] == got[mul] == torch.float32, key
assert on["cuda", bf16][einsum] == bf16 and on["cpu", bf16][einsum] == torch.float32
print(f"on torch {torch.__version__}: the matmul form is lowered on cpu and cuda; einsum on cuda "
      f"only; torch.outer and a broadcast multiply stay float32")

# %%
# The thread's claim holds for the matmul (``matmul`` is on both devices' lower-precision
# list: live on the CPU, simulated for CUDA). ``einsum`` is on CUDA's list (simulated) but not
# the CPU's, so gpt-neox-style ``einsum("i,j->ij")`` angles are float32 in a CPU test and
# bf16 under CUDA autocast;
# ``torch.outer`` and the broadcast multiply are on neither. What bf16 angles do: the
# fastest frequency (``inv_freq = 1``, angle = position) in windows of 512 consecutive
# positions at growing offsets, under CPU autocast, against float64:
DIM, BASE, WINDOW = 128, 10_000.0, 512
rows = []
for offset in (0, 1024, 16_384, 65_536):
    for label, dt, guarded in (("float32 (autocast off)", None, False),
                               ("autocast bf16", bf16, False),
                               ("autocast bf16, inner autocast(enabled=False)", bf16, True)):
        r = rope_angles.window(offset, WINDOW, DIM, BASE, matmul, dt, guarded)
        rows.append((offset, label, r.dtype, r.distinct, r.max_angle_error, r.max_cos_error))
collapse = Table(("offset", "matmul computed in", "angles", f"distinct of {WINDOW}",
                  "max angle error (rad)", "max |cos error|"), tuple(rows),
                 f"RoPE angles at the fastest frequency, head dim {DIM}, base {BASE:g}, errors "
                 f"against {torch.float64}; cpu ({device.LIVE})")
collapse

# %%
rec = {(r["offset"], r["matmul computed in"]): r for r in collapse.records()}
far = rec[65_536, "autocast bf16"]
assert far["angles"] == bf16 and far[f"distinct of {WINDOW}"] <= 2
assert far["max angle error (rad)"] >= 128
for offset in (0, 1024, 16_384, 65_536):
    fixed = rec[offset, "autocast bf16, inner autocast(enabled=False)"]
    assert fixed[f"distinct of {WINDOW}"] == WINDOW and fixed["max angle error (rad)"] == 0
    assert rec[offset, "autocast bf16"][f"distinct of {WINDOW}"] < WINDOW
print(f"at offset 65,536 bf16 angles leave {far[f'distinct of {WINDOW}']} distinct values for "
      f"{WINDOW} positions, off by up to {far['max angle error (rad)']:g} rad; with the inner "
      "autocast(enabled=False) every position keeps its own angle")
bf16_bits = 1 - round(math.log2(torch.finfo(bf16).eps))
print(f"bf16 keeps {bf16_bits} significant bits (torch.finfo): between {65_536:,} and "
      f"{2 * 65_536:,} its step is {torch.finfo(bf16).eps * 65_536:g}")

# %%
# bf16 keeps 8 significant bits: between 65,536 and 131,072 its step is 512, so 512
# consecutive positions fall on the values printed above, and the angle is off by up to half
# a step, many full turns; the cosine is then any value. Smaller offsets lose less, and even
# the first window loses some (bf16 integers are exact only up to 256). The fix the threads
# converge on is the row that recovers every angle: compute the table inside
# ``torch.autocast(device_type, enabled=False)`` with float32 operands, as transformers'
# RoPE modules do (transformers#29285), or use ``torch.outer`` or a broadcast multiply, which
# autocast leaves alone on both devices. Casting the cosine and sine tables to bf16
# afterwards costs little: they are in [-1, 1], where a bf16 rounding is at most ``2**-9``.

# %%
# How much does an fp8 KV cache lose without calibrated scales?
# -------------------------------------------------------------
# Asked in `sgl-cookbook#237 <https://github.com/sgl-project/sgl-cookbook/pull/237>`__
# (SGLang "falls back to a scale of 1.0" when a checkpoint has no calibrated KV scales),
# `verl#4435 <https://github.com/verl-project/verl/pull/4435>`__ and
# `vllm#11906 <https://github.com/vllm-project/vllm/pull/11906>`__ (scales computed from the
# first batch: "the effect is most visible on models with dynamic value ranges outside of the
# scope of fp8e4m3"). Engines store K and V in ``float8_e4m3fn`` divided by a scale: 1.0 when
# the checkpoint has none, else an amax scale per tensor or per KV head. Keys of one head
# have two channels near 600 (a k-projection bias does this), values are small except in one
# loud head; causal attention over the cache against float32 K and V, the worst head's
# relative error:
gen = torch.Generator().manual_seed(0)
KEY_OUTLIER, LOUD_STD = 600.0, 20.0
q, k, v = fp8_kv_cache.keys_values(key_outlier=KEY_OUTLIER, loud_value_std=LOUD_STD,
                                   generator=gen)
kv = Table(("scale", "K error", "V error", "attention output error", "K saturated",
            "V flushed to 0"),
           tuple((e.scaling, e.key_error, e.value_error, e.output_error, f"{e.keys_saturated:.2%}",
                  f"{e.values_flushed:.2%}") for e in fp8_kv_cache.cache_errors(q, k, v)),
           f"float8_e4m3fn KV cache (max {torch.finfo(torch.float8_e4m3fn).max:g}), "
           f"{tuple(k.shape)} (batch, heads, seq, dim); cpu ({device.LIVE})")
kv

# %%
unit, tensor_amax, head_amax = fp8_kv_cache.cache_errors(q, k, v)
assert unit.keys_saturated > 0 and tensor_amax.keys_saturated == head_amax.keys_saturated == 0
assert unit.key_error > 5 * tensor_amax.key_error
assert head_amax.values_flushed < tensor_amax.values_flushed < unit.values_flushed
print(f"scale 1.0: {unit.keys_saturated:.2%} of keys saturate at 448 (K error {unit.key_error:.3f}"
      f" against {tensor_amax.key_error:.3f} with an amax scale), {unit.values_flushed:.2%} of "
      f"values flush to 0; per-head scales flush {head_amax.values_flushed:.4%}")

# %%
# Keys above 448 saturate at scale 1.0 (e4m3fn has no infinity); values below half of
# ``2**-9`` (its smallest subnormal) flush to zero, and those below ``2**-6`` keep fewer than
# 3 mantissa bits. The
# attention output suffers less than K here because the saturated channels carry a bias that
# is nearly the same for every key, and a shift common to a row's scores cancels in the
# attention weights. How the value error depends on the size of the values of the quiet heads (the
# loud head keeps a standard deviation of 20), at each scaling:
sweep = []
for std in (1.0, 0.02, 0.002, 0.0002):
    qs, ks, vs = fp8_kv_cache.keys_values(value_std=std, key_outlier=0.0,
                                          loud_value_std=LOUD_STD,
                                          generator=torch.Generator().manual_seed(1))
    errs = {e.scaling: e for e in fp8_kv_cache.cache_errors(qs, ks, vs)}
    sweep.append((std, *(errs[s].value_error for s in fp8_kv_cache.SCALINGS),
                  f"{errs['scale 1.0'].values_flushed:.1%}"))
small = Table(("value std", *(f"V error, {s}" for s in fp8_kv_cache.SCALINGS),
               "flushed at scale 1.0"), tuple(sweep),
              f"worst head's V error, no key outliers, one loud head; cpu ({device.LIVE})")
small

# %%
first, *_, tiniest = small.records()
assert tiniest["V error, scale 1.0"] > 10 * tiniest["V error, per-head amax"]
assert tiniest["V error, per-tensor amax"] > 10 * tiniest["V error, per-head amax"]
assert abs(first["V error, scale 1.0"] - first["V error, per-head amax"]) < 0.01
print(f"values of std {first['value std']:g}: scale 1.0 as good as amax scales "
      f"({first['V error, scale 1.0']:.3f}); std {tiniest['value std']:g}: "
      f"{tiniest['V error, scale 1.0']:.3f} at scale 1.0, "
      f"{tiniest['V error, per-tensor amax']:.3f} per tensor, "
      f"{tiniest['V error, per-head amax']:.3f} per head")
e4m3 = torch.finfo(torch.float8_e4m3fn)
print(f"e4m3fn (torch.finfo): {-round(math.log2(e4m3.eps))} mantissa bits, normal range "
      f"2**{round(math.log2(e4m3.smallest_normal))} to {e4m3.max:g}")

# %%
# e4m3's relative precision (3 mantissa bits) is the same wherever values sit in its
# normal range, 2**-6 to 448, so a scale of 1.0 costs nothing for values of standard
# deviation 1 (the first row), which is why an uncalibrated cache can serve a model whose K
# and V stay in that range. It costs where values leave that range: keys
# above 448 saturate, and values far below 2**-6 go subnormal or to zero. A per-tensor amax
# scale fixes both unless one head is much louder than the others (its amax sets the scale
# and the quiet heads go subnormal), which per-head scales fix. fp8 KV speed (a smaller cache
# read per decoded token, and the kernel that reads it) is only measurable on a GPU with the
# engines' attention kernels: it is not recorded here.

# %%
# What we saw
# -----------
# - Under autocast, RoPE angles from a matmul are bf16 on the CPU (live) and on CUDA
#   (simulated), so at offset 65,536 a window of 512 positions keeps the number of distinct
#   angles printed above; ``einsum`` is lowered on CUDA only; ``torch.outer``, a broadcast
#   multiply and an inner ``autocast(enabled=False)`` keep every angle of the windows above.
# - An fp8 e4m3fn KV cache at scale 1.0 saturates keys above 448 and flushes small values,
#   and matches amax scaling for values of ordinary size; per-head amax scales keep quiet
#   heads next to a loud one.
#
# .. admonition:: References
#
#    :torchapi:`torch.autocast`, :torchapi:`torch.outer`, :torchapi:`torch.einsum`,
#    :torchdoc:`tensor_attributes.html` (the float8 dtypes),
#    :torchapi:`torch.nn.functional.scaled_dot_product_attention`

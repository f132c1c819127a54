"""
Mixing dtypes, with and without autocast
========================================

Does PyTorch let a bf16 tensor meet an fp32 tensor? We call a matmul and a LayerNorm with one
low-precision and one float32 operand, first outside and then inside :func:`torch.autocast`,
on this build's device, and print what comes out or the error raised. The matmul fails
outside autocast and returns bf16 inside it; what LayerNorm does depends on the device.
"""

# %%
# Setup
# -----
# Everything below runs on the device :func:`mpguide.core.device.pick` chooses: CUDA when present,
# else the CPU.
import torch

from mpguide.core import device, dtypes

dev = device.pick()
device.describe(dev)

# %%
# A bf16 x fp32 matmul outside autocast
# -------------------------------------
# Eager PyTorch does not promote the operands of a matmul: the call raises.
gen = torch.Generator(device=dev).manual_seed(0)
a = torch.randn(64, 32, device=dev, generator=gen).to(torch.bfloat16)
w = torch.randn(32, 16, device=dev, generator=gen)

try:
    a @ w
    matmul_error = None
except RuntimeError as err:
    matmul_error = str(err)
print(f"bf16 @ fp32 outside autocast raises: {matmul_error}")
assert matmul_error is not None

# %%
# The same matmul under autocast
# ------------------------------
# Autocast casts both operands to the low-precision dtype before the matmul runs.
with torch.autocast(dev.type, dtype=torch.bfloat16):
    out = a @ w
print(f"under autocast: {a.dtype} @ {w.dtype} -> {out.dtype}")
assert out.dtype == torch.bfloat16

# %%
# LayerNorm with fp32 weights on a bf16 input
# -------------------------------------------
# A LayerNorm built in float32 keeps float32 weights. We feed it a bf16 activation.
ln = torch.nn.LayerNorm(32, device=dev)
try:
    ln_outside = ln(a).dtype
except RuntimeError as err:
    ln_outside = f"error: {err}"
with torch.autocast(dev.type, dtype=torch.bfloat16):
    ln_inside = ln(a).dtype
print(f"outside autocast: LayerNorm(fp32 weights)(bf16 input) -> {ln_outside}")
print(f"inside autocast:  LayerNorm(fp32 weights)(bf16 input) -> {ln_inside}")

# %%
# On CUDA, autocast runs ``layer_norm`` in float32 and returns float32. On the CPU, torch
# accepts the mixed call even outside autocast, and CPU autocast leaves ``layer_norm`` alone,
# so the output keeps the input's bf16. The assertions pin down what this build saw.
# (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
if dev.type == "cuda":
    assert ln_inside == torch.float32
else:
    assert ln_outside == torch.bfloat16
    assert ln_inside == torch.bfloat16

# %%
# The same calls under CUDA autocast
# ----------------------------------
# The LayerNorm's answer depends on the device, so here are both. :func:`mpguide.autocast.policy.observe`
# runs a call under bf16 autocast on a device; CUDA is the GPU when this machine has one, else
# simulated from this build's dispatch rules (fake tensors, no kernel runs).
from mpguide.autocast import policy
from mpguide.core.table import Table


def matmul(d):
    return torch.randn(64, 32, device=d).to(torch.bfloat16) @ torch.randn(32, 16, device=d)


def layer_norm(d):
    return torch.nn.LayerNorm(32, device=d)(torch.randn(64, 32, device=d).to(torch.bfloat16))


cpu, cuda = device.target("cpu"), device.target("cuda")
runs = {(name, t.device.type): policy.observe(fn, t)
        for name, fn in (("bf16 @ fp32 matmul", matmul), ("LayerNorm(fp32)(bf16)", layer_norm))
        for t in (cpu, cuda)}
Table(
    ("call under bf16 autocast", "cpu", "cuda", "casts autocast added on cuda"),
    tuple(
        (name, runs[name, "cpu"].out, runs[name, "cuda"].out,
         ", ".join(f"{dtypes.name(a)}->{dtypes.name(b)}"
                   for a, b in runs[name, "cuda"].casts))
        for name in ("bf16 @ fp32 matmul", "LayerNorm(fp32)(bf16)")
    ),
    f"cpu: {cpu.how}; cuda: {cuda.how}",
)

# %%
assert runs["bf16 @ fp32 matmul", "cpu"].out == runs["bf16 @ fp32 matmul", "cuda"].out
assert runs["bf16 @ fp32 matmul", "cuda"].out == torch.bfloat16
assert runs["LayerNorm(fp32)(bf16)", "cpu"].out == torch.bfloat16
assert runs["LayerNorm(fp32)(bf16)", "cuda"].out == torch.float32
assert (torch.bfloat16, torch.float32) in runs["LayerNorm(fp32)(bf16)", "cuda"].casts
print("matmul: bf16 on both; LayerNorm: bf16 on the CPU, float32 on CUDA")

# %%
# Every answer above in one map: each call outside autocast on this build's device and under
# bf16 autocast on the CPU and on CUDA, coloured by the dtype that came out, or red where the
# call raised.
# (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
from mpguide import plots

names = ("bf16 @ fp32 matmul", "LayerNorm(fp32)(bf16)")
outside = {"bf16 @ fp32 matmul": f"error: {matmul_error}", "LayerNorm(fp32)(bf16)": ln_outside}
_ = plots.dtype_grid(
    Table(
        ("call", f"outside autocast, {dev.type}",
         *(f"autocast, {device.label(t.device.type, t.how)}" for t in (cpu, cuda))),
        tuple((name, outside[name], runs[name, "cpu"].out, runs[name, "cuda"].out)
              for name in names),
    ),
    title=f"output dtype with one bf16 and one float32 operand, torch {torch.__version__}",
)

# %%
# What we saw
# -----------
# - A bf16 x fp32 matmul raises outside autocast; under autocast it returns bf16.
# - LayerNorm with float32 weights on a bf16 input under autocast returns bf16 on the CPU and
#   float32 on CUDA, where autocast casts the input up: a table typed for one device is wrong
#   for the other.
#   (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
#
# .. admonition:: References
#
#    :torchapi:`torch.autocast`, :torchdoc:`amp.html#autocast-op-reference`,
#    :torchapi:`torch.nn.LayerNorm`

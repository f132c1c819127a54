"""
Output dtypes of reductions, softmax and norms
==============================================

Under autocast, what dtype do reductions, softmax and norms return when the activations
are bf16? And what do an explicit ``dtype=`` argument or an ``out=`` tensor change? We call
each op on this build's device and print the dtypes that come out; every one is asserted
against the policy probe or stated and asserted here.
"""

# %%
# Setup
# -----
import torch
import torch.nn.functional as F

from mpguide import device, policy
from mpguide.table import Table

dev = device.pick()
device.describe(dev)

gen = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(8, 64, device=dev, generator=gen).to(torch.bfloat16)
weight = torch.ones(64, device=dev)

# %%
# bf16 activations through common ops
# -----------------------------------
# Each op gets a bf16 input (and, for the norms, float32 weights as a model's would be).
ops = {
    "sum": lambda: x.sum(),
    "mean": lambda: x.mean(),
    "prod": lambda: x.prod(-1),
    "cumsum": lambda: x.cumsum(-1),
    "softmax": lambda: torch.softmax(x, -1),
    "log_softmax": lambda: torch.log_softmax(x, -1),
    "layer_norm": lambda: F.layer_norm(x, (64,), weight),
    "rms_norm": lambda: F.rms_norm(x, (64,), weight),
}
with torch.autocast(dev.type, dtype=torch.bfloat16):
    seen = {name: fn().dtype for name, fn in ops.items()}

Table(("op", "input", "output under autocast"),
      tuple((name, x.dtype, dt) for name, dt in seen.items()),
      f"bf16 input under autocast on {dev.type}, torch {torch.__version__}")

# %%
# The policy probe says the same: an op that autocast runs in float32 returns float32,
# the others keep bf16. (The probe calls ``sum`` with no ``dim``; here too.)
probe = policy.probe(dev, torch.bfloat16,
                     ops=[op for op in policy.CATALOGUE if op.name in ops])
for name, dt in seen.items():
    if name in ("layer_norm", "rms_norm"):
        continue  # called here with float32 weights, a mixed call the probe makes separately
    assert dt == probe[name].low_in.out, name
print("reductions and softmax agree with the probe")

# %%
# ``dtype=`` picks the output dtype
# ---------------------------------
# Passing ``dtype=`` to a reduction or softmax overrides autocast: float32 for an op that
# would keep bf16, and bf16 for an op autocast would run in float32.
with torch.autocast(dev.type, dtype=torch.bfloat16):
    softmax32 = torch.softmax(x, -1, dtype=torch.float32)
    sum32 = x.sum(dtype=torch.float32)
    prod16 = x.prod(-1, dtype=torch.bfloat16)
print(f"softmax(bf16, dtype=float32) -> {softmax32.dtype}")
print(f"sum(bf16, dtype=float32)     -> {sum32.dtype}")
print(f"prod(bf16, dtype=bfloat16)   -> {prod16.dtype}")
assert softmax32.dtype == torch.float32
assert sum32.dtype == torch.float32
assert prod16.dtype == torch.bfloat16

# %%
# ``out=`` switches autocast off for that call
# --------------------------------------------
# An op called with ``out=`` is not cast by autocast: float32 inputs multiply in float32 into
# a float32 ``out``, and an ``out`` of another dtype than the inputs raises.
a = torch.randn(16, 16, device=dev, generator=gen)
b = torch.randn(16, 16, device=dev, generator=gen)
with torch.autocast(dev.type, dtype=torch.bfloat16):
    plain = torch.mm(a, b)
    out32 = torch.empty(16, 16, device=dev)
    returned = torch.mm(a, b, out=out32)
    try:
        torch.mm(a, b, out=torch.empty(16, 16, device=dev, dtype=torch.bfloat16))
        out16_error = None
    except RuntimeError as err:
        out16_error = str(err)
print(f"mm(fp32, fp32)                -> {plain.dtype}")
print(f"mm(fp32, fp32, out=fp32)      -> {returned.dtype} (the out tensor itself: "
      f"{returned is out32})")
print(f"mm(fp32, fp32, out=bf16) raises: {out16_error}")
assert plain.dtype == torch.bfloat16
assert returned is out32 and returned.dtype == torch.float32
assert out16_error is not None

# %%
# What we saw
# -----------
# - Under autocast, reductions, softmax and norms return the dtypes in the first table; the
#   ones autocast runs in float32 (such as ``prod`` here) return float32.
# - ``dtype=`` sets the output dtype of a reduction or softmax, even against autocast.
# - With ``out=``, autocast leaves the call alone: the inputs keep their dtype, and an ``out``
#   of another dtype raises.
#
# .. admonition:: References
#
#    :torchdoc:`amp.html#autocast-op-reference`, :torchapi:`torch.softmax`,
#    :torchapi:`torch.sum`, :torchapi:`torch.mm`

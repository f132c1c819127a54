"""
fp8 scales from a bf16 amax, per backend
========================================

The usual fp8 recipe scales a tensor by ``fp8_max / amax`` before the cast, with ``amax`` the
largest magnitude of the tensor. When the tensor is bf16, so is ``amax``, and eager, ``aot_eager``
and inductor can return different scales for the same line of Python. We compute the scale under
each backend on this build's device, read the graph to see which intermediates are bf16, and
show what ``emulate_precision_casts`` and an explicit float32 ``amax`` change. Eager rounds the
reciprocal and the product to bf16; inductor keeps both in float32; emulation brings eager's
scale back (on the CPU since torch 2.13); a float32 ``amax`` makes every backend agree.
"""

# %%
# Setup
# -----
import torch

from mpguide.compiled import backends, graphs
from mpguide.core import device, versions
from mpguide.core.table import Table

dev = device.pick()
device.describe(dev)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
gen = torch.Generator(device=dev).manual_seed(0)
x = (3.3 * torch.randn(256, 1024, device=dev, generator=gen)).to(torch.bfloat16)
amax = x.abs().amax()
print(f"fp8 max {FP8_MAX}, amax {amax.item()} ({amax.dtype})")


def scale_bf16_amax(x):
    return (FP8_MAX / x.abs().amax()).float()


def scale_fp32_amax(x):
    return FP8_MAX / x.abs().amax().float()


# %%
# The scale under each backend
# ----------------------------
scales = {
    fn.__name__: {b: backends.run(fn, (x,), b) for b in backends.BACKENDS}
    for fn in (scale_bf16_amax, scale_fp32_amax)
}
exact = FP8_MAX / amax.double().item()
Table(
    ("recipe", *backends.BACKENDS),
    tuple((name, *(f"{s[b].item():.9g}" for b in backends.BACKENDS)) for name, s in scales.items()),
    f"scale = {FP8_MAX:g} / amax; exact {exact:.9g}; {device.describe(dev).caption()}",
)

# %%
# Why: the graph rounds twice, inductor's kernel does not
# -------------------------------------------------------
# ``FP8_MAX / amax`` with a bf16 ``amax`` becomes ``reciprocal(amax) * FP8_MAX``, both in bf16,
# and only then the cast to float32. Eager and ``aot_eager`` round after each; inductor fuses the
# reduction, the reciprocal and the product into one kernel that computes in float32 and stores
# only the float32 result.
aot = graphs.capture(scale_bf16_amax, x, backend="aot_eager")
dtypes = {str(n.target): n.meta["val"].dtype for n in aot.forward.graph.nodes
          if n.op == "call_function"}
print(aot.render())
assert dtypes["aten.reciprocal.default"] == torch.bfloat16
assert dtypes["aten.mul.Tensor"] == torch.bfloat16

# %%
got = scales["scale_bf16_amax"]
rounded_twice = ((1 / amax.float()).to(torch.bfloat16).float() * FP8_MAX).to(torch.bfloat16)
in_float32 = (1 / amax.float()) * FP8_MAX
assert got["eager"].item() == got["aot_eager"].item() == rounded_twice.item()
assert got["inductor"].item() == in_float32.item()
assert got["eager"].item() != got["inductor"].item()
# Emulation gives eager's scale where inductor's kernel honours it, the CPU's since torch 2.13:
kept = versions.change("inductor_cpu_bf16_round_trip")
print(kept.describe())
emulated = got["eager"] if kept.holds or dev.type != "cpu" else got["inductor"]
assert got[backends.EMULATE].item() == emulated.item()
print(f"eager and aot_eager: {got['eager'].item()} (rounded to bf16 twice); inductor: "
      f"{got['inductor'].item():.9g} (float32); with emulate_precision_casts: "
      f"{got[backends.EMULATE].item()}")

# %%
# With ``amax`` taken to float32 before the division, there is no bf16 intermediate left and the
# four backends agree bit for bit.
same = scales["scale_fp32_amax"]
assert len({same[b].item() for b in backends.BACKENDS}) == 1
assert same["eager"].item() == in_float32.item()

# %%
# Both recipes as bars: each backend's scale against the exact ``fp8_max / amax``, by
# :func:`mpguide.precision.numerics.errors` (for one value, ``|scale - exact| / exact``), on a log scale.
# With a bf16 ``amax`` the roundings of eager, ``aot_eager`` and emulation stand out; with a
# float32 ``amax`` every backend has the float32 rounding of the same division.
from mpguide import plots
from mpguide.precision import numerics

reference = torch.tensor(exact, dtype=torch.float64)
_ = plots.backend_bars(
    {name: {b: numerics.errors(v.cpu(), reference).max_rel for b, v in s.items()}
     for name, s in scales.items()},
    "|scale - exact| / exact",
    title=f"scale = {FP8_MAX:g} / amax, amax {amax.item():g} in bf16, "
    f"{device.describe(dev).caption()}",
)

# %%
# The same graphs for CUDA
# ------------------------
# The graph each backend receives on CUDA (from a GPU, or simulated from this build's dispatch
# rules where there is none) has the same two bf16 intermediates: the rounding is in the graph on
# both devices. Whether CUDA's generated kernel drops it, as the CPU's does, is a question about
# code generation and numerics: it needs hardware, and this page does not answer it.
cuda = device.target("cuda")
with device.tensors(cuda):
    (cuda_x,) = graphs.inputs(["bf16[256, 1024]"], cuda.device)
    cuda_graphs = {b: graphs.capture(scale_bf16_amax, cuda_x, backend=b)
                   for b in ("aot_eager", "inductor")}
for b, g in cuda_graphs.items():
    kinds = {op: t for op, t in g.nodes() if op in ("aten.reciprocal", "aten.mul.Tensor")}
    print(f"{g.label}: reciprocal {kinds['aten.reciprocal']}, mul {kinds['aten.mul.Tensor']}")
    assert kinds == {"aten.reciprocal": "bf16[]", "aten.mul.Tensor": "bf16[]"}, b
graphs.side_by_side(aot, cuda_graphs["aot_eager"])

# %%
# Does the rounding matter?
# -------------------------
# The bf16 scale can round up, and then ``amax * scale`` lands above the fp8 maximum. For every
# bf16 ``amax`` in [1, 16) we compute eager's bf16 scale and the scaled ``amax``; the cast to
# ``float8_e4m3fn`` saturates such values to the maximum, so the tensor's largest element is
# silently clipped.
values = torch.arange(0x3F80, 0x4180, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
bf16_scales = FP8_MAX / values
scaled = values.float() * bf16_scales.float()
over = scaled > FP8_MAX
print(f"{int(over.sum())} of {values.numel()} bf16 amax values in [1, 16) give amax * scale above "
      f"{FP8_MAX:g}, up to {scaled.max().item():.6g}; cast to fp8: "
      f"{scaled[over].max().to(FP8).float().item():g}")
assert over.any()
assert scaled[over].to(FP8).float().eq(FP8_MAX).all()
assert ((values.float() * (1 / values.float()) * FP8_MAX) <= FP8_MAX * (1 + 2**-23)).all()

# %%
# What we saw
# -----------
# - With a bf16 ``amax``, ``FP8_MAX / amax`` is a bf16 reciprocal and a bf16 product: eager and
#   ``aot_eager`` round twice, inductor computes in float32 and returns a different scale.
# - ``emulate_precision_casts`` gives eager's scale under inductor (on the CPU since torch 2.13;
#   before, the CPU kernel ignored it and gave inductor's).
# - The graphs for CUDA (simulated without a GPU) carry the same bf16 reciprocal and product;
#   what its kernels compute needs hardware.
# - Taking ``amax`` to float32 first makes every backend agree.
# - A bf16 scale rounded up pushes ``amax * scale`` past the fp8 maximum for about half of all
#   bf16 ``amax`` values in [1, 16); the saturating cast clips the largest element.
#
# .. admonition:: References
#
#    :torchapi:`torch.amax`, :torchapi:`torch.finfo`, :torchapi:`torch.compile`,
#    :torchdoc:`torch.compiler_troubleshooting.html`

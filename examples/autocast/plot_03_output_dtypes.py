"""
Output dtypes of reductions, softmax and norms, per device
==========================================================

Under autocast, what dtype do reductions, softmax and norms return when the activations are
bf16, and why is the answer float32 on CUDA and bf16 on the CPU? What do an explicit ``dtype=``
argument or an ``out=`` tensor change? We call each op on the CPU and on CUDA (on a GPU, or
simulated from this build's dispatch rules where there is none) and log every op autocast
sends to the dispatcher: CUDA autocast adds a ``dtype=float32`` argument or a cast before the op,
the CPU's adds neither, and ``dtype=`` opts an op out of autocast on CUDA but not on the CPU.
"""

# %%
# Setup
# -----
import torch
import torch.nn.functional as F

from mpguide.autocast import policy
from mpguide.core import device, dtypes, versions
from mpguide.core.table import Table

dev = device.pick()
device.describe(dev)
cpu, cuda = device.target("cpu"), device.target("cuda")
print(f"cpu: {cpu.how}; cuda: {cuda.how}")

# %%
# bf16 activations through common ops
# -----------------------------------
# Each call makes a bf16 activation on the device it is given (and, for the norms, float32
# weight and bias, as a model's would be). :func:`mpguide.autocast.policy.observe` runs it under bf16
# autocast on one device and keeps the output dtype, every op that reached the dispatcher, and
# the casts autocast added.


def bf16(d):
    return torch.randn(8, 64, device=d).to(torch.bfloat16)


calls = {
    "sum": lambda d: bf16(d).sum(),
    "mean": lambda d: bf16(d).mean(),
    "prod": lambda d: bf16(d).prod(-1),
    "cumsum": lambda d: bf16(d).cumsum(-1),
    "softmax": lambda d: torch.softmax(bf16(d), -1),
    "log_softmax": lambda d: torch.log_softmax(bf16(d), -1),
    "layer_norm": lambda d: F.layer_norm(
        bf16(d), (64,), torch.ones(64, device=d), torch.zeros(64, device=d)
    ),
    "rms_norm": lambda d: F.rms_norm(bf16(d), (64,), torch.ones(64, device=d)),
}
seen = {(name, t.device.type): policy.observe(fn, t) for name, fn in calls.items()
        for t in (cpu, cuda)}
Table(
    ("op", "cpu output", "cuda output"),
    tuple((name, seen[name, "cpu"].out, seen[name, "cuda"].out) for name in calls),
    f"bf16 input under bf16 autocast, torch {torch.__version__}; cpu: {cpu.how}; "
    f"cuda: {cuda.how}",
)

# %%
# Every output dtype is asserted, by name, and against the policy probe of the same device:
# the probe's bf16-input run for the one-input ops, its mixed run (bf16 activation, float32
# weights) for the norms.
rms_norm = versions.change("rms_norm_cuda_autocast")
print(rms_norm.describe())
float32_on_cuda = {"sum", "prod", "cumsum", "softmax", "log_softmax", "layer_norm"}
float32_on_cuda |= {"rms_norm"} if rms_norm.holds else set()
float32_on_cpu = {"prod"}
for (name, kind), run in seen.items():
    want = float32_on_cuda if kind == "cuda" else float32_on_cpu
    assert run.out == (torch.float32 if name in want else torch.bfloat16), (name, kind, run.out)
probes = {
    t.device.type: policy.probe(t, torch.bfloat16,
                                ops=[op for op in policy.CATALOGUE if op.name in calls])
    for t in (cpu, cuda)
}
for (name, kind), run in seen.items():
    probed = probes[kind][name]
    assert run.out == (probed.mixed_in if name.endswith("_norm") else probed.low_in).out, name
print("every output dtype agrees with the policy probe of its device")

# %%
# Why CUDA returns float32: what autocast sends to the dispatcher
# ---------------------------------------------------------------
# The log sits below autocast, so it shows the ops autocast really called. For ``sum`` CUDA
# autocast calls the op with ``dtype=float32`` added; for ``softmax`` too, and ``softmax``'s
# composite then casts the input to float32 itself (the log shows the same ops as
# ``softmax(x, dtype=float32)``, asserted below); for ``layer_norm`` it casts the input to
# float32 first. The CPU's autocast calls each op as written.
# (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
rows = []
for name in ("sum", "softmax", "layer_norm"):
    for t in (cpu, cuda):
        for c in seen[name, t.device.type].calls:
            if c.op not in ("aten.randn.default", "aten.ones.default", "aten.zeros.default"):
                rows.append((name, t.device.type, *c.row()))
Table(("call", "device", "op", "in", "dtype=", "out"), tuple(rows),
      "ops reaching the dispatcher under bf16 autocast (input creation left out)")

# %%
sum_cuda = [c for c in seen["sum", "cuda"].calls if c.op == "aten.sum.default"]
sum_cpu = [c for c in seen["sum", "cpu"].calls if c.op == "aten.sum.default"]
assert [c.dtype_arg for c in sum_cuda] == [torch.float32]
assert [c.dtype_arg for c in sum_cpu] == [None]
assert seen["softmax", "cuda"].casts == ((torch.bfloat16, torch.float32),)
assert seen["softmax", "cpu"].casts == ()
assert seen["layer_norm", "cuda"].casts == ((torch.bfloat16, torch.float32),)
print("cuda: sum and softmax get dtype=float32, layer_norm a bf16 -> float32 cast; cpu: neither")

# %%
# RMSNorm on the CPU: a warning, and a float32 detour
# ---------------------------------------------------
# With a bf16 activation and a float32 weight, the CPU prints a warning that the fused kernel
# cannot take mismatched dtypes. The log shows the consequence: ``rms_norm`` falls back to its
# composite form, which computes in float32 (``pow``, ``mean``, ``rsqrt``) and casts the result
# back to bf16. Since torch 2.12 the CUDA call gets no warning, because autocast already made
# every input float32, and keeps the float32 result.
# (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
cpu_rms = seen["rms_norm", "cpu"]
print(cpu_rms.warning)
assert cpu_rms.warning is not None and "Cannot dispatch to fused implementation" in cpu_rms.warning
if rms_norm.holds:
    assert seen["rms_norm", "cuda"].warning is None
cpu_ops = [c.op for c in cpu_rms.calls]
assert "aten.rsqrt.default" in cpu_ops
assert cpu_rms.calls[-1].conversion == (torch.float32, torch.bfloat16)

# %%
# ``dtype=`` picks the output dtype, and on CUDA opts out of autocast
# --------------------------------------------------------------------
# Passing ``dtype=`` sets the output dtype on both devices. On CUDA, ``sum``, ``prod``,
# ``cumsum`` and ``softmax`` are ops autocast only adds ``dtype=float32`` to when the caller gave
# none, so a given ``dtype=`` leaves them alone. On the CPU ``prod`` is on autocast's float32 list:
# autocast still casts its bf16 input to float32, and the op then returns the requested bf16.
# (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
with_dtype = {
    "softmax(x, dtype=float32)": lambda d: torch.softmax(bf16(d), -1, dtype=torch.float32),
    "softmax(x, dtype=bfloat16)": lambda d: torch.softmax(bf16(d), -1, dtype=torch.bfloat16),
    "sum(x, dtype=float32)": lambda d: bf16(d).sum(dtype=torch.float32),
    "sum(x, dtype=bfloat16)": lambda d: bf16(d).sum(dtype=torch.bfloat16),
    "prod(x, dtype=bfloat16)": lambda d: bf16(d).prod(-1, dtype=torch.bfloat16),
    "cumsum(x, dtype=bfloat16)": lambda d: bf16(d).cumsum(-1, dtype=torch.bfloat16),
}
given = {(name, t.device.type): policy.observe(fn, t) for name, fn in with_dtype.items()
         for t in (cpu, cuda)}


def casts(run):
    return ", ".join(f"{dtypes.name(a)}->{dtypes.name(b)}" for a, b in run.casts)


Table(
    ("call on a bf16 x", "cpu output", "cpu: autocast casts", "cuda output",
     "cuda: autocast casts"),
    tuple((name, given[name, "cpu"].out, casts(given[name, "cpu"]),
           given[name, "cuda"].out, casts(given[name, "cuda"])) for name in with_dtype),
    "dtype= under bf16 autocast",
)

# %%
for name, run in given.items():
    assert run.out == (torch.float32 if "float32" in name[0] else torch.bfloat16), name
prod_cpu, prod_cuda = given["prod(x, dtype=bfloat16)", "cpu"], given["prod(x, dtype=bfloat16)", "cuda"]
assert prod_cpu.casts == ((torch.bfloat16, torch.float32),)
assert prod_cuda.casts == ()
assert seen["sum", "cuda"].out == torch.float32
assert given["sum(x, dtype=bfloat16)", "cuda"].out == torch.bfloat16
assert given["softmax(x, dtype=bfloat16)", "cuda"].casts == ()  # no cast: the op is left alone


def ops(run):
    return [(c.op, c.ins, c.out) for c in run.calls if c.op != "aten.randn.default"]


assert ops(seen["softmax", "cuda"]) == ops(given["softmax(x, dtype=float32)", "cuda"])
print("prod(dtype=bf16): the CPU's autocast still casts the input, CUDA's does not")

# %%
# ``out=`` switches autocast off for that call
# --------------------------------------------
# An op called with ``out=`` is not cast by autocast: float32 inputs multiply in float32 into
# a float32 ``out``, and an ``out`` of another dtype than the inputs raises. This runs on this
# build's device.
gen = torch.Generator(device=dev).manual_seed(0)
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
# The output dtypes as a map
# --------------------------
# Every call above on a bf16 activation, with and without ``dtype=``, under bf16 autocast on
# the CPU and on CUDA, coloured by the dtype it returned.
# (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
from mpguide import plots

every_call = {**seen, **given}
_ = plots.dtype_grid(
    Table(
        ("call on a bf16 x", *(device.label(t.device.type, t.how) for t in (cpu, cuda))),
        tuple((name, every_call[name, "cpu"].out, every_call[name, "cuda"].out)
              for name in (*calls, *with_dtype)),
    ),
    title=f"output dtype under bf16 autocast, torch {torch.__version__}",
)

# %%
# What we saw
# -----------
# - Under bf16 autocast, ``sum``, ``prod``, ``cumsum``, softmax and the norms return float32 on
#   CUDA; on the CPU only ``prod`` does, and the others keep bf16.
# - CUDA autocast gets there by adding ``dtype=float32`` (``sum``, and ``softmax``, whose
#   composite then casts its input itself: the same ops as ``softmax(x, dtype=float32)``) or by
#   a cast before the op (``layer_norm``); the CPU's does neither.
# - A bf16 activation with a float32 RMSNorm weight warns on the CPU and takes the composite,
#   float32 path, rounding the result back to bf16.
# - ``dtype=`` sets the output dtype on both devices; on CUDA it also stops autocast from
#   touching the op, while the CPU's autocast still casts the input of ``prod``.
# - With ``out=``, autocast leaves the call alone: the inputs keep their dtype, and an ``out``
#   of another dtype raises.
#   (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
#
# .. admonition:: References
#
#    :torchdoc:`amp.html#autocast-op-reference`, :torchapi:`torch.softmax`,
#    :torchapi:`torch.sum`, :torchapi:`torch.prod`, :torchapi:`torch.mm`,
#    :torchapi:`torch.nn.functional.rms_norm`

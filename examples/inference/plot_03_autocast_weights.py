"""
Autocast keeps the weights in fp32 and casts them on every call
===============================================================

Serving fp32 weights under :func:`torch.autocast` runs the matmuls in bf16, but does it save
memory? We compare parameter and peak memory with a model cast to bf16, then profile the
forward passes with :func:`mpguide.traces.profiling.profile_fn` and list the casts with
:func:`mpguide.traces.casts.report` (the chapter 2 tools). Autocast leaves the weights in fp32,
allocates bf16 copies of them during each forward pass, and casts them again on every call.
"""

# %%
# Setup
# -----
import torch
from torch import nn

from mpguide.core import device

dev = device.pick()
device.describe(dev)

torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(dev).eval()
mlp_bf16 = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(dev).eval()
mlp_bf16.load_state_dict(mlp.state_dict())
mlp_bf16.to(torch.bfloat16)
x = torch.randn(4, 256, device=dev)
n_tensors = len(list(mlp.parameters()))
print(f"an MLP with {n_tensors} parameter tensors, called on a batch of {x.shape[0]}")

# %%
# Memory: parameters and the peak of a forward pass
# -------------------------------------------------
# :func:`mpguide.core.timing.peak_memory` measures what a call allocates above what was allocated
# before it: the caching allocator's peak on CUDA, the profiler's allocation events on the CPU.
from mpguide.core import timing
from mpguide.core.table import Table
from mpguide.models import inference


def autocast_forward():
    with torch.inference_mode(), torch.autocast(dev.type, dtype=torch.bfloat16):
        return mlp(x)


def bf16_forward():
    with torch.inference_mode():
        return mlp_bf16(x.bfloat16())


with torch.autocast(dev.type, dtype=torch.bfloat16):
    weight_dtype_inside = mlp[0].weight.dtype
peaks = {
    "fp32 weights, autocast bf16": timing.peak_memory(autocast_forward, dev).peak_bytes,
    "weights cast to bf16": timing.peak_memory(bf16_forward, dev).peak_bytes,
}
params = {"fp32 weights, autocast bf16": inference.parameter_bytes(mlp),
          "weights cast to bf16": inference.parameter_bytes(mlp_bf16)}
Table(("model", "weights dtype", "parameters KiB", "peak of a forward KiB"),
      tuple((name, (weight_dtype_inside if "autocast" in name else mlp_bf16[0].weight.dtype),
             params[name] / 2**10, peaks[name] / 2**10) for name in peaks),
      f"batch of {x.shape[0]} on {dev.type}")

# %%
# Inside autocast the parameters are still float32, so parameter memory is twice the cast
# model's; and the forward pass under autocast allocates at least a bf16 copy of the weights
# on top, which the cast model never needs.
largest_weight_bf16 = max(p.numel() for p in mlp.parameters()) * 2
assert weight_dtype_inside == torch.float32
assert params["fp32 weights, autocast bf16"] == 2 * params["weights cast to bf16"]
assert peaks["fp32 weights, autocast bf16"] >= largest_weight_bf16
assert peaks["fp32 weights, autocast bf16"] > peaks["weights cast to bf16"]
print(f"autocast peak / cast-model peak: "
      f"{peaks['fp32 weights, autocast bf16'] / peaks['weights cast to bf16']:.1f}x")

# %%
# The casts in a trace, one autocast region per call
# --------------------------------------------------
# A server usually enters autocast per request. We profile three such calls and list every
# float32 -> bf16 cast in the call tree, with the op that caused it.
from mpguide.traces import casts, profiling

CALLS = 3
calls_tree = profiling.profile_fn(autocast_forward, wait=1, warmup=1, active=CALLS).tree()
per_call = casts.report(calls_tree)
per_call.summary("pair")

# %%
# Every call casts every weight and bias again (and the input): the parameter-shaped casts
# are ``calls x parameter tensors``.
shapes = {tuple(p.shape) for p in mlp.parameters()}


def weight_casts(report: casts.CastReport) -> int:
    return sum(c.shape in shapes and c.target == "bfloat16" for c in report)


print(f"{len(per_call)} casts in {CALLS} calls, {weight_casts(per_call)} of them of parameters; "
      f"caused by {', '.join(sorted({c.cause for c in per_call}))}")
assert weight_casts(per_call) == CALLS * n_tensors
assert {c.cause for c in per_call if c.shape in shapes} == {"aten::linear"}
per_call.table()

# %%
# The three calls as an icicle chart: each rectangle is an op, nested under its caller, in
# call order; an op's width is the number of ops without children below it, so the chart does
# not depend on this machine's timings. The casts and the ops inside them are orange: each
# call repeats the same casts before its matmuls.
from mpguide import plots

steps = calls_tree.steps()
fig = plots.icicle(steps, per_call, scale="ops", title=f"{CALLS} autocast calls on {dev.type}")
cast_boxes = {p.get_gid() for p in fig.axes[0].patches if p.get_gid() in
              {str(c.id) for c in per_call}}
assert len(steps) == CALLS and len(cast_boxes) == len(per_call)

# %%
# Several calls in one autocast region
# ------------------------------------
# Autocast has a cache for casts of leaf tensors that require grad, such as parameters, kept
# until the region exits. Whether it is used depends on the grad mode: we run the three calls
# in a single region under :class:`torch.no_grad` and under :func:`torch.inference_mode`.
modes = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
one_region = {}
for name, mode in modes.items():

    def three_calls(mode=mode):
        with mode(), torch.autocast(dev.type, dtype=torch.bfloat16):
            for _ in range(CALLS):
                mlp(x)

    one_region[name] = casts.report(profiling.profile_fn(three_calls).tree())
Table(("grad mode", "casts", "casts of parameters"),
      tuple((name, len(r), weight_casts(r)) for name, r in one_region.items()),
      f"{CALLS} calls in one autocast region on {dev.type}, torch {torch.__version__}")

# %%
# Under ``no_grad`` the cache works: each parameter is cast once for the whole region. Under
# ``inference_mode`` this torch casts the parameters again on every call, as if each call had
# its own region.
assert weight_casts(one_region["no_grad"]) == n_tensors
assert weight_casts(one_region["inference_mode"]) == CALLS * n_tensors

# %%
# The model cast to bf16 once has nothing left to cast in its forward passes.
cast_model = casts.report(profiling.profile_fn(bf16_forward, active=CALLS).tree())
print(f"casts of parameters in {CALLS} calls of the bf16 model: {weight_casts(cast_model)}")
assert weight_casts(cast_model) == 0

# %%
# What we saw
# -----------
# - Under autocast the parameters stay float32: parameter memory is twice the bf16-cast
#   model's, and each forward pass allocates bf16 copies of the weights on top (asserted).
# - The trace shows ``aten::linear`` casting every weight and bias from float32 to bf16 on
#   every call made in its own autocast region.
# - In one region, autocast's cast cache saves the repeated casts under ``no_grad`` but not
#   under ``inference_mode``, where every call casts the parameters again.
# - The model cast once (``model.to(torch.bfloat16)``) casts no parameters in its forward
#   passes; its activations are bf16 too, with the errors measured in the first example.
#
# .. admonition:: References
#
#    :torchapi:`torch.autocast`, :torchdoc:`amp.html`, :torchapi:`torch.inference_mode`,
#    :torchapi:`torch.no_grad`, :torchdoc:`profiler.html`

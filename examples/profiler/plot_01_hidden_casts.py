"""
The hidden casts of an autocast matmul
======================================

Under :func:`torch.autocast`, a matmul of a bf16 activation with an fp32 weight runs in bf16,
so something converts the weight, and nobody wrote that line. We profile one such matmul
with :func:`mpguide.traces.profiling.profile_fn`, print the call tree with the dtypes the profiler
recorded, and let :func:`mpguide.traces.casts.report` find the conversion: an ``aten::to`` of the
fp32 operand, made inside ``aten::matmul`` before the bf16 matmul runs.
"""

# %%
# Setup
# -----
# Everything below runs on the device :func:`mpguide.core.device.pick` chooses: CUDA when present,
# else the CPU.
import torch

from mpguide.core import device

dev = device.pick()
device.describe(dev)

# %%
# Profile one autocast matmul
# ---------------------------
# ``profile_fn`` calls the step once to wait, once to warm up, and records the third call
# with shapes and dtypes, then reads the exported chrome trace back.
from mpguide.traces.profiling import profile_fn

gen = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(64, 256, device=dev, generator=gen).to(torch.bfloat16)
weight = torch.randn(256, 512, device=dev, generator=gen)


def step():
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        return x @ weight


assert step().dtype == torch.bfloat16
recorded = profile_fn(step)
tree = recorded.tree()
tree

# %%
# The call tree
# -------------
# The outer ``aten::matmul`` is the call we wrote, with one bf16 and one fp32 input. Inside
# it, autocast converts the weight (``aten::to`` down to ``aten::copy_``) and calls
# ``aten::matmul`` again, now on two bf16 inputs.
matmul = next(n for n in tree.find("aten::matmul") if n.parent.name != "aten::matmul")
print(tree.render(matmul, fields=["Input Dims", "Input type"]))

assert matmul.field("Input type") == ["c10::BFloat16", "float"]
kids = [c.name for c in matmul.children]
assert "aten::to" in kids and kids[-1] == "aten::matmul"
inner = matmul.children[-1]
assert inner.field("Input type") == ["c10::BFloat16", "c10::BFloat16"]
copy = next(n for n in matmul.walk() if n.name == "aten::copy_")
assert copy.field("Input type")[:2] == ["c10::BFloat16", "float"]
assert copy.field("Input Dims")[0] == [256, 512]

# %%
# The same call as an icicle chart: each op is a rectangle under the op that called it, in
# call order, as wide as the ops without children below it; the cast, and the ops it ran,
# are orange.
from mpguide import plots
from mpguide.traces import casts

report = casts.report(tree)
fig = plots.icicle(matmul, report, scale="ops", title=f"one autocast matmul on {dev.type}")
ops_drawn = [p.get_gid() for p in fig.axes[0].patches]
assert len(ops_drawn) == sum(1 for n in matmul.walk() if not n.is_gpu)

# %%
# On a GPU the same tree goes on below the CPU ops: each op's runtime launch, and under it
# the kernel it started. The default rendering shows only the CPU side.
if dev.type == "cuda":
    print(tree.render(matmul, fields=[], gpu=True))
    assert matmul.gpu_time > 0

# %%
# The cast report
# ---------------
# :func:`mpguide.traces.casts.report`, which coloured the chart above, finds every conversion whose
# source and target dtypes differ, and names the op that caused it: the nearest ancestor that
# is not itself a cast.
report.table()

# %%
(cast,) = report.casts
assert cast.cause == "aten::matmul" and cast.op == "aten::to"
assert (cast.source, cast.target, cast.direction) == ("float32", "bfloat16", "down-cast")
assert cast.shape == (256, 512)
assert (cast.bytes_read, cast.bytes_written) == (256 * 512 * 4, 256 * 512 * 2)
print(
    f"the weight cast read {cast.bytes_read / 2**10:.0f} KiB and wrote "
    f"{cast.bytes_written / 2**10:.0f} KiB in {cast.cpu_us:.1f} us of CPU time"
    + (f" and {cast.gpu_us:.1f} us of GPU time" if dev.type == "cuda" else "")
    + f", {cast.share:.1%} of the profiled step"
)

# %%
# What we saw
# -----------
# - A bf16 x fp32 matmul under autocast contains a conversion nobody wrote: ``aten::to`` of
#   the fp32 weight to bf16, inside the ``aten::matmul`` call, before a bf16 x bf16 matmul.
# - The cast report finds it from the trace alone, with its cause, dtypes, shape and bytes;
#   its time and share of the step are what this build's machine measured.
# - Casting the weight once outside the step (or keeping a bf16 copy) removes it; the cast
#   comes back every step otherwise.
#
# .. admonition:: References
#
#    :torchapi:`torch.autocast`, :torchdoc:`profiler.html`,
#    :torchapi:`torch.profiler.profile`, :torchdoc:`amp.html#autocast-op-reference`

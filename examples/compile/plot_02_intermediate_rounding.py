"""
Roundings that inductor skips
=============================

Does inductor round where eager rounds? We compile a float32 -> bf16 -> float32 round trip and a
bf16 rotary embedding, look at the kernel inductor generates, and measure eager, inductor and
inductor with ``torch._inductor.config.emulate_precision_casts`` against float64. On the CPU,
inductor keeps intermediates of a fused kernel in float32 and drops the roundings in between, which
brings it closer to float64 than eager; since torch 2.13 ``emulate_precision_casts`` puts the
roundings back.
"""

# %%
# Setup
# -----
# Everything below runs on the device :func:`mpguide.core.device.pick` chooses: CUDA when present,
# else the CPU.
import torch

from mpguide.compiled import backends, compile_logs, graphs
from mpguide.core import device, versions

dev = device.pick()
device.describe(dev)

# %%
# What inductor does with a round trip changed inside the releases this guide supports; this
# page shows what the running torch does:
kept = versions.change("inductor_cpu_bf16_round_trip")
print(kept.describe())


# %%
# A round trip through bf16
# -------------------------
# The function rounds its float32 input to bf16, widens it back and scales it. The reference is
# the same arithmetic in float64 *without* the rounding: it measures how far each backend lands
# from the exact value, not which one obeys the code.
def round_trip(x):
    return x.to(torch.bfloat16).to(torch.float32) * 3.0


def round_trip_exact(x):
    return x.double() * 3.0


gen = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(4096, device=dev, generator=gen)
trip = backends.compare(
    round_trip, (x,), backends=("eager", "inductor", backends.EMULATE), reference=round_trip_exact
)
trip

# %%
# Eager rounds, so each element's relative error is that of one bf16 rounding, up to half a
# bf16 ulp. On the CPU, inductor's result sits at float32 accuracy: the rounding is gone; with
# ``emulate_precision_casts`` inductor equals eager bit for bit since torch 2.13 (before, the
# rounding was gone from the graph already and nothing brought it back). The assertions below
# check this on the CPU; on a GPU the printed numbers say what this build's device did. (The table's
# ``max |error| / mean |ref|`` divides by the mean; here each element is divided by its own
# reference value.)
bf16_half_ulp = torch.finfo(torch.bfloat16).eps / 2
fp32_eps = torch.finfo(torch.float32).eps
exact = round_trip_exact(x)
rel = {
    o.backend: ((o.output.double() - exact).abs() / exact.abs()).max().item()
    for o in trip.outcomes
}
print(", ".join(f"{b}: largest element-wise relative error {e:.3g}" for b, e in rel.items()))
print(f"(bf16 half ulp {bf16_half_ulp:.3g}, float32 eps {fp32_eps:.3g})")
assert 100 * fp32_eps < rel["eager"] <= bf16_half_ulp
emulates = trip[backends.EMULATE].equals_eager
print(f"on {dev.type}, emulate_precision_casts reproduces eager bit for bit: {emulates}")
if dev.type == "cpu":
    assert rel["inductor"] <= fp32_eps
    assert emulates is kept.holds
    assert trip["inductor"].equals_eager is False

# %%
# Where the rounding goes
# -----------------------
# Since torch 2.13 the graph inductor lowers still has both ``convert_element_type`` nodes;
# before, inductor's ``pointless_convert`` pass replaced the pair by one conversion to float32.
plain = graphs.capture(round_trip, x, backend="inductor")
converts = [n for n in plain.forward.graph.nodes if "convert_element_type" in str(n.target)]
print(plain.render())
graph_converts = [torch.bfloat16, torch.float32] if kept.holds else [torch.float32]
assert [n.meta["val"].dtype for n in converts] == graph_converts

# %%
# In the fused kernel inductor generated, the value is converted to bf16 into a temporary that
# nothing reads (since 2.13; before, the graph had no bf16 conversion to generate): the multiply
# uses the float32 input. :func:`mpguide.compiled.compile_logs.unused_conversions` finds such
# lines. We print the kernel's lines that compute values (``tmp`` variables).
import re


def computing_lines(kernel):
    return "\n".join(ln.strip() for ln in kernel.splitlines() if re.search(r"\btmp\d", ln))


(kernel,) = plain.kernels()
dropped = compile_logs.unused_conversions(kernel)
print(computing_lines(kernel))
print("conversion computed and never read:", *dropped, sep="\n  ")

# %%
# With ``emulate_precision_casts`` the kernel converts back from bf16 and multiplies the rounded
# value (since 2.13, where the graph still has the round trip).
emulated = graphs.capture(round_trip, x, backend=backends.EMULATE)
(emulated_kernel,) = emulated.kernels()
print(computing_lines(emulated_kernel))
print(
    f"unused conversions: {len(dropped)} by default, "
    f"{len(compile_logs.unused_conversions(emulated_kernel))} when emulating"
)
if dev.type == "cpu":
    assert len(dropped) == (1 if kept.holds else 0)
    assert compile_logs.unused_conversions(emulated_kernel) == []
    assert ("bfloat16" in computing_lines(emulated_kernel).lower()) is kept.holds


# %%
# The graph for CUDA
# ------------------
# Is the rounding already gone from the graph inductor lowers for CUDA? We capture it from a GPU
# when this build has one, else simulated from this build's dispatch rules with fake tensors
# (see :func:`mpguide.core.device.target`); a simulated capture generates no kernel, and its label
# says so.
cuda = device.target("cuda")
with device.tensors(cuda):
    cuda_plain = graphs.capture(
        round_trip, *graphs.inputs(["f32[4096]"], cuda.device), backend="inductor"
    )
cpu_plain = plain if dev.type == "cpu" else graphs.capture(round_trip, x.cpu(), backend="inductor")
graphs.side_by_side(cpu_plain, cuda_plain)

# %%
# Since torch 2.13 both devices get the same graph, node for node, with both
# ``convert_element_type`` nodes: whether a rounding survives is decided when inductor generates
# the kernel, which only a GPU can show for CUDA. Before 2.13 the ``pointless_convert`` pass
# removed the pair on every device; a simulated capture does not run inductor's pattern passes
# (its label says so), so there the simulated CUDA graph keeps the pair and differs from the CPU.
same_graph = cpu_plain.nodes() == cuda_plain.nodes()
print(f"{cuda_plain.label}: same graph as the cpu: {same_graph}")
print(f"kernels in the cuda capture: {len(cuda_plain.kernels())} ({cuda_plain.obtained})")
assert same_graph is (kept.holds or not cuda.simulated)
cuda_keeps_pair = kept.holds or cuda.simulated
assert [t for op, t in cuda_plain.nodes() if op == "prims.convert_element_type"] == (
    ["bf16[4096]", "f32[4096]"] if cuda_keeps_pair else ["f32[4096]"]
)
assert bool(cuda_plain.kernels()) != cuda.simulated


# %%
# A case that matters: rotary embeddings in bf16
# ----------------------------------------------
# Rotary position embeddings multiply a bf16 query by bf16 cosines and sines and add the two
# products. Eager rounds each product to bf16 before the addition; inductor fuses the three ops
# and rounds once. The reference is the same function on the same bf16 values in float64.
def rotary(q, cos, sin):
    q1, q2 = q.chunk(2, dim=-1)
    return q * cos + torch.cat((-q2, q1), dim=-1) * sin


angles = torch.randn(256, 64, device=dev, generator=gen)
q = torch.randn(256, 64, device=dev, generator=gen).to(torch.bfloat16)
cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
rope = backends.compare(
    rotary, (q, cos, sin), backends=("eager", "inductor", backends.EMULATE)
)
rope

# %%
# On the CPU, inductor's output is closer to float64 than eager's, and with
# ``emulate_precision_casts`` it equals eager since 2.13 (asserted there; printed on every device). The relative error is large where the two products nearly cancel and the exact
# result is close to zero, so the absolute error is the better summary here.
abs_err = {o.backend: o.max_abs for o in rope.outcomes}
print(", ".join(f"{b}: max abs error {e:.3g}" for b, e in abs_err.items()))
closer = min(abs_err, key=abs_err.get)
print(f"closest to float64: {closer}")
assert all(o.dtype == "bfloat16" for o in rope.outcomes)
if dev.type == "cpu":
    assert closer == "inductor"
    assert rope[backends.EMULATE].equals_eager is kept.holds  # before 2.13 the graph lost them

# %%
# Both cases as bars: each backend's largest absolute error against float64 (the round trip
# against the exact value without the rounding, the rotary embedding against the same bf16
# values in float64), on a log scale.
from mpguide import plots

_ = plots.comparison_bars({"round trip through bf16": trip, "bf16 rotary embedding": rope},
                          title="against float64")

# %%
# What we saw
# -----------
# - On the CPU, inductor drops the bf16 rounding of a round trip. Since torch 2.13 the graph
#   has the ``convert_element_type`` nodes and the fused kernel computes the bf16 value and never
#   reads it; before, inductor's ``pointless_convert`` pass removed the pair from the graph.
# - Without the roundings inductor is closer to float64 than eager, for the round trip and for
#   bf16 rotary embeddings (asserted on the CPU, printed above for this build's device).
# - Since 2.13 the graph inductor lowers keeps both conversions on the CPU and for CUDA (live or
#   simulated, as labelled): dropping the rounding is a decision of code generation, not of the
#   graph.
# - ``torch._inductor.config.emulate_precision_casts`` restores the roundings since 2.13; on the
#   CPU the result then equals eager bit for bit (the line printed above says whether it did on
#   this build's device). Before 2.13 it could not: the graph had lost the rounding. Set it, through ``torch._inductor.config.patch``, when you need
#   compiled results closer to eager than to float64. It restores roundings, not the order of
#   reductions: on a bf16 RMSNorm a few elements still differ from eager (the RMSNorm page of
#   this chapter counts them).
#
# .. admonition:: References
#
#    :torchapi:`torch.compile`, :torchdoc:`torch.compiler.html`,
#    :torchapi:`torch.Tensor.to`

"""
Autocast around a compiled block
================================

Where do autocast's casts go when :func:`torch.autocast` wraps a compiled function? We record
the dtype changes eager PyTorch makes for a small linear-softmax block under autocast, forward and
backward, and compare them with the graphs AOTAutograd builds for ``aot_eager`` and inductor.
Autocast leaves no trace of itself in the graphs: its casts are traced in as ordinary conversions
at the same places as in eager, the backward graph casts the gradients back to the parameters'
float32, and inductor (on the CPU) adds conversions of its own around the ops it computes in
float32.
"""

# %%
# Setup
# -----
# Everything below runs on the device :func:`mpguide.core.device.pick` chooses: CUDA when present,
# else the CPU.
import torch

from mpguide.compiled import backends, graphs
from mpguide.core import device

dev = device.pick()
device.describe(dev)

# %%
# The block
# ---------
# A float32 linear layer followed by a softmax. The layer's parameters require grad, so
# AOTAutograd builds a backward graph too. Autocast wraps the call, not the function.
torch.manual_seed(0)
linear = torch.nn.Linear(32, 16, device=dev)
x = torch.randn(8, 32, device=dev)


def block(x):
    return torch.softmax(linear(x), dim=-1)


autocast = torch.autocast(dev.type, dtype=torch.bfloat16)

# %%
# Eager under autocast
# --------------------
# :func:`mpguide.compiled.graphs.eager_flow` records the dtype changes at the dispatcher, where
# autocast's casts arrive as ``_to_copy`` calls, then runs the backward pass once (with ones as
# the output gradient, leaving ``.grad`` alone).
with autocast:
    eager = graphs.eager_flow(block, x)
eager

# %%
# The same call compiled
# ----------------------
# :func:`mpguide.compiled.graphs.capture` called inside the same autocast context.
with autocast:
    aot = graphs.capture(block, x, backend="aot_eager")
aot

# %%
# The forward graph starts with the casts autocast made in eager: the input, the weight and the
# bias to bf16, before ``addmm``. The backward graph ends with casts of the weight's and bias's
# gradients back to float32, the parameters' dtype, as the eager backward did.
aot.flow()

# %%
aot.flow("backward")

# %%
forward_rows, backward_rows = aot.flow().records(), aot.flow("backward").records()
assert [(r["in"], r["out"]) for r in forward_rows[:3]] == [("f32", "bf16")] * 3
(backward_output,) = [n for n in aot.backward.graph.nodes if n.op == "output"]
returned = {a.name for a in backward_output.args[0] if a is not None}
assert [(r["in"], r["out"]) for r in backward_rows[-2:]] == [("bf16", "f32")] * 2
assert {r["node"] for r in backward_rows[-2:]} <= returned


# %%
# We compare the conversions, as (from, to) pairs, phase by phase.
def conversions(table, phase=None):
    rows = table.records()
    return sorted(
        (r["in"], r["out"])
        for r in rows
        if r["change"] == "conversion" and (phase is None or r["phase"] == phase)
    )


same_forward = conversions(eager, "forward") == conversions(aot.flow())
same_backward = conversions(eager, "backward") == conversions(aot.flow("backward"))
print(f"eager forward conversions: {conversions(eager, 'forward')}")
print(f"eager backward conversions: {conversions(eager, 'backward')}")
print(f"aot_eager's graphs convert the same way: forward {same_forward}, backward {same_backward}")
assert same_forward and same_backward
assert ("f32", "bf16") in conversions(aot.flow())
assert set(conversions(aot.flow("backward"))) == {("bf16", "f32")}
autocast_nodes = [n for n in aot.forward.graph.nodes if "autocast" in str(n.target)]
assert autocast_nodes == []

# %%
# Inductor's graphs
# -----------------
# Inductor's decompositions add conversions of their own: an op that inductor computes in
# float32 (the softmax here, when autocast leaves it in bf16, as on the CPU) is wrapped in a
# conversion to float32 and one back, on top of autocast's casts.
with autocast:
    ind = graphs.capture(block, x, backend="inductor")
ind.flow()

# %%
ind.flow("backward")

# %%
# Every conversion of ``aot_eager``'s graphs is in inductor's too.
ind_forward, ind_backward = conversions(ind.flow()), conversions(ind.flow("backward"))
extra = (
    len(ind_forward)
    + len(ind_backward)
    - len(conversions(aot.flow()))
    - len(conversions(aot.flow("backward")))
)
print(f"inductor adds {extra} conversions to aot_eager's")
for pair in set(conversions(aot.flow())):
    assert ind_forward.count(pair) >= conversions(aot.flow()).count(pair)
for pair in set(conversions(aot.flow("backward"))):
    assert ind_backward.count(pair) >= conversions(aot.flow("backward")).count(pair)
if dev.type == "cpu":
    assert extra > 0


# %%
# The same block for CUDA
# -----------------------
# CUDA's autocast has another policy, and inductor decomposes for its device. We capture the
# block's graphs for CUDA from a GPU when this build has one, else simulated from this build's
# dispatch rules: a fake layer and input (see :func:`mpguide.core.device.tensors`) under CUDA's
# autocast (:func:`mpguide.core.device.autocast`), no kernel run. The captions say which; a simulated
# CUDA has no backward graph where this build cannot run autograd on CUDA, and says so.
import copy


def captures_on(target, layer, x):
    """aot_eager's and inductor's graphs of the block around ``layer`` under bf16 autocast."""

    def block_on(x):
        return torch.softmax(layer(x), dim=-1)

    with device.autocast(target, torch.bfloat16):
        return tuple(graphs.capture(block_on, x, backend=b) for b in ("aot_eager", "inductor"))


cuda = device.target("cuda")
with device.tensors(cuda):
    cuda_aot, cuda_ind = captures_on(
        cuda,
        torch.nn.Linear(32, 16, device=cuda.device),
        *graphs.inputs(["f32[8, 32]"], cuda.device),
    )
if dev.type == "cpu":
    cpu_aot, cpu_ind = aot, ind
else:
    cpu_aot, cpu_ind = captures_on(device.target("cpu"), copy.deepcopy(linear).cpu(), x.cpu())
graphs.side_by_side(cpu_aot, cuda_aot)

# %%
cuda_ind.flow()


# %%
# The softmax: CUDA's autocast (live on a GPU, simulated without one) runs it in float32, so its
# graph converts the ``addmm`` result to float32 before it, where the CPU's leaves it in bf16.
# Inductor then has nothing to widen on CUDA: its forward graph makes the same conversions as
# ``aot_eager``'s, while on the CPU it adds its own around the bf16 softmax.
def softmax_dtype(g):
    (node,) = [t for op, t in g.nodes() if op == "aten._softmax"]
    return node.split("[")[0]


cuda_extra = len(conversions(cuda_ind.flow())) - len(conversions(cuda_aot.flow()))
cpu_extra = len(conversions(cpu_ind.flow())) - len(conversions(cpu_aot.flow()))
print(f"softmax under autocast: cpu {softmax_dtype(cpu_aot)}, cuda {softmax_dtype(cuda_aot)}")
print(f"conversions inductor adds to the forward graph: cpu {cpu_extra}, cuda {cuda_extra}")
assert (softmax_dtype(cpu_aot), softmax_dtype(cuda_aot)) == ("bf16", "f32")
assert conversions(cuda_ind.flow()) == conversions(cuda_aot.flow())
assert cpu_extra > 0
assert ("bf16", "f32") in conversions(cuda_aot.flow())

# %%
# The four forward graphs as strips, one box per node in graph order, coloured by the dtype it
# returns, conversions outlined: autocast's casts to bf16 before ``addmm`` in every graph; on CUDA
# (simulated without a GPU) the cast of its result to float32 for the softmax; on the CPU inductor's
# own conversions around the bf16 softmax.
from mpguide import plots

_ = plots.graph_strips(cpu_aot, cpu_ind, cuda_aot, cuda_ind,
                       title=f"softmax(linear(x)) under bf16 autocast, forward graphs, torch "
                             f"{torch.__version__}")


# %%
# The outputs
# -----------
# Under autocast, the three backends return the dtype eager returns (bf16 on the CPU, where
# autocast leaves the softmax alone), and ``aot_eager`` gives eager's bits. The reference is the
# block in float64 with autocast turned off.
def block_fp64(x):
    with torch.autocast(dev.type, enabled=False):
        weight, bias = linear.weight.double(), linear.bias.double()
        return torch.softmax(torch.nn.functional.linear(x.double(), weight, bias), dim=-1)


with autocast:
    outputs = backends.compare(
        block, (x,), backends=("eager", "aot_eager", "inductor"), reference=block_fp64
    )
outputs

# %%
assert all(o.dtype == outputs["eager"].dtype for o in outputs.outcomes)
assert outputs["aot_eager"].equals_eager
if dev.type == "cpu":
    assert outputs["eager"].dtype == "bfloat16"

# %%
# What we saw
# -----------
# - Autocast wrapping a compiled function is traced into the graphs: no autocast node, only
#   conversions, the same ones eager makes, in the forward and in the backward graph.
# - The backward graph casts the gradients of float32 parameters back to float32.
# - Inductor's graphs keep those conversions and, on the CPU, add their own around the ops its
#   decompositions compute in float32; ``aot_eager`` matches eager bit for bit.
# - For CUDA (live or simulated, as labelled) autocast itself runs the softmax in float32, so
#   inductor's forward graph makes exactly ``aot_eager``'s conversions; on the CPU the softmax
#   stays bf16 and inductor adds its own.
#
# .. admonition:: References
#
#    :torchapi:`torch.autocast`, :torchdoc:`amp.html`, :torchapi:`torch.compile`

"""
Which graph should I look at?
=============================

``torch.compile`` turns a function into several graphs before any kernel runs, and each can be
printed. Which one shows the dtypes that will really be computed? We log every stage for one small
function with ``TORCH_LOGS`` and get the same graphs from :mod:`mpguide.compiled.graphs`. Dynamo's graph
shows your code as traced; AOTAutograd's forward and backward graphs show the ATen ops after
autocast and functionalization, and, under inductor, after its decompositions; the post-grad graph
and the generated code show what inductor made of them.
"""

# %%
# Setup
# -----
# Everything below runs on the device :func:`mpguide.core.device.pick` chooses: CUDA when present,
# else the CPU.
import torch

from mpguide.compiled import compile_logs, graphs
from mpguide.core import device

dev = device.pick()
device.describe(dev)

# %%
# The stages and their switches
# -----------------------------
# - Dynamo's traced graph, ``TORCH_LOGS=graph_code``: your Python calls as traced; the place to
#   look for graph breaks.
# - AOTAutograd's forward and backward graphs, ``TORCH_LOGS=aot_graphs``: ATen ops after
#   autocast and functionalization; :func:`mpguide.compiled.graphs.capture` with ``backend="aot_eager"``.
# - The same after inductor's decompositions, the graphs inductor lowers: ``aot_graphs`` with the
#   inductor backend; ``capture`` with ``backend="inductor"``.
# - After inductor's post-grad passes, ``TORCH_LOGS=post_grad_graphs``.
# - The generated code, ``TORCH_LOGS=output_code``; ``capture(..., backend="inductor").code``
#   and ``.kernels()``.
#
# We run one script with all four switches in a fresh Python, as you would run your own
# training script, and split what it logs by artifact with :func:`mpguide.compiled.compile_logs.torch_logs`.
# A compile served from torch.compile's caches skips stages, and their logs with them, so the
# script runs with the caches turned off (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``): do the same
# when a log you asked for stays empty.
SCRIPT = f"""
import torch

def scale_and_sin(x):
    return (x.to(torch.bfloat16) * 2).float().sin()

x = torch.randn(8, device="{dev.type}", requires_grad=True)
torch.compile(scale_and_sin)(x).sum().backward()
"""
ARTIFACTS = ["graph_code", "aot_graphs", "post_grad_graphs", "output_code"]
logs = compile_logs.torch_logs(SCRIPT, ARTIFACTS, cached=False)
for name in ARTIFACTS:
    print(f"TORCH_LOGS={name}: {len(logs[name].splitlines())} lines")
assert all(logs[name] for name in ARTIFACTS)


# %%
# A helper to print one graph of a log: from a line containing ``start`` to the graph's
# ``return``.
def section(text, start):
    lines = text.splitlines()
    first = next(i for i, ln in enumerate(lines) if start in ln)
    last = next(i for i in range(first, len(lines)) if lines[i].strip().startswith("return"))
    return "\n".join(lines[first : last + 1])


# %%
# Dynamo's graph: your code
# -------------------------
# ``graph_code`` prints the graph Dynamo traced, in terms of the Python calls you wrote
# (``.to``, ``.float()``). It is the place to look for graph breaks, not for precision.
print(section(logs["graph_code"], "def forward"))
assert ".to(torch.bfloat16)" in logs["graph_code"]

# %%
# AOTAutograd's graphs: the ATen ops and their dtypes
# ---------------------------------------------------
# ``aot_graphs`` prints the forward and backward graphs. With the default inductor backend they
# are already decomposed: ``.to`` became ``prims.convert_element_type``.
print(section(logs["aot_graphs"], "Forward graph"))
print()
print(section(logs["aot_graphs"], "Backward graph"))
assert "prims.convert_element_type" in logs["aot_graphs"]

# %%
# :func:`mpguide.compiled.graphs.capture` gives the same graphs as objects, here for inductor, in this
# process.


def scale_and_sin(x):
    return (x.to(torch.bfloat16) * 2).float().sin()


x = torch.randn(8, device=dev, requires_grad=True)
captured = graphs.capture(scale_and_sin, x, backend="inductor")
captured

# %%
# The nodes and dtypes are those the log printed: we read ``name: "dtype[...`` from the body of
# each logged graph and compare.
import re


def logged_nodes(text):
    return re.findall(r'^\s+(\w+): "([a-z0-9]+)\[', text, flags=re.MULTILINE)


def captured_nodes(gm):
    return [
        (n.name, graphs.node_type(n).split("[")[0])
        for n in gm.graph.nodes
        if n.op == "call_function"
    ]


for which, heading in (("forward", "Forward graph"), ("backward", "Backward graph")):
    same = logged_nodes(section(logs["aot_graphs"], heading)) == captured_nodes(
        captured.graphs()[which]
    )
    print(f"{which}: the logged graph and the captured graph have the same nodes: {same}")
    assert same

# %%
# After the post-grad passes
# --------------------------
# ``post_grad_graphs`` prints the forward graph again after inductor's pattern-matching and
# reordering passes; for a small function it is usually the same graph.
print(section(logs["post_grad_graphs"], "def forward"))

# %%
# The generated code
# ------------------
# ``output_code`` prints the module inductor generated; ``capture(...).code`` holds the same
# source and ``.kernels()`` the kernels in it. This is where a rounding in the graph can turn out
# to be computed and never used (see the previous example).
(kernel,) = captured.kernels()[:1]
print(kernel)
assert kernel in logs["output_code"]

# %%
# The same graphs for a device this machine lacks
# -----------------------------------------------
# The stages up to AOTAutograd's graphs need no kernel: given fake tensors, made inside
# :func:`mpguide.core.device.tensors` for a simulated device, :func:`mpguide.compiled.graphs.capture` traces
# them with Dynamo and AOTAutograd as on that device. For inductor it applies inductor's
# decompositions and partitioner but not the joint-graph pattern passes, which need the device
# to set up, and generates no code. On the CPU we can check the simulation against the real
# capture: the same ops with the same dtypes and shapes, node for node.
cpu_sim = device.target("cpu", simulate=True)
with device.tensors(cpu_sim):
    simulated = graphs.capture(
        scale_and_sin, *graphs.inputs(["f32[8]"], "cpu", requires_grad=True), backend="inductor"
    )
live_cpu = (
    captured
    if dev.type == "cpu"
    else graphs.capture(scale_and_sin, x.detach().cpu().requires_grad_(), backend="inductor")
)
for which in ("forward", "backward"):
    same = simulated.nodes(which) == live_cpu.nodes(which)
    print(f"{which}: the simulated cpu graph equals the real one: {same}")
    assert same

# %%
# For CUDA, from a GPU when this build has one, else simulated (the caption says which, and what a
# simulated capture leaves out). ``python -m mpguide graph FILE.py:FUNCTION --inputs f32[8]
# --device cuda`` prints the same for a function of yours (see :doc:`/docs/cli`).
cuda = device.target("cuda")
with device.tensors(cuda):
    on_cuda = graphs.capture(
        scale_and_sin,
        *graphs.inputs(["f32[8]"], cuda.device, requires_grad=not cuda.simulated),
        backend="inductor",
    )
on_cuda

# %%
# The forward graph for CUDA (live on a GPU, simulated without one) rounds to bf16 and widens
# back as on the CPU.
cuda_converts = [t for op, t in on_cuda.nodes() if op == "prims.convert_element_type"]
print(f"{on_cuda.label}: convert_element_type to {cuda_converts}")
assert cuda_converts[:2] == ["bf16[8]", "f32[8]"]
assert cuda_converts == [t for op, t in live_cpu.nodes() if op == "prims.convert_element_type"]

# %%
# The graphs to read, as strips: inductor's forward and backward graphs on the CPU and its forward
# graph for CUDA (simulated without a GPU), one box per node coloured by the dtype it returns,
# conversions outlined: the round to bf16 and back, then the float32 ``sin``.
from mpguide import plots

_ = plots.graph_strips(live_cpu, on_cuda, which=("forward", "backward"),
                       title=f"scale_and_sin, AOTAutograd's graphs for inductor, torch "
                             f"{torch.__version__}")

# %%
# What we saw
# -----------
# - ``graph_code`` shows your Python calls; the dtypes you should reason about start at
#   ``aot_graphs``, where autocast's casts and inductor's decompositions are in the graph.
# - :func:`mpguide.compiled.graphs.capture` returns the same forward and backward graphs as the
#   ``aot_graphs`` log, node for node, with their dtypes.
# - The generated code in ``output_code`` is what runs; ``capture(...).kernels()`` gives it too.
# - Fake tensors give the ``aot_graphs`` stage for a device the machine lacks; on the CPU the
#   simulated graphs equal the real ones node for node.
#
# .. admonition:: References
#
#    :torchdoc:`torch.compiler_troubleshooting.html`, :torchdoc:`logging.html`,
#    :torchapi:`torch._logging.set_logs`, :torchapi:`torch.compile`

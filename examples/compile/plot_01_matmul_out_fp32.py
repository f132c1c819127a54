"""
One matmul, three backends, three precisions
============================================

What precision does ``torch.matmul(x_bf16, y_bf16, out=fp32_tensor) + bias_bf16`` compute at?
We run it eagerly, under ``torch.compile(backend="aot_eager")`` and under inductor, capture the
graphs AOTAutograd hands each backend, follow their dtypes, and measure every result against the
float64 product of the same bf16 values. Eager refuses the call, ``aot_eager`` rounds the product
to bf16 before copying it into float32, and inductor on the CPU, after rewriting the small batched
matmul as a float32 multiply-and-sum, keeps the product in float32. Inductor's graph for CUDA, shown
beside it on every build (simulated from this build's dispatch rules where there is no GPU), keeps
the bf16 ``bmm``.
"""

# %%
# Setup
# -----
# Everything below runs on the device :func:`mpguide.core.device.pick` chooses: CUDA when present,
# else the CPU.
import torch

from mpguide.compiled import backends, graphs
from mpguide.core import device, versions

dev = device.pick()
device.describe(dev)

# %%
# The function
# ------------
# A batch of 224 dot products of length 8, shapes (32, 7, 1, 8) @ (32, 7, 8, 1), written into a
# float32 ``out=`` tensor, plus a bf16 bias.
gen = torch.Generator(device=dev).manual_seed(0)
x, y, bias = (
    torch.randn(*shape, device=dev, generator=gen).to(torch.bfloat16)
    for shape in ((32, 7, 1, 8), (32, 7, 8, 1), (32, 7, 1, 1))
)


def matmul_into_fp32(x, y, bias):
    out = torch.empty(32, 7, 1, 1, dtype=torch.float32, device=x.device)
    return torch.matmul(x, y, out=out) + bias


def exact(x, y, bias):
    """The float64 result on the same bf16 values: the reference."""
    return torch.matmul(x.double(), y.double()) + bias.double()


# %%
# Eager refuses
# -------------
# This torch checks the ``out=`` dtype against the bf16 result dtype and raises.
try:
    matmul_into_fp32(x, y, bias)
    eager_error = None
except RuntimeError as err:
    eager_error = str(err)
print(f"torch {torch.__version__}, eager: {eager_error}")
assert eager_error is not None and "Expected out tensor to have dtype" in eager_error

# %%
# The graphs each backend receives
# --------------------------------
# :func:`mpguide.compiled.graphs.capture` compiles the function with a backend and keeps the graphs
# AOTAutograd produced for it: the plain ATen graph for ``aot_eager``, the graph after inductor's
# decompositions for inductor, which is what inductor lowers to kernels. Side by side, each node
# shows its dtype, shape and op.
aot = graphs.capture(matmul_into_fp32, x, y, bias, backend="aot_eager")
ind = graphs.capture(matmul_into_fp32, x, y, bias, backend="inductor")
graphs.side_by_side(aot, ind)

# %%
# In full, with each node's arguments and the line of our code it came from, inductor's graph
# reads:
ind


# %%
# ``aot_eager`` runs the functionalized ATen graph: one ``bmm`` on bf16 operands returning bf16,
# then a ``copy`` into the float32 buffer that ``out=`` named. Functionalization replaced the
# out-variant by a plain op and a copy, which is why it runs where eager refuses.
def nodes(gm, target):
    return [n for n in gm.graph.nodes if str(n.target) == target]


(bmm,) = nodes(aot.forward, "aten.bmm.default")
(copy,) = nodes(aot.forward, "aten.copy.default")
print(f"aot_eager: bmm -> {bmm.meta['val'].dtype}, copy -> {copy.meta['val'].dtype}")
assert bmm.meta["val"].dtype == torch.bfloat16
assert copy.meta["val"].dtype == torch.float32

# %%
# Inductor's graph has no ``bmm`` on this device when its decompositions rewrite the small
# batched matmul as an elementwise multiply and a sum, with ``prims.convert_element_type``
# nodes taking the operands to float32 and the sum back to bf16 (the dtype ``bmm`` would
# return) before the copy.
ind_targets = [str(n.target) for n in ind.forward.graph.nodes]
decomposed = "aten.bmm.default" not in ind_targets
converts = [n.meta["val"].dtype for n in nodes(ind.forward, "prims.convert_element_type.default")]
print(f"inductor: bmm decomposed into mul + sum: {decomposed}; convert_element_type to {converts}")
if decomposed:
    (mul,) = nodes(ind.forward, "aten.mul.Tensor")
    assert mul.meta["val"].dtype == torch.float32
    assert converts == [torch.float32, torch.float32, torch.bfloat16]
if dev.type == "cpu":
    assert decomposed

# %%
# The same graphs for CUDA
# ------------------------
# :func:`mpguide.core.device.target` gives CUDA as this build has it: the GPU when there is one, else
# simulated. Tensors made inside :func:`mpguide.core.device.tensors` are then fake (shapes, dtypes and
# a device, no values), and :func:`mpguide.compiled.graphs.capture` traces them through Dynamo and
# AOTAutograd as on that device, running no kernel; :func:`mpguide.compiled.graphs.inputs` makes them from
# the graphs' own notation. Each column says how it was obtained.
cuda = device.target("cuda")
SPECS = ["bf16[32, 7, 1, 8]", "bf16[32, 7, 8, 1]", "bf16[32, 7, 1, 1]"]
with device.tensors(cuda):
    cuda_args = graphs.inputs(SPECS, cuda.device)
    cuda_aot = graphs.capture(matmul_into_fp32, *cuda_args, backend="aot_eager")
    cuda_ind = graphs.capture(matmul_into_fp32, *cuda_args, backend="inductor")
cpu_args = [t.cpu() for t in (x, y, bias)]
cpu_aot = aot if dev.type == "cpu" else graphs.capture(matmul_into_fp32, *cpu_args)
cpu_ind = (
    ind if dev.type == "cpu" else graphs.capture(matmul_into_fp32, *cpu_args, backend="inductor")
)
graphs.side_by_side(cpu_ind, cuda_ind)

# %%
# ``aot_eager`` gets the same graph on both devices, node for node (op, dtype and shape).
# Inductor's decompositions differ: on the CPU the batch of dot products becomes a float32
# multiply and sum, on CUDA (live on a GPU, simulated without one) the bf16 ``bmm`` stays, and
# the product is rounded to bf16 by the ``bmm`` itself.
cuda_ops = cuda_ind.nodes()
same_aot = cpu_aot.nodes() == cuda_aot.nodes()
print(f"aot_eager: the same graph on cpu and cuda: {same_aot}")
print(f"inductor on cuda: bmm kept: {('aten.bmm', 'bf16[224, 1, 1]') in cuda_ops}")
print(
    f"inductor on cpu: {', '.join(f'{op} -> {t}' for op, t in cpu_ind.nodes() if 'f32[224' in t)}"
)
assert same_aot
assert ("aten.bmm", "bf16[224, 1, 1]") in cuda_ops
assert not any(op == "prims.convert_element_type" for op, _ in cuda_ops)
assert "aten.bmm" not in [op for op, _ in cpu_ind.nodes()]
assert ("aten.mul.Tensor", "f32[224, 8]") in cpu_ind.nodes()
assert ("aten.sum.dim_IntList", "f32[224, 1]") in cpu_ind.nodes()

# %%
# Where the dtype changes
# -----------------------
# :func:`mpguide.compiled.graphs.dtype_flow` lists the nodes whose output dtype differs from an input,
# with the line of our code each came from.
aot.flow()

# %%
ind.flow()

# %%
# Against the float64 reference
# -----------------------------
# :func:`mpguide.compiled.backends.compare` runs the function under each backend (eager, which
# raises and gets its error in its row, ``aot_eager``, inductor, and inductor with
# ``emulate_precision_casts``) and measures each output against :func:`exact`.
table = backends.compare(matmul_into_fp32, (x, y, bias), reference=exact)
table

# %%
# ``aot_eager`` carries the error of one bf16 rounding of the product. Where inductor rewrote the
# ``bmm`` (the CPU), plain inductor is at float32 accuracy, although its graph has the rounding
# to bf16: the fused kernel adds the bias
# to the float32 sum and the rounded copy is never used. With
# ``torch._inductor.config.emulate_precision_casts`` the kernel keeps the rounding and the
# result equals ``aot_eager`` bit for bit, since torch 2.13; this torch:
kept = versions.change("inductor_cpu_bf16_round_trip")
print(kept.describe())
bf16_ulp = torch.finfo(torch.bfloat16).eps
fp32_eps = torch.finfo(torch.float32).eps
err = {o.backend: o.max_abs for o in table.outcomes}
print(", ".join(f"{b}: max abs error {e:.3g}" for b, e in err.items() if e is not None))
assert table["eager"].error.startswith("RuntimeError: Expected out tensor to have dtype")
assert all(o.dtype == "float32" for o in table.outcomes[1:])
if decomposed:
    assert err["inductor"] < err["aot_eager"] / 100
assert err["aot_eager"] > fp32_eps
emulated_same = torch.equal(table[backends.EMULATE].output, table["aot_eager"].output)
print(f"inductor + emulate_precision_casts equals aot_eager bit for bit: {emulated_same}")
if dev.type == "cpu":
    assert emulated_same is kept.holds

# %%
# The three answers as bars: each backend's largest error against the float64 product, on a log
# scale; eager has no bar, it raised.
from mpguide import plots

_ = plots.comparison_bars(
    {"matmul": table},
    title=f"bf16 matmul into a float32 out= plus a bf16 bias, against float64 ({table.reference})",
)

# %%
# The same comparison recorded on a GPU
# -------------------------------------
# The graphs above say what CUDA's inductor computes, not how accurately: that needs a GPU.
# Recordings made on GPU machines with ``nox -s record`` show the table there, labelled with their
# provenance.
from mpguide.core import record

record.beside(
    "compile.matmul_into_fp32",
    table.table() if dev.type == "cuda" else None,
    machine=device.describe(dev),
)

# %%
# What we saw
# -----------
# - On this torch, eager raises for a bf16 matmul written into a float32 ``out=``.
# - ``aot_eager`` runs the ``bmm`` in bf16 and copies the rounded product into float32.
# - On the CPU, inductor's decompositions turn this batch of dot products into a float32
#   multiply-and-sum; the graph still rounds the sum to bf16, but the fused kernel uses the
#   float32 sum, so inductor's result is the most accurate of the three by more than a factor of
#   100 (asserted where the rewrite happens).
# - The rewrite depends on the device: for CUDA inductor keeps the bf16 ``bmm`` (from a GPU, or
#   simulated from this build's dispatch rules, as the column says), and ``aot_eager``'s graph is
#   the same on both devices.
# - ``emulate_precision_casts`` brings the rounding back (and, on the CPU, ``aot_eager``'s exact
#   bits) since torch 2.13; before, inductor's CPU code ignored it.
#
# So the same line of Python gives three answers, and one of them is an error: check the graph
# your backend really runs before comparing eager and compiled numerics.
#
# .. admonition:: References
#
#    :torchapi:`torch.compile`, :torchapi:`torch.matmul`, :torchdoc:`torch.compiler.html`,
#    :torchdoc:`torch.compiler_troubleshooting.html`, :torchdoc:`torch.compiler_fake_tensor.html`

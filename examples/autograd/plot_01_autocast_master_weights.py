"""
Autocast with float32 weights: the casts in backward
====================================================

Under :func:`torch.autocast` a float32 weight is cast to bf16 for the matmul. Its gradient
then comes back in bf16, and autograd casts it to float32 before it reaches ``weight.grad``:
a cast nobody wrote. We take one training step of a ``Linear`` and of a small MLP under
autocast on this build's device, find that cast in the autograd graph, in the backward graph
AOTAutograd traces, and in the ops :class:`mpguide.training.autograd.DtypeLog` records in eager mode,
and count the bytes it reads and writes, per parameter and in total.
"""

# %%
# Setup
# -----
# Everything runs live on the device :func:`mpguide.core.device.pick` chooses: CUDA when
# present, else the CPU. Autocast uses bf16 on either.
import torch
import torch.nn.functional as F

from mpguide.compiled import graphs
from mpguide.core import device
from mpguide.training import autograd

dev = device.pick()
device.describe(dev)
BF16 = torch.bfloat16
gen = torch.Generator(device=dev).manual_seed(0)

# %%
# One step of a Linear, logged
# ----------------------------
# :class:`~mpguide.training.autograd.DtypeLog` records every ATen op that runs while it is active. It
# is given the model so that it can name the parameter a backward op produces the gradient
# of; :meth:`~mpguide.training.autograd.DtypeLog.phase` labels the optimizer's ops.
lin = torch.nn.Linear(64, 32, device=dev)
opt = torch.optim.SGD(lin.parameters(), lr=0.1)
x = torch.randn(16, 64, device=dev, generator=gen)
target = torch.randn(16, 32, device=dev, generator=gen)

with autograd.DtypeLog(lin) as log:
    with torch.autocast(dev.type, dtype=BF16):
        out = lin(x)
        loss = F.mse_loss(out.float(), target)
    loss.backward()
    with log.phase("optimizer"):
        opt.step()

print(f"output {out.dtype}, loss {loss.dtype}")
print(f"weight {lin.weight.dtype}, weight.grad {lin.weight.grad.dtype}")
print(f"bias {lin.bias.dtype}, bias.grad {lin.bias.grad.dtype}")
assert out.dtype == BF16
assert lin.weight.grad.dtype == lin.bias.grad.dtype == torch.float32
log

# %%
# The summary groups the ops by phase, autograd node and dtypes. The backward matmul runs in
# bf16 (``AddmmBackward0``), and ``ToCopyBackward0`` casts bf16 -> float32 once per
# parameter. The casts alone:
weight_cast = [r for r in log.select("backward", casts=True) if r.param == "weight"]
assert [r.cast for r in weight_cast] == ["bfloat16->float32"]
assert weight_cast[0].node == "ToCopyBackward0"
assert "(bfloat16, bfloat16) -> (bfloat16)" in log.signatures("aten.mm", "backward")
log.casts()

# %%
# The whole step as strips, one per phase, one box per op in the order it ran, coloured by the
# dtype it returned, casts outlined: the three casts down to bf16 before ``addmm``, the bf16
# backward, and a cast up to float32 in front of each parameter's gradient.
from mpguide import plots

_ = plots.log_strips(log, title=f"one SGD step of Linear(64, 32) under bf16 autocast on "
                                f"{dev.type}, torch {torch.__version__}")

# %%
# The autograd graph
# ------------------
# :func:`~mpguide.training.autograd.grad_graph` walks ``grad_fn`` from the loss. Each node shows the
# dtype it recorded for the gradient it receives: the matmul's node records bf16, the
# ``ToCopyBackward0`` above each ``AccumulateGrad`` records bf16 too, and the ``AccumulateGrad``
# leaf records the parameter's float32. Autograd casts the gradient to what each node recorded.
with torch.autocast(dev.type, dtype=BF16):
    loss = F.mse_loss(lin(x).float(), target)
tree = autograd.grad_graph(loss, lin)
assert tree.find("AddmmBackward0")[0].grad_in[0].dtype == BF16
for name in ("weight", "bias"):
    assert tree.param(name).grad_in[0].dtype == torch.float32
copies = [n for n in tree.find("ToCopyBackward0") if n.children and n.children[0].param]
assert {c.grad_in[0].dtype for c in copies} == {BF16} and len(copies) == 2
tree


# %%
# The backward graph AOTAutograd traces
# -------------------------------------
# :func:`mpguide.compiled.graphs.capture` compiles the step with the ``aot_eager`` backend and keeps the
# forward and backward graphs AOTAutograd produced. In the backward graph the weight gradient
# comes out of a bf16 ``mm`` and is converted to float32 by an explicit ``_to_copy`` before
# it is returned.
def step_loss(x):
    return F.mse_loss(lin(x).float(), target)


with torch.autocast(dev.type, dtype=BF16):
    captured = graphs.capture(step_loss, x)
print(captured.render("backward"))


def node_dtype_shape(node):
    val = node.meta.get("val")
    return (val.dtype, tuple(val.shape)) if isinstance(val, torch.Tensor) else None


bw_nodes = list(captured.backward.graph.nodes)
mm = [n for n in bw_nodes if n.target == torch.ops.aten.mm.default]
to_fp32 = [
    node_dtype_shape(n)
    for n in bw_nodes
    if n.target == torch.ops.aten._to_copy.default and node_dtype_shape(n)[0] == torch.float32
]
assert mm and all(node_dtype_shape(n)[0] == BF16 for n in mm)
assert (torch.float32, tuple(lin.weight.shape)) in to_fp32
assert (torch.float32, tuple(lin.bias.shape)) in to_fp32
captured.flow("backward")

# %%
# What the backward casts cost
# ----------------------------
# A small MLP with a LayerNorm: one step under autocast, then the backward casts per
# parameter, each with the bytes it reads (bf16) and writes (float32).
mlp = torch.nn.Sequential(
    torch.nn.Linear(256, 512),
    torch.nn.LayerNorm(512),
    torch.nn.GELU(),
    torch.nn.Linear(512, 512),
    torch.nn.GELU(),
    torch.nn.Linear(512, 10),
).to(dev)
xb = torch.randn(32, 256, device=dev, generator=gen)
labels = torch.randint(10, (32,), device=dev, generator=gen)

with autograd.DtypeLog(mlp) as mlp_log:
    with torch.autocast(dev.type, dtype=BF16):
        mlp_loss = F.cross_entropy(mlp(xb), labels)
    mlp_loss.backward()

assert {p.grad.dtype for p in mlp.parameters()} == {torch.float32}
per_param = mlp_log.per_param()
cast_bytes = dict(zip(per_param.column("parameter"), per_param.column("bytes"), strict=True))
for name, p in mlp.named_parameters():
    if name.startswith("1."):  # the LayerNorm: autocast does not cast its weights
        assert name not in cast_bytes, name
    else:
        assert cast_bytes[name] == p.numel() * (BF16.itemsize + torch.float32.itemsize), name
per_param

# %%
# Each parameter of the three ``Linear`` layers gets one bf16 -> float32 cast of its
# gradient: 2 bytes read and 4 written per element. The LayerNorm's parameters get none:
# autocast never cast them to bf16 in forward, so their gradients are computed in float32.
linear_params = sum(p.numel() for name, p in mlp.named_parameters() if not name.startswith("1."))
total = mlp_log.cast_bytes("backward")
param_casts = sum(cast_bytes.values())
print(
    f"backward casts of parameter gradients: {param_casts / 1024:.1f} KiB for "
    f"{linear_params} cast parameters ({linear_params * 4 / 1024:.1f} KiB in float32)"
)
print(
    f"all backward casts, activation gradients included: {total / 1024:.1f} KiB "
    f"in {len(mlp_log.select('backward', casts=True))} casts"
)
param_shapes = [list(p.shape) for name, p in mlp.named_parameters() if not name.startswith("1.")]
forward_param_casts = sum(
    r.cast_bytes
    for r in mlp_log.select("forward", casts=True)
    if r.cast == "float32->bfloat16" and list(r.source.shape) in param_shapes
)
print(f"forward casts of the same parameters to bf16: {forward_param_casts / 1024:.1f} KiB")
assert param_casts == linear_params * 6
assert forward_param_casts == param_casts
assert total > param_casts

# %%
# Per step, the gradient casts move 1.5 times the float32 size of the cast parameters
# (6 bytes per element against 4), and the forward pays the same again casting the weights
# to bf16. The backward casts without a parameter carry activation gradients: where autocast
# ran an op in float32 (the loss, on this device), the float32 gradient is
# cast back to bf16 for the matmul before it, and the other way round at its input.
activation_casts = [r for r in mlp_log.select("backward", casts=True) if not r.param]
assert ("float32->bfloat16", [32, 10]) in [(r.cast, list(r.source.shape)) for r in activation_casts]
mlp_log.casts("backward")

# %%
# What we saw
# -----------
# - Under autocast, a float32 parameter's gradient is computed by a bf16 matmul and cast to
#   float32 by ``ToCopyBackward0`` before it reaches ``.grad``, which is float32.
# - The autograd graph records bf16 for the matmul's gradient and float32 at the
#   ``AccumulateGrad`` leaves; AOTAutograd's backward graph has the same bf16 ``mm`` followed by
#   an explicit ``_to_copy`` to float32.
# - Each cast parameter costs 6 bytes of cast traffic per element per backward; LayerNorm's
#   parameters, never cast, cost none. The totals for the MLP are printed above.
#
# .. admonition:: References
#
#    :torchapi:`torch.autocast`, :torchdoc:`amp.html`, :torchdoc:`notes/autograd.html`,
#    :torchdoc:`notes/extending.html` (``__torch_dispatch__``), :torchapi:`torch.compile`

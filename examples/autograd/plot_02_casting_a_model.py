"""
Casting a model to bf16: parameters, gradients and backward
===========================================================

There are several ways to get a bf16 ``nn.Linear``: build it in bf16, call ``.to(bfloat16)``,
assign ``param.data``, or call ``.to`` with one of the two ``torch.__future__`` conversion
flags set. Do they keep the parameter object? What dtype does the gradient get, what dtype did
autograd record for it, and does any cast appear in backward? We cast a ``Linear`` each way on
this build's device, run backward under :class:`mpguide.training.autograd.DtypeLog`, and read the
answers off. Then we cast after the forward has run, which is where the ways part company.
"""

# %%
# Setup
# -----
# Everything runs on the device :func:`mpguide.core.device.pick` chooses: CUDA when present, else
# the CPU.
import torch

from mpguide.core import device, state
from mpguide.training import autograd, casting

dev = device.pick()
device.describe(dev)

# %%
# ``.to()`` keeps the parameter object
# ------------------------------------
# By default, ``Module.to`` converts each parameter and assigns the result to the old
# parameter's ``.data``: the Python object stays, its storage and dtype change. An optimizer
# built before the cast therefore still holds the module's parameters.
lin = torch.nn.Linear(8, 8, device=dev)
weight = lin.weight
optimizer = torch.optim.SGD(lin.parameters(), lr=0.1)
lin.to(torch.bfloat16)
held = optimizer.param_groups[0]["params"][0]
print(f"lin.weight is the old object: {lin.weight is weight}; its dtype now: {weight.dtype}")
print(f"the optimizer holds the module's weight: {held is lin.weight}")
assert lin.weight is weight and weight.dtype == torch.bfloat16
assert held is lin.weight

# %%
# With ``torch.__future__.set_overwrite_module_params_on_conversion(True)``, ``.to`` makes a
# new ``Parameter`` instead, and an optimizer built before the cast is left holding the old
# float32 one. The flag is global, so it is set inside :func:`mpguide.core.state.preserved`, which
# puts it back on exit.
lin = torch.nn.Linear(8, 8, device=dev)
weight = lin.weight
optimizer = torch.optim.SGD(lin.parameters(), lr=0.1)
with state.preserved():
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    lin.to(torch.bfloat16)
held = optimizer.param_groups[0]["params"][0]
print(f"lin.weight is the old object: {lin.weight is weight}")
print(f"the optimizer holds: {held.dtype}, the module's weight: {lin.weight.dtype}")
assert lin.weight is not weight and held is weight and held.dtype == torch.float32
assert not torch.__future__.get_overwrite_module_params_on_conversion()

# %%
# Five ways, forward after the cast
# ---------------------------------
# :func:`mpguide.training.casting.conversions` casts a fresh ``Linear(8, 8)`` each way, runs a bf16
# forward and backward, and reports. "dtype" is the weight's; "recorded" is the dtype
# autograd stored for the gradient of the weight's ``AccumulateGrad`` node; "old
# weight.grad" is the gradient of the object the module held before the cast; "backward"
# counts the dtype conversions :class:`~mpguide.training.autograd.DtypeLog` saw while backward ran.
after = casting.conversions(torch.bfloat16, dev)
for row in after.records():
    assert row["dtype"] == row["recorded"] == torch.bfloat16, row
    assert row["weight.grad"] == torch.bfloat16, row
    assert row["backward"] == "0 casts", row
same = dict(zip(after.column("method"), after.column("same object"), strict=True))
assert [m for m, s in same.items() if not s] == [casting.METHODS["overwrite"]]
after

# %%
# Every way gives a bf16 weight, a bf16 gradient and a backward without a single cast; only
# the overwrite flag replaces the parameter object (the swap flag swaps the contents of the
# two tensors, so the object the module holds stays the same).
#
# The autograd graph says the same: every node records bf16 gradients.
lin = torch.nn.Linear(8, 8, device=dev).to(torch.bfloat16)
x = torch.randn(4, 8, device=dev, dtype=torch.bfloat16)
graph = autograd.grad_graph(lin(x).sum(), lin)
assert {m.dtype for n in graph.nodes() for m in n.grad_in} == {torch.bfloat16}
graph

# %%
# Casting after the forward
# -------------------------
# Now the forward runs in float32 first, the module is cast, and backward runs on the graph
# recorded before the cast.
before = casting.conversions(torch.bfloat16, dev, graph_before=True)
rows = {r["method"]: r for r in before.records()}
to, data = rows[casting.METHODS["to"]], rows[casting.METHODS["data"]]
overwrite, swap = rows[casting.METHODS["overwrite"]], rows[casting.METHODS["swap"]]
for row in (to, data):
    assert row["dtype"] == torch.bfloat16 and row["weight.grad"] == torch.float32
assert overwrite["weight.grad"] == "none" and overwrite["old weight.grad"] == torch.float32
assert swap["backward"] == "raised"
assert [n for n in before.notes if "poisoned by swap_tensors" in n]
assert all(r["recorded"] == torch.float32 for r in rows.values())
before

# %%
# The graph kept what it recorded, float32, and the engine delivers gradients in that dtype:
#
# - after ``.to`` or ``.data =``, the bf16 weight gets a **float32** ``.grad``, with no cast
#   anywhere (backward works on what the float32 forward saved);
# - with the overwrite flag the gradient lands on the old float32 parameter, which the module
#   no longer holds, and the new one gets none;
# - with the swap flag, backward refuses to run: the swapped ``AccumulateGrad`` node is
#   poisoned, and the error (under the table, first sentence) says why.
#
# The tree of such a graph shows the float32 leaf behind a weight that is now bf16:
lin = torch.nn.Linear(8, 8, device=dev)
loss = lin(torch.randn(4, 8, device=dev)).sum()
lin.to(torch.bfloat16)
stale = autograd.grad_graph(loss, lin)
print(f"weight dtype: {lin.weight.dtype}, recorded: {stale.param('weight').grad_in[0].dtype}")
assert stale.param("weight").grad_in[0].dtype == torch.float32
stale

# %%
# Both tables as one map, a row per way of casting, coloured by dtype: cast before the forward,
# every way ends with a bf16 gradient; cast after it, the gradient keeps the float32 the graph
# recorded, lands on the old parameter, or backward raises (red). ``Linear(..., dtype=dtype)``
# has no "after" (n/a): it is built in bf16.
from mpguide import plots
from mpguide.core.table import Table


def grad_or_error(row):
    return row["backward"] if row["backward"] == "raised" else row["weight.grad"]


cast_first = {r["method"]: r for r in after.records()}
_ = plots.dtype_grid(
    Table(
        ("method", "cast, then forward: weight.grad",
         *(f"forward, then cast: {c}" for c in ("weight", "recorded", "weight.grad",
                                                 "old weight.grad"))),
        tuple(
            (method, grad_or_error(cast_first[method]),
             *((rows[method]["dtype"], rows[method]["recorded"], grad_or_error(rows[method]),
                rows[method]["old weight.grad"]) if method in rows else ("n/a",) * 4))
            for method in cast_first
        ),
    ),
    title=f"casting nn.Linear to bf16 before or after the forward, on {dev.type}, "
    f"torch {torch.__version__}",
)

# %%
# Compiled: the backward of a bf16 ``Linear``
# -------------------------------------------
# Graph-compiling backends have been seen keeping a bf16 -> float32 -> bf16 cast pair in the
# backward of ``F.linear`` (a long pytorch/xla thread). Here ``torch.compile`` with the
# ``aot_eager`` backend runs the AOTAutograd backward graph op by op, so the logger sees every
# op of it. The forward runs outside the logger and only the backward inside it (the next
# cell shows why). The loss is summed in bf16, so no cast belongs to it.
makers = {
    "construct": lambda: torch.nn.Linear(8, 8, device=dev, dtype=torch.bfloat16),
    "to": lambda: torch.nn.Linear(8, 8, device=dev).to(torch.bfloat16),
}
for method, make in makers.items():
    lin = make()
    compiled = torch.compile(lin, backend="aot_eager")
    x = torch.randn(4, 8, device=dev, dtype=torch.bfloat16)
    loss = compiled(x).sum()
    with autograd.DtypeLog(lin) as log:
        loss.backward()
    nodes = {r.node_name for r in log.select("backward")}
    print(
        f"{casting.METHODS[method]}: {len(log.select('backward'))} backward ops in "
        f"{', '.join(sorted(nodes))}, {len(log.select('backward', casts=True))} casts"
    )
    assert "CompiledFunctionBackward" in nodes
    assert log.select(casts=True) == []
    assert lin.weight.grad.dtype == torch.bfloat16

# %%
# Called while the logger is active, the compiled module ran eagerly on this torch: backward
# shows the eager nodes instead of ``CompiledFunctionBackward``. To log a compiled backward,
# run its forward before entering the logger.
with autograd.DtypeLog(lin) as log:
    compiled(x).sum().backward()
eager_nodes = sorted({r.node_name for r in log.select("backward")})
print(", ".join(eager_nodes))
assert "CompiledFunctionBackward" not in eager_nodes and "AddmmBackward0" in eager_nodes

# %%
# What we saw
# -----------
# - ``.to(bfloat16)`` and ``param.data =`` keep the parameter object; the overwrite flag
#   replaces it (an optimizer built earlier keeps the old float32 tensor); the swap flag keeps
#   the object and swaps its contents.
# - Cast before the forward, every way gives bf16 weights, bf16 gradients, bf16 recorded
#   metadata and no cast in backward on this torch; so does the ``aot_eager`` compiled
#   backward of a ``Linear`` built in bf16 or cast with ``.to``.
# - Cast between forward and backward, the graph keeps its float32 metadata: a bf16 weight
#   ends up with a float32 gradient (``.to``, ``.data``), the gradient goes to the discarded
#   parameter (overwrite), or backward raises (swap).
#
# .. admonition:: References
#
#    :torchapi:`torch.nn.Module` (``to``, ``_apply``),
#    :torchdoc:`future_mod.html`, :torchapi:`torch.utils.swap_tensors`,
#    :torchdoc:`notes/autograd.html`, :torchapi:`torch.compile`

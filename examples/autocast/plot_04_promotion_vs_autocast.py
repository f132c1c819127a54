"""
Type promotion against autocast
===============================

Outside autocast, :func:`torch.result_type` predicts the dtype an op returns when a bf16 tensor
meets a float32 one: float32, by type promotion. Under autocast the answer is often another
dtype, and not the same one on every device. For every op of the policy catalogue that takes
two or more floating inputs, we give the first input in bf16 and the rest in float32, compute
what type promotion predicts, run the op under bf16 autocast on the CPU and on CUDA (on a GPU,
or simulated from this build's dispatch rules), and name the rule behind each difference.
"""

# %%
# Setup
# -----
import functools

import torch
from torch.utils._pytree import tree_leaves

from mpguide.autocast import policy
from mpguide.core import device, dtypes, versions
from mpguide.core.table import Table

dev = device.pick()
device.describe(dev)

devices = policy.across(torch.bfloat16, ["cpu", "cuda"])
cpu, cuda = devices["cpu"], devices["cuda"]
print(f"cpu: {cpu.how}; cuda: {cuda.how}")

# %%
# What type promotion predicts
# ----------------------------
# :func:`torch.result_type` over the op's floating inputs, the first in bf16 and the rest in
# float32, as the probe's mixed run gives them. A 0-dim float32 tensor (a scalar argument of
# some OpInfo samples) does not promote a bf16 tensor.


def predicted(op: policy.Op) -> torch.dtype | None:
    args = op.inputs(policy.Inputs(torch.device("cpu")))
    floats = [a for a in tree_leaves(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if len(floats) < 2:
        return None
    _, *rest = floats  # the first input is the bf16 one
    return functools.reduce(
        lambda dt, t: torch.result_type(torch.empty(1, dtype=dt), t), rest, torch.bfloat16
    )


predictions = {op.name: predicted(op) for op in policy.registered()}
mixed_ops = [name for name, dt in predictions.items() if dt is not None]
promoted = [name for name in mixed_ops if predictions[name] == torch.float32]
kept = [name for name in mixed_ops if predictions[name] != torch.float32]
assert {predictions[name] for name in kept} <= {torch.bfloat16}  # 0-dim float32 inputs
print(f"{len(mixed_ops)} ops take two or more floating inputs; result_type says float32 for "
      f"{len(promoted)}, bfloat16 for {len(kept)} (their float32 inputs are 0-dim, which do "
      f"not promote): {', '.join(kept) or 'none'}")

# %%
# The rule behind each outcome
# ----------------------------
# The probe's class of the op on that device says which autocast rule applied, and the output
# says whether it matched the prediction. Where autocast has no rule for the op, the kernel's
# own dtype rule decides: it either promotes, returns its first input's dtype, or raises.


def rule(probe: policy.Probe, want: torch.dtype) -> str:
    run = probe.mixed_in
    if "mixed_in" in probe.undecided:
        return policy.NEEDS_HARDWARE
    if run.error and not run.error_outside and probe.fp32_in.error:
        return "raises: autocast refuses the op, whatever the input dtypes"
    if run.error and probe.kind == policy.UNSUPPORTED:
        return "raises: the kernel refuses the dtype"
    if run.error:
        return "raises: autocast leaves the kernel two dtypes it does not take"
    if probe.kind == policy.LOWER:
        return "lower-precision list: autocast casts every float input to bf16"
    if probe.kind == policy.FLOAT32:
        return "float32 list: autocast casts every float input to float32"
    if probe.kind == policy.PROMOTE:
        return "promote list: autocast casts the inputs to the widest dtype"
    if run.out == want:
        return "no autocast rule: the kernel promotes like result_type"
    if run.out == torch.bfloat16:
        return "no autocast rule: the kernel returns its first input's dtype"
    return f"no autocast rule: the kernel returns {dtypes.name(run.out)}"


def out(probe: policy.Probe) -> str:
    run = probe.mixed_in
    if "mixed_in" in probe.undecided:
        return policy.NEEDS_HARDWARE
    return "error" if run.error else dtypes.name(run.out)


rows = tuple(
    (name, dtypes.name(predictions[name]), out(cpu[name]), rule(cpu[name], predictions[name]),
     out(cuda[name]), rule(cuda[name], predictions[name]))
    for name in mixed_ops
)
table = Table(
    ("op", "result_type", "cpu", "cpu: rule", "cuda", "cuda: rule"),
    rows,
    f"bf16 first input, float32 others, under bf16 autocast; cpu: {cpu.how}; cuda: {cuda.how}",
)
differs = [r for r in rows if r[2] != r[1] or r[4] != r[1]]
print(f"autocast departs from result_type for {len(differs)} of {len(rows)} ops on at least one "
      "device")
table

# %%
# As a map, the ops where autocast departs from type promotion on at least one device: what
# result_type predicts, and what autocast returned on each device, coloured by dtype; red where
# the op raised, purple where simulation cannot decide.
from mpguide import plots

_ = plots.dtype_grid(
    Table(
        ("op", "result_type", device.label("cpu", cpu.how), device.label("cuda", cuda.how)),
        tuple((r[0], r[1], r[2], r[4]) for r in differs),
    ),
    title=f"bf16 first input, float32 others, under bf16 autocast: {len(differs)} of "
    f"{len(rows)} ops, torch {torch.__version__}",
)

# %%
# Named cases, asserted
# ---------------------
# - ``matmul`` and ``linear`` come out bf16 on both devices: the lower-precision list beats
#   promotion.
# - ``layer_norm`` returns the bf16 input's dtype on the CPU, where autocast has no rule for it,
#   and float32 on CUDA, where it is on the float32 list.
# - ``mv`` raises on the CPU, whose kernel wants one dtype, and so does ``addmv`` with a bf16
#   bias since torch 2.12 (before, it returned float32); both come out bf16 on CUDA, whose
#   autocast casts every input.
# - ``index_copy`` agrees with result_type on the CPU (promote list) and keeps the first input's
#   bf16 on CUDA (no rule there).
# - ``cat`` agrees with result_type on both devices, by two routes: the CPU's promote list, the
#   CUDA kernel's own promotion.
# - CUDA autocast refuses ``binary_cross_entropy`` whatever the dtypes; it makes the mixed
#   inputs of ``mv`` (bf16) and ``index_put`` and ``cross`` (float32, promote list) one dtype
#   before the kernel, so the simulation decides them.
for name in ("matmul", "linear"):
    assert cpu[name].mixed_in.out == cuda[name].mixed_in.out == torch.bfloat16
assert cpu["layer_norm"].mixed_in.out == torch.bfloat16
assert cpu.kind("layer_norm") == policy.UNCHANGED
assert cuda["layer_norm"].mixed_in.out == torch.float32
assert cuda.kind("layer_norm") == policy.FLOAT32
addmv = versions.change("addmv_cpu_mixed_bias")
print(addmv.describe())
assert cpu["mv"].mixed_in.error is not None
assert (cpu["addmv"].mixed_in.error is not None) == addmv.holds
for name in ("mv", "addmv"):
    assert cuda[name].mixed_in.out == torch.bfloat16 and cuda.kind(name) == policy.LOWER
assert cpu.kind("index_copy") == policy.PROMOTE
assert cpu["index_copy"].mixed_in.out == torch.float32
assert cuda.kind("index_copy") == policy.UNCHANGED
assert cuda["index_copy"].mixed_in.out == torch.bfloat16
assert cpu.kind("cat") == policy.PROMOTE and cuda.kind("cat") == policy.UNCHANGED
assert cpu["cat"].mixed_in.out == cuda["cat"].mixed_in.out == torch.float32
# CUDA autocast refuses binary_cross_entropy itself, on float32 inputs as well
# (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
assert rule(cuda["binary_cross_entropy"], torch.float32).startswith("raises: autocast refuses")
# CUDA autocast makes mixed inputs one dtype before the kernel: decided, no hardware needed
assert out(cuda["mv"]) == "bfloat16" and out(cuda["index_put"]) == "float32"
# torch.cross (not torch.linalg.cross) has the CUDA autocast kernel: the promote list
assert cuda.kind("cross") == policy.PROMOTE and cuda["cross"].mixed_in.out == torch.float32
print("named cases hold")

# %%
# With uniform inputs
# -------------------
# Type promotion has nothing to do when every input has one dtype: result_type returns it. Under
# autocast, float32 inputs come out bf16 for the lower-precision list, and bf16 inputs come out
# float32 for the float32 list; the counts differ by device.
Table(
    ("device", "float32 in -> bf16 out", "bf16 in -> float32 out"),
    tuple(
        (p.device, sum(x.fp32_in.out == torch.bfloat16 for x in p.probes),
         sum(x.low_in.out == torch.float32 for x in p.probes))
        for p in devices.policies
    ),
    "ops where autocast overrides result_type on uniform inputs",
)

# %%
# What we saw
# -----------
# - For the catalogue ops with two or more floating inputs, result_type predicts float32 for a
#   bf16 input meeting float32 ones, except where the float32 inputs are 0-dim.
# - Autocast overrides that per op and per device: the lower-precision list returns bf16, the
#   float32 list float32, and an op with no rule falls back on its kernel, which may promote,
#   keep the first input's dtype or raise.
# - ``layer_norm``, ``mv``, ``addmv`` and ``index_copy`` give different dtypes on the CPU and
#   on CUDA for the same call.
#   (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
#
# .. admonition:: References
#
#    :torchapi:`torch.result_type`, :torchdoc:`tensor_attributes.html#type-promotion-doc`,
#    :torchdoc:`amp.html#autocast-op-reference`, :torchapi:`torch.autocast`

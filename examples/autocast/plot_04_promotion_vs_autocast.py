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
# float32, as the probe's mixed run gives them, each with its own shape: a 0-dim float32
# tensor (a scalar argument of some OpInfo samples) does not promote a bf16 tensor that has
# dimensions, and two 0-dim tensors promote each other.


def predicted(op: policy.Op) -> torch.dtype | None:
    args = op.inputs(policy.Inputs(torch.device("cpu")))
    floats = [a for a in tree_leaves(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if len(floats) < 2:
        return None
    typed = [torch.empty(t.shape, dtype=torch.float32) for t in floats]
    typed[0] = typed[0].to(torch.bfloat16)  # the first input is the bf16 one

    def promote(acc: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        # result_type of the pair, kept 0-dim only where both are (the dim rule of promotion)
        shape = () if acc.dim() == t.dim() == 0 else (1,)
        return torch.empty(shape, dtype=torch.result_type(acc, t))

    return functools.reduce(promote, typed).dtype


def scalar_floats(op: policy.Op) -> bool:
    """Whether every float32 input of the mixed run is 0-dim while the bf16 one is not."""
    args = op.inputs(policy.Inputs(torch.device("cpu")))
    first, *rest = [a for a in tree_leaves(args)
                    if isinstance(a, torch.Tensor) and a.is_floating_point()]
    return first.dim() > 0 and all(t.dim() == 0 for t in rest)


ops = {op.name: op for op in policy.registered()}
predictions = {name: predicted(op) for name, op in ops.items()}
mixed_ops = [name for name, dt in predictions.items() if dt is not None]
promoted = [name for name in mixed_ops if predictions[name] == torch.float32]
kept = [name for name in mixed_ops if predictions[name] != torch.float32]
assert {predictions[name] for name in kept} <= {torch.bfloat16}
assert all(scalar_floats(ops[name]) for name in kept)  # why result_type keeps bf16 there
print(f"{len(mixed_ops)} ops take two or more floating inputs; result_type says float32 for "
      f"{len(promoted)}, bfloat16 for {len(kept)} (their float32 inputs are 0-dim and the bf16 "
      f"one is not, and 0-dim tensors do not promote): {', '.join(kept) or 'none'}")

# %%
# The rule behind each outcome
# ----------------------------
# The probe's class of the op on that device says which autocast rule applied, and the output
# says whether it matched the prediction. Where autocast has no rule for the op, the kernel's
# own dtype rule decides: it either promotes, returns its first input's dtype, or raises.
#
# On a simulated device a cell is a fact only where the simulation can decide it: not where
# the probe marks the mixed run undecided, and not where the meta kernel raised (the same
# call raises outside autocast too) with another error than the real CPU kernel gives for
# the same inputs; such a cell says ``needs hardware``. A probe whose process died on a
# GPU (a crash inside a CUDA library) says so.


def undecided(name: str, p: policy.Policy) -> bool:
    probe = p[name]
    if "mixed_in" in probe.undecided:
        return True
    run, real = probe.mixed_in, cpu[name].mixed_in
    if p.how != device.SIMULATED or not (run.error and run.error_outside):
        return False
    return (real.error_outside or "").split(":", 1)[0] != run.error_outside.split(":", 1)[0]


def rule(name: str, p: policy.Policy) -> str:
    probe, want = p[name], predictions[name]
    run = probe.mixed_in
    if probe.died:
        return probe.died
    if undecided(name, p):
        return policy.NEEDS_HARDWARE
    if run.error and probe.fp32_in.error and not probe.fp32_in.error_outside:
        # float32 inputs that the kernel takes outside autocast: the refusal is autocast's,
        # whether or not the kernel also refuses the mixed inputs (the CPU's BCE kernel does)
        return "raises: autocast refuses the op, whatever the input dtypes"
    if run.error and probe.kind == policy.UNSUPPORTED:
        return "raises: the kernel refuses the dtype"
    if run.error and not run.casts:
        return "raises: autocast leaves the kernel two dtypes it does not take"
    if run.error:
        return "raises: the kernel refuses the inputs autocast gives it"
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


def out(name: str, p: policy.Policy) -> str:
    probe = p[name]
    if probe.died:
        return "probe died"
    if undecided(name, p):
        return policy.NEEDS_HARDWARE
    return "error" if probe.mixed_in.error else dtypes.name(probe.mixed_in.out)


rows = tuple(
    (name, dtypes.name(predictions[name]), out(name, cpu), rule(name, cpu), out(name, cuda),
     rule(name, cuda))
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
# - ``index_copy`` agrees with result_type on the CPU (promote list). CUDA autocast has no rule
#   for it, so the kernel gets a bf16 ``self`` and a float32 ``source``: a GPU raises (see the
#   recordings below); the simulation cannot tell, its meta kernel takes the two dtypes.
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
if cuda.how == device.LIVE:
    assert "same dtype" in cuda["index_copy"].mixed_in.error
else:
    assert out("index_copy", cuda) == policy.NEEDS_HARDWARE
assert cpu.kind("cat") == policy.PROMOTE and cuda.kind("cat") == policy.UNCHANGED
assert cpu["cat"].mixed_in.out == cuda["cat"].mixed_in.out == torch.float32
# CUDA autocast refuses binary_cross_entropy itself, on float32 inputs as well
# (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
assert rule("binary_cross_entropy", cuda).startswith("raises: autocast refuses")
# CUDA autocast makes mixed inputs one dtype before the kernel: decided, no hardware needed
assert out("mv", cuda) == "bfloat16" and out("index_put", cuda) == "float32"
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
# Against the GPU recordings
# --------------------------
# A GPU measured the same probe (``docs/recorded/``, with its provenance). Where its mixed run
# differs from this build's simulated CUDA cell, that cell must say ``needs hardware``: a
# simulated cell that states a dtype or an error the GPU contradicts fails the page. A
# recorded probe whose process died on the GPU states nothing. On a GPU build the table
# lists where this GPU and the recorded one differ.
from mpguide.core import record

KEY = "autocast.policy.bfloat16"
recorded = [(r.provenance, r.tables[KEY]) for r in record.recordings() if KEY in r.tables]
against = []
for prov, t in recorded:
    mixed, note = t.columns.index("mixed in"), t.columns.index("note")
    rec = {row[0]: row for row in t.rows}
    for name in mixed_ops:
        row = rec.get(name)
        if row is None or row[mixed] == out(name, cuda):
            continue
        died = row[mixed] == "" or row[note].startswith(("probe died", "the process died"))
        against.append((name, out(name, cuda), "probe died" if died else row[mixed],
                        row[note], prov.name))
        if cuda.how == device.SIMULATED:  # live, two GPUs may differ: the table shows it
            assert died or out(name, cuda) == policy.NEEDS_HARDWARE, against[-1]
    copy = rec["index_copy"]
    assert copy[mixed] == "error" and "same dtype" in copy[note], copy
    print(f"{prov.name} (torch {prov.torch}, {prov.date}): index_copy with a bf16 self and a "
          f"float32 source raises under CUDA autocast: {copy[note]}")
if recorded and cuda.how == device.SIMULATED:
    decided = sum(out(name, cuda) != policy.NEEDS_HARDWARE for name in mixed_ops)
    print(f"every decided CUDA cell of this build ({decided} of {len(mixed_ops)}) agrees with "
          f"{', '.join(p.name for p, _ in recorded)}")
elif not recorded:
    print(f"no GPU recording in this build (${record.ENVIRONMENT} names none)")
Table(
    ("op", f"cuda: {cuda.how}", "recorded", "recorded note", "GPU"),
    tuple(against),
    "mixed runs where a GPU recording and this build's CUDA cell differ",
)

# %%
# What we saw
# -----------
# - For the catalogue ops with two or more floating inputs, result_type predicts float32 for a
#   bf16 input meeting float32 ones, except where the float32 inputs are 0-dim.
# - Autocast overrides that per op and per device: the lower-precision list returns bf16, the
#   float32 list float32, and an op with no rule falls back on its kernel, which may promote,
#   keep the first input's dtype or raise.
# - ``layer_norm``, ``mv`` and ``addmv`` give different results on the CPU and on CUDA for
#   the same call: another dtype, or an error on one device only. ``index_copy`` returns
#   float32 on the CPU and raises on a GPU, which the simulation cannot decide.
#   (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
# - A simulated CUDA cell states a dtype or an error only where the simulation decides it;
#   where a GPU recording exists, every such cell agrees with it.
#
# .. admonition:: References
#
#    :torchapi:`torch.result_type`, :torchdoc:`tensor_attributes.html#type-promotion-doc`,
#    :torchdoc:`amp.html#autocast-op-reference`, :torchapi:`torch.autocast`

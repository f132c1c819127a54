"""
The autocast policy, probed op by op on every device
====================================================

Which ops does autocast run in low precision, which in float32, and which does it leave
alone, and does the answer depend on the device? Instead of copying a list,
:func:`mpguide.autocast.policy.probe` runs every op of a catalogue under autocast with float32 inputs,
with low-precision inputs and with mixed inputs, records the casts autocast inserts, and
classifies the op from what happened. It does so on this build's own device, and on every other
device type whose autocast kernels this torch build carries by simulating it: fake tensors on
that device under its autocast, so the dispatcher applies that device's real rules over meta
kernels and no kernel runs. The CPU and CUDA answers differ for about half the catalogue.
"""

# sphinx_gallery_thumbnail_number = 1

# %%
# Setup
# -----
import textwrap

import torch

from mpguide.autocast import device, policy
from mpguide.core.table import Table

dev = device.pick()
device.describe(dev)

# %%
# The devices this build knows
# ----------------------------
# :func:`mpguide.autocast.device.autocast_kernels` reads the dispatcher of the installed torch: how many
# ATen ops have an autocast kernel for each device type. A device type can be simulated when a
# fake tensor on it carries that autocast dispatch key; a device this machine has runs for real.
kernels = device.autocast_kernels()
simulable = device.simulated_types()
Table(
    ("device type", "ops with an autocast kernel", "simulated here", "on this machine"),
    tuple(
        (t, n, "yes" if t in simulable else "no", "yes" if device.present(t) else "no")
        for t, n in kernels.items()
    ),
    f"autocast kernels registered in torch {torch.__version__}",
)

# %%
assert {"cpu", "cuda"} <= set(simulable)
assert kernels["cuda"] > 50 and kernels["cpu"] > 50
print(f"probed below: {', '.join(simulable)}")

# %%
# Probing bf16 on every device
# ----------------------------
# Each op runs three ways. The class comes from the outcome: ``lower precision`` when float32
# inputs come out in bf16, ``float32`` when bf16 inputs come out in float32, ``promote`` when
# autocast casts mixed inputs to the widest dtype, ``unchanged`` when it casts nothing,
# ``unsupported`` when the op raises on uniform inputs, and, on a simulated device,
# ``needs hardware`` where only a real kernel can tell.
bf16 = policy.across(torch.bfloat16)
cpu, cuda = bf16["cpu"], bf16["cuda"]
Table(
    ("class", *bf16.labels),
    tuple((k, *(p.counts()[k] for p in bf16.policies)) for k in policy.CLASSES),
    bf16.caption,
)

# %%
# Named ops in each class on the CPU, asserted:
for op, kind in {
    "mm": policy.LOWER,
    "conv2d": policy.LOWER,
    "prod": policy.FLOAT32,
    "mse_loss": policy.FLOAT32,
    "cat": policy.PROMOTE,
    "exp": policy.UNCHANGED,
    "softmax": policy.UNCHANGED,
}.items():
    assert cpu.kind(op) == kind, (op, cpu.kind(op))
print(textwrap.fill("cpu, float32: " + ", ".join(cpu.ops(policy.FLOAT32)), 76))

# %%
# Can the simulation be trusted?
# ------------------------------
# The CPU is the one device that can be both run and simulated here, so we simulate it too and
# compare run by run. They agree everywhere except where an op's meta kernel accepts inputs its
# real CPU kernel rejects; :func:`mpguide.autocast.policy.meta_gaps` finds those runs. A simulated device
# marks them ``needs hardware`` instead of guessing: the whole op when a uniform run is
# affected, only the mixed-input cell when the mixed run is.
simulated_cpu = policy.probe("cpu", torch.bfloat16, simulate=True)
check = policy.differences(cpu, simulated_cpu)
gaps = policy.meta_gaps(torch.bfloat16, policy.CATALOGUE)
agree = len(cpu.probes) - len(check.rows)
print(f"simulated cpu gives the real cpu's class for {agree} of {len(cpu.probes)} ops")
uniform_gaps = [op for op, runs in gaps.items() if {"fp32_in", "low_in"} & set(runs)]
mixed_gaps = [op for op, runs in gaps.items() if set(runs) == {"mixed_in"}]
assert [r[0] for r in check.rows] == uniform_gaps == ["pdist"]
assert simulated_cpu.kind("pdist") == policy.NEEDS_HARDWARE
assert cpu.kind("pdist") == policy.UNSUPPORTED
assert {"mv", "cross", "index_put"} <= set(mixed_gaps)
Table(
    ("op", "run", "why simulation cannot decide it"),
    tuple((op, run, why) for op, runs in gaps.items() for run, why in runs.items()),
    f"meta kernels more permissive than the CPU's, bf16, torch {torch.__version__}",
)

# %%
# Every op on every device
# ------------------------
# One column per device: ``ran on hardware`` where this machine has the device, ``simulated``
# (this build's dispatch rules, no kernels ran) elsewhere. The last column marks the ops whose
# class differs between devices that decided it.
bf16

# %%
# The ops whose class differs, as a map: one row per device, one column per op, coloured by
# class.
from mpguide import plots

fig = plots.policy_map(bf16, only_differing=True)
fig.axes[0].set_title(f"autocast classes that differ between devices, bf16, torch "
                      f"{torch.__version__}", fontsize=9, pad=28)

# %%
bf16.differences()

# %%
# CPU and CUDA, op by op
# ----------------------
# The questions readers ask most have different answers on the two devices. Reductions,
# softmax, norms and most transcendental functions run in float32 under CUDA autocast and are
# left alone by the CPU's; ``mv``, ``addmv`` and ``addr`` go to bf16 on CUDA and are left alone
# on the CPU.
to_float32_on_cuda = (
    "sum", "cumsum", "softmax", "log_softmax", "logsumexp", "layer_norm", "rms_norm",
    "group_norm", "exp", "log", "pow (tensor, scalar)",
)
for op in to_float32_on_cuda:
    assert cpu.kind(op) == policy.UNCHANGED, (op, cpu.kind(op))
    assert cuda.kind(op) == policy.FLOAT32, (op, cuda.kind(op))
    assert cuda[op].low_in.out == torch.float32 and cpu[op].low_in.out == torch.bfloat16
for op in ("mv", "addmv", "addr"):
    assert cpu.kind(op) == policy.UNCHANGED and cuda.kind(op) == policy.LOWER, op
differing = bf16.differing("cpu", "cuda")
print(f"{len(differing)} ops differ between cpu ({cpu.how}) and cuda ({cuda.how})")
Table(
    ("op", "cpu: bf16 in", "cuda: bf16 in", "cpu class", "cuda class"),
    tuple(
        (op, cpu[op].low_in.out, cuda[op].low_in.out, cpu.kind(op), cuda.kind(op))
        for op in (*to_float32_on_cuda, "mv", "addmv", "addr")
    ),
    "bf16 inputs under autocast",
)

# %%
# The matmul family and convolutions
# ----------------------------------
# Here the devices agree: on every device probed, float32 inputs come out in bf16 with autocast
# inserting the float32 -> bf16 casts.
for p in bf16.policies:
    for op in ("matmul", "mm", "bmm", "linear", "conv2d"):
        assert p.kind(op) == policy.LOWER, (p.device, op)
        assert "float32->bfloat16" in p[op].casts, (p.device, op)
print(f"matmul, mm, bmm, linear, conv2d: lower precision on {', '.join(bf16.labels)}")

# %%
# What simulation cannot decide
# -----------------------------
# Where a simulated op raised in its meta kernel (with autocast off as well), or its meta kernel
# is known to accept what a real kernel rejects, the class is ``needs hardware`` with the
# reason. Numerics and timings always need hardware; dtype rules do not.
undecided = Table(
    ("device", "op", "reason"),
    tuple(
        (p.device, name, p[name].note)
        for p in bf16.policies
        for name in p.ops(policy.NEEDS_HARDWARE)
    ),
    "needs hardware",
)
if cuda.how == device.SIMULATED:
    assert set(uniform_gaps) <= set(cuda.ops(policy.NEEDS_HARDWARE))
    assert all("mixed_in" in cuda[op].undecided for op in mixed_gaps)
    assert cuda.kind("binary_cross_entropy") == policy.UNSUPPORTED  # autocast itself refuses
    assert "unsafe to autocast" in cuda["binary_cross_entropy"].error
undecided

# %%
# bf16 against fp16
# -----------------
# On the CPU and on CUDA, the fp16 policy against the bf16 one. On the CPU no op changes class;
# on CUDA the only difference is an op whose bf16 call simulation could not decide.
fp16_cpu = policy.probe("cpu", torch.float16)
fp16_cuda = policy.probe("cuda", torch.float16)
cpu_16 = policy.differences(cpu, fp16_cpu)
cuda_16 = policy.differences(cuda, fp16_cuda)
print(f"cpu: {len(cpu_16.rows)} ops change class; cuda: {len(cuda_16.rows)}")
assert fp16_cpu.kind("matmul") == fp16_cuda.kind("matmul") == policy.LOWER
assert fp16_cuda.kind("softmax") == policy.FLOAT32
if cpu.how == device.LIVE:
    assert cpu_16.rows == ()
assert all(policy.NEEDS_HARDWARE in (r[2], r[3]) for r in cuda_16.rows)
cuda_16

# %%
# On a GPU
# --------
# Built on a GPU, the CUDA column above ran on hardware, and the simulated CUDA policy is
# compared with it here; a CPU build shows tables recorded on GPU machines by ``nox -s record``,
# labelled with where, when and by which command they were measured.
if cuda.how == device.LIVE:
    simulated_cuda = policy.probe("cuda", torch.bfloat16, simulate=True)
    real_vs_simulated = policy.differences(cuda, simulated_cuda)
    print(f"simulated CUDA differs from the GPU on {len(real_vs_simulated.rows)} ops")
    print(real_vs_simulated)
    assert all(r[3] == policy.NEEDS_HARDWARE for r in real_vs_simulated.rows)
else:
    print(f"no GPU here: the CUDA column is {cuda.how}")

# %%
from mpguide.core import record

record.beside(
    "autocast.policy.bfloat16",
    cuda.table() if cuda.how == device.LIVE else None,
    machine=cuda.machine,
)

# %%
# The same table on your machine
# ------------------------------
# The command line prints it for any device type this build knows, simulated where the machine
# lacks it, or all of them side by side::
#
#     python -m mpguide policy --device cuda --dtype bfloat16 --format markdown
#     python -m mpguide policy --device all --format csv
#
# What we saw
# -----------
# - This build carries autocast kernels for the device types in the first table, and the
#   policy of each can be computed on a CPU.
# - Simulating the CPU reproduces the real CPU policy except for the ops whose meta kernel is
#   more permissive than the real one, which simulated devices mark ``needs hardware``.
# - Reductions, softmax, norms, ``exp``, ``log`` and ``pow`` run in float32 under CUDA autocast
#   and keep bf16 under the CPU's; ``mv``, ``addmv`` and ``addr`` go to bf16 on CUDA only.
# - The matmul family and convolutions run in bf16 on every device probed.
#
# .. admonition:: References
#
#    :torchdoc:`amp.html#autocast-op-reference`, :torchapi:`torch.autocast`,
#    :torchdoc:`torch.compiler_fake_tensor.html`, :torchdoc:`notes/extending.html`

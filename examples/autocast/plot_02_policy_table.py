"""
The autocast policy, probed op by op on every device
====================================================

Which ops does autocast run in low precision, which in float32, and which does it leave
alone, and does the answer depend on the device? Instead of copying a list, the catalogue is
read from the installed torch: every ATen op that has an autocast kernel on some device
(:mod:`mpguide.autocast.catalogue`), called with the first sample of torch's own OpInfo for
that op, or a small hand-written call where no OpInfo exists.
:func:`mpguide.autocast.policy.probe` runs each under autocast with float32 inputs, with
low-precision inputs and with mixed inputs, records the casts autocast inserts, and classifies
the op from what happened. It does so on this build's own device, and on every other device
type whose autocast kernels this torch build carries by simulating it: fake tensors on that
device under its autocast, so the dispatcher applies that device's real rules over meta
kernels and no kernel runs.
"""

# %%
# Setup
# -----
import textwrap
from collections import Counter

import torch

from mpguide.autocast import policy
from mpguide.core import device, dtypes, versions
from mpguide.core.table import Table

dev = device.pick()
device.describe(dev)

# %%
# The ops this build registers
# ----------------------------
# :func:`mpguide.autocast.catalogue.registered` reads the dispatcher of the installed torch:
# every ATen op with an autocast kernel (not a fallthrough), per device type. A device type can
# be simulated when a fake tensor on it carries that autocast dispatch key; a device this
# machine has runs for real.
from mpguide.autocast import catalogue

kernels = device.autocast_kernels()
simulable = device.simulated_types()
entries = catalogue.entries()
sources = Counter(e.source for e in entries)
Table(
    ("device type", "ops (overloads)", "simulated here", "on this machine"),
    tuple(
        (t, f"{len(catalogue.on(t))} ({n})", "yes" if t in simulable else "no",
         "yes" if device.present(t) else "no")
        for t, n in kernels.items()
    ),
    f"autocast kernels registered in torch {torch.__version__}",
)

# %%
# The inputs of each op: an OpInfo sample where torch has an OpInfo for the op, else a
# hand-written call, else none (listed, not probed).
assert {"cpu", "cuda"} <= set(simulable)
assert len(entries) == len(set().union(*(catalogue.on(t) for t in kernels)))
assert sum(len(catalogue.on(t)) > 50 for t in ("cpu", "cuda")) == 2
print(f"{len(entries)} ops have an autocast kernel on some device; inputs: "
      + ", ".join(f"{sources[k]} {k}" for k in (catalogue.OPINFO, catalogue.HAND, catalogue.NONE)))
print("no inputs: " + (", ".join(e.name for e in entries if e.op is None) or "none"))
print(f"probed below: {', '.join(simulable)}")

# %%
# Probing bf16 on every device
# ----------------------------
# Each op runs three ways. The class comes from the outcome: ``lower precision`` when float32
# inputs come out in bf16, ``float32`` when bf16 inputs come out in float32, ``promote`` when
# autocast casts mixed inputs to the widest dtype, ``unchanged`` when it casts nothing,
# ``unsupported`` when the op raises on uniform inputs (autocast refuses it, or the kernel
# refuses the dtype), and, on a simulated device, ``needs hardware`` where neither the dispatch
# rules nor the CPU can tell.
bf16 = policy.across(torch.bfloat16)
cpu, cuda = bf16["cpu"], bf16["cuda"]
Table(
    ("class", *bf16.labels),
    tuple((k, *(p.counts()[k] for p in bf16.policies)) for k in policy.CLASSES),
    bf16.caption,
)

# %%
# How much of each device's registered ops the tables decide:
coverage = catalogue.coverage(bf16)
for p in bf16.policies:
    assert len(p.probes) == len(catalogue.ops())
    if p.how == device.LIVE:
        assert not p.ops(policy.NEEDS_HARDWARE), p.device
print(coverage)

# %%
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
# real CPU kernel rejects (or returns another dtype); :func:`mpguide.autocast.policy.meta_gaps`
# finds those runs. A simulated device checks each of its runs against them: where its
# autocast hands the kernel the inputs the failing CPU run had, the cell is undecided, and the
# op ``needs hardware`` when that cell is the one its class rests on; where its autocast casts
# the inputs first (``mv`` on CUDA makes both bf16), the CPU's gap does not apply.
simulated_cpu = policy.probe("cpu", torch.bfloat16, simulate=True)
check = policy.differences(cpu, simulated_cpu)
gaps = policy.meta_gaps(torch.bfloat16, policy.registered())
agree = len(cpu.probes) - len(check.rows)
print(f"simulated cpu gives the real cpu's class for {agree} of {len(cpu.probes)} ops")
assert all(r[3] == policy.NEEDS_HARDWARE for r in check.rows), check.rows
assert all(simulated_cpu[r[0]].note for r in check.rows)
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
title = fig.suptitle(f"autocast classes that differ between devices, bf16, torch "
                     f"{torch.__version__}", fontsize=9)
fig.tight_layout()
fig.canvas.draw()
assert title.get_window_extent().y1 <= fig.bbox.y1  # the title is inside the saved figure

# %%
bf16.differences()

# %%
# CPU and CUDA, op by op
# ----------------------
# The questions readers ask most have different answers on the two devices. Reductions,
# softmax, norms and most transcendental functions run in float32 under CUDA autocast and are
# left alone by the CPU's; ``mv``, ``addmv`` and ``addr`` go to bf16 on CUDA and are left alone
# on the CPU.
# (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
rms_norm = versions.change("rms_norm_cuda_autocast")
print(rms_norm.describe())
to_float32_on_cuda = (
    "sum", "cumsum", "softmax", "log_softmax", "logsumexp", "layer_norm", "group_norm", "exp",
    "log", "pow", *(("rms_norm",) if rms_norm.holds else ()),
)
lower_on_cuda = ("mv", "addmv", "addr")
for op in to_float32_on_cuda:
    assert cpu.kind(op) == policy.UNCHANGED, (op, cpu.kind(op))
    assert cuda.kind(op) == policy.FLOAT32, (op, cuda.kind(op))
    assert cuda[op].low_in.out == torch.float32 and cpu[op].low_in.out == torch.bfloat16
assert ("cuda" in catalogue.registered().get("rms_norm", {})) == rms_norm.holds
for op in lower_on_cuda:
    assert cpu.kind(op) == policy.UNCHANGED and cuda.kind(op) == policy.LOWER, op
differing = bf16.differing("cpu", "cuda")
print(f"{len(differing)} of {len(cpu.probes)} ops differ between cpu ({cpu.how}) and cuda "
      f"({cuda.how})")
Table(
    ("op", "cpu: bf16 in", "cuda: bf16 in", "cpu class", "cuda class"),
    tuple(
        (op, cpu[op].low_in.out, cuda[op].low_in.out, cpu.kind(op), cuda.kind(op))
        for op in (*to_float32_on_cuda, *lower_on_cuda)
    ),
    "bf16 inputs under autocast",
)

# %%
# The matmul family and convolutions
# ----------------------------------
# ``matmul``, ``mm``, ``bmm``, ``linear`` and ``conv2d`` come out in bf16 from float32 inputs on
# every device probed, autocast inserting the float32 -> bf16 casts. The rest of the family is
# not as uniform: the table lists, per device, the matmul and convolution ops that do not (on
# CUDA, ``dot``, ``vdot``, ``tensordot`` and ``bilinear`` are on the promote list).
# (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
family = ("matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "mv", "addmv", "addr", "dot",
          "vdot", "tensordot", "einsum", "bilinear", "linear", "chain_matmul",
          "linalg_multi_dot", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
          "conv_transpose2d", "conv_transpose3d")
for p in bf16.policies:
    for op in ("matmul", "mm", "bmm", "linear", "conv2d"):
        assert p.kind(op) == policy.LOWER, (p.device, op)
        assert "float32->bfloat16" in p[op].casts, (p.device, op)
not_lower = {p.device: [op for op in family if p.kind(op) != policy.LOWER]
             for p in bf16.policies}
assert {"mv", "addmv", "addr", "dot", "vdot", "bilinear"} <= set(not_lower["cpu"])
if cuda.how == device.SIMULATED:
    assert {cuda.kind(op) for op in ("dot", "vdot", "tensordot", "bilinear")} == {policy.PROMOTE}
print(f"matmul, mm, bmm, linear, conv2d: lower precision on {', '.join(bf16.labels)}")
Table(
    ("device", "matmul and convolution ops not in lower precision"),
    tuple((label, ", ".join(f"{op} ({bf16[d].kind(op)})" for op in ops) or "none")
          for label, (d, ops) in zip(bf16.labels, not_lower.items(), strict=True)),
    f"of {len(family)} matmul and convolution ops, bf16",
)

# %%
# What simulation cannot decide
# -----------------------------
# A simulated op whose meta kernel raises with autocast off as well is decided where it can
# be: by the casts autocast inserted before the kernel raised (``lower precision`` or
# ``float32``), or, where autocast cast nothing and the real CPU kernel raises too, as
# ``unsupported`` (the kernel refuses the dtype). What is left, and the runs whose meta kernel
# is known to accept what a real kernel rejects, is ``needs hardware``, with the reason: here
# mostly linear algebra whose CPU kernels have no bf16 (``cholesky_cpu`` not implemented for
# 'BFloat16') and whose meta kernels take it, so that only the device's own kernel can tell.
# Numerics and timings always need hardware; dtype rules do not.
undecided = Table(
    ("device", "op", "reason"),
    tuple(
        (p.device, name, p[name].note)
        for p in bf16.policies
        for name in p.ops(policy.NEEDS_HARDWARE)
    ),
    "needs hardware",
)
assert all(p[name].note for p in bf16.policies for name in p.ops(policy.NEEDS_HARDWARE))
if cuda.how == device.SIMULATED:
    for op in ("linalg_cholesky", "linalg_qr", "linalg_solve", "linalg_eigh"):
        assert cuda.kind(op) == policy.NEEDS_HARDWARE, op
        assert "the CPU kernel refuses" in cuda[op].note, op
    # mv's mixed inputs: CUDA autocast casts both to bf16 first, so the CPU's gap does not apply
    # (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
    assert cuda["mv"].undecided == () and cuda["mv"].mixed_in.out == torch.bfloat16
    # pdist: CUDA autocast casts bf16 inputs to float32, which the CPU kernel takes
    # (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
    assert cuda.kind("pdist") == policy.FLOAT32
# Autocast itself refuses binary_cross_entropy on CUDA, float32 inputs too; outside autocast
# the same call runs.
# (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
bce = cuda["binary_cross_entropy"]
assert cuda.kind("binary_cross_entropy") == policy.UNSUPPORTED
assert bce.fp32_in.error is not None and bce.fp32_in.error_outside is None
print(f"cuda binary_cross_entropy, float32 inputs: {bce.fp32_in.error}")
undecided

# %%
# bf16 against fp16
# -----------------
# On the CPU and on CUDA, the fp16 policy against the bf16 one: the ops that change class are
# listed with the reason.
# (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
fp16_cpu = policy.probe("cpu", torch.float16)
fp16_cuda = policy.probe("cuda", torch.float16)
cpu_16 = policy.differences(cpu, fp16_cpu)
cuda_16 = policy.differences(cuda, fp16_cuda)
print(f"cpu: {len(cpu_16.rows)} ops change class; cuda: {len(cuda_16.rows)}")
assert fp16_cpu.kind("matmul") == fp16_cuda.kind("matmul") == policy.LOWER
assert fp16_cuda.kind("softmax") == policy.FLOAT32
cpu_16

# %%
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
# Every op where a recorded GPU and the simulation disagree
# ---------------------------------------------------------
# Each recording of CUDA's policy, bf16 and fp16, against this build's simulated CUDA column:
# how many ops differ, how many of those the simulation left to hardware (``needs hardware``),
# and every op it decided otherwise, with the GPU's note. A recording made on another torch
# release can also differ where a rule changed between the two (see *Across releases* below).
recorded_rows, decided_rows, left_rows = [], [], []
for rec in record.recordings():
    for simulated in (cuda, fp16_cuda):
        key = f"autocast.policy.{dtypes.name(simulated.dtype)}"
        if key not in rec.tables or simulated.how != device.SIMULATED:
            continue
        diff = policy.against_recording(simulated, rec.tables[key])
        decided = [r for r in diff.rows if r[2] != policy.NEEDS_HARDWARE]
        # what the simulation gets wrong, it gets wrong one way: the GPU's kernel refused
        # inputs that the meta kernel and the CPU accepted
        assert all(r[3] == policy.UNSUPPORTED for r in decided), decided
        where = f"{rec.provenance.name}, torch {rec.provenance.torch}"
        recorded_rows.append((dtypes.short(simulated.dtype), where, len(diff.rows),
                              len(diff.rows) - len(decided), len(decided)))
        decided_rows += [(dtypes.short(simulated.dtype), *r) for r in decided]
        left_rows += [(dtypes.short(simulated.dtype), r[0], r[3], where)
                      for r in diff.rows if r[2] == policy.NEEDS_HARDWARE]
Table(("dtype", "recorded on", "ops differing", "left to hardware", "decided otherwise"),
      tuple(recorded_rows),
      f"recorded CUDA policies against this build's simulation (torch {torch.__version__})")

# %%
Table(("dtype", "op", "family", "simulated", "on the GPU", "note"), tuple(decided_rows),
      "ops the simulation decided and a GPU classed otherwise")

# %%
# And the ops the simulation left to hardware, with the class the GPU gave them (its notes are
# in the recorded table above):
Table(("dtype", "op", "on the GPU", "recorded on"), tuple(left_rows),
      "ops simulated as 'needs hardware', as a GPU classed them")

# %%
# Across releases
# ---------------
# Facts of this table that changed inside the supported window of torch releases, each stated
# for the running torch and asserted (:mod:`mpguide.core.versions`).
addmv = versions.change("addmv_cpu_mixed_bias")
quantile = versions.change("quantile_internal_float64")
rfft = versions.change("bf16_fft_simulated_cuda")
for fact in (rms_norm, addmv, quantile, rfft):
    print(fact.describe())
assert (cpu["addmv"].mixed_in.error is not None) == addmv.holds
if not addmv.holds:
    assert cpu["addmv"].mixed_in.out == torch.float32
with dtypes.Log() as quantile_log:
    torch.quantile(torch.randn(16), 0.5)
assert bool(quantile_log.conversions()) == quantile.holds
assert cpu["quantile"].low_in.casts == ((torch.bfloat16, torch.float32),)  # autocast's only
if cuda.how == device.SIMULATED:
    assert cuda.kind("fft_rfft") == (policy.FLOAT32 if rfft.holds else policy.UNSUPPORTED)
    assert cuda["fft_rfft"].casts == ()  # CUDA autocast has no rule for it either way

# %%
# What ``torch.autocast`` itself accepts
# --------------------------------------
# Before any op runs, :class:`torch.autocast` checks the device and the dtype in Python: it may
# accept the dtype, warn and disable itself, or raise.
# :func:`mpguide.autocast.accepts.checks` constructs it for every device type and dtype: live
# on this machine's devices; simulated elsewhere, with the device's availability queries
# answering as on a machine that has it (for CUDA, a GPU with bf16, and one without).
from mpguide.autocast import accepts

base = accepts.checks()
found = base
if not device.present("cuda"):
    found += (accepts.check("cuda", torch.bfloat16, simulate=True, bf16=False),
              accepts.check("cuda", torch.bfloat16, simulate=False))
python_checks = {(c.device, c.dtype, c.on): c for c in found}
accepts.table(found)

# %%
# Asserted: every device accepts bf16 and fp16; the CPU, MPS and XPU warn on float32 and
# disable autocast; CUDA's checks let float32 and float64 through with no warning (autocast
# then casts to that dtype); a CUDA GPU without bf16 refuses bf16; and on a machine without a
# GPU, CUDA autocast warns and disables itself, so nothing is cast.
# (CUDA here: live on a GPU, simulated from this build's dispatch rules elsewhere.)
for c in found:
    if c.dtype in (torch.bfloat16, torch.float16) and c in base:
        assert c.outcome == "accepted" and c.casts_to == c.dtype, c
for d in ("cpu", "mps", "xpu"):
    c = python_checks[d, torch.float32, "this machine" if d == "cpu" else "the device"]
    assert c.outcome == "autocast disabled" and "not supported" in c.warning, c
cuda_on_gpu = "this machine" if device.present("cuda") else "a GPU with bf16"
assert python_checks["cuda", torch.float32, cuda_on_gpu].outcome == "accepted"
assert python_checks["cuda", torch.float32, cuda_on_gpu].warning == ""
if not device.present("cuda"):
    assert python_checks["cuda", torch.bfloat16, "a GPU without bf16"].outcome == "raises"
    no_gpu = python_checks["cuda", torch.bfloat16, "this machine"]
    assert no_gpu.outcome == "autocast disabled" and no_gpu.warning
    print(f"torch.autocast('cuda') on this machine (live): {no_gpu.warning}")

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
# - The catalogue is what this torch registers: every op with an autocast kernel on some
#   device, probed on every device, with the count per device and how many were decided.
# - Simulating the CPU reproduces the real CPU policy except where an op's meta kernel is
#   more permissive than the real one; a simulated device marks those cells ``needs
#   hardware`` only where its autocast hands the kernel the same inputs.
# - Reductions, softmax, norms, ``exp``, ``log`` and ``pow`` run in float32 under CUDA autocast
#   and keep bf16 under the CPU's; ``mv``, ``addmv`` and ``addr`` go to bf16 on CUDA only.
# - ``torch.autocast`` accepts bf16 and fp16 on every device; the CPU, MPS and XPU disable it
#   with a warning for float32, while CUDA's checks let float32 through (simulated unless this
#   build ran on a GPU).
# - ``matmul``, ``mm``, ``bmm``, ``linear`` and ``conv2d`` run in bf16 on every device probed;
#   other matmul and convolution ops do not on every device (the table above).
#
# .. admonition:: References
#
#    :torchdoc:`amp.html#autocast-op-reference`, :torchapi:`torch.autocast`,
#    :torchdoc:`torch.compiler_fake_tensor.html`, :torchdoc:`notes/extending.html`

"""
The casts of a training step
============================

Where do the casts of a mixed-precision training step come from, and what share of the step
do they take? We profile one step of a small transformer block (attention, MLP, norms, loss)
with float32 weights under bf16 autocast, forward and backward, and run the cast report on
the trace: every Linear's weight is cast down in the forward pass and its gradient cast up
in the backward pass, on every step.
"""

# %%
# Setup
# -----
# Everything below runs on the device :func:`mpguide.core.device.pick` chooses: CUDA when present,
# else the CPU.
import torch

from mpguide.core import device

dev = device.pick()
device.describe(dev)

# %%
# A transformer block and its training step
# -----------------------------------------
# Pre-norm attention and MLP, then a vocabulary head and a cross-entropy loss computed in
# float32. The weights stay float32 (the master weights); autocast runs the matmuls in bf16.
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int = 64, heads: int = 4, vocab: int = 256):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return self.head(x)


torch.manual_seed(0)
model = Block().to(dev)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
tokens = torch.randn(4, 32, 64, device=dev)
targets = torch.randint(256, (4, 32), device=dev)


def train_step():
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        logits = model(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# %%
# Profile one step and report its casts
# -------------------------------------
from mpguide.traces import casts
from mpguide.traces.profiling import profile_fn

tree = profile_fn(train_step).tree()
report = casts.report(tree)
report.summary("cause")

# %%
# By dtype pair and by pass:
report.summary("pair")

# %%
report.summary("pass")

# %%
# Every Linear's float32 weight is cast to bf16 in the forward pass, caused by
# ``aten::linear``, and the gradient of that cast comes back as a bf16 to float32 up-cast in
# the backward pass.
linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
for lin in linears:
    shape = tuple(lin.weight.shape)
    assert any(c.cause == "aten::linear" and not c.backward and c.shape == shape
               and (c.source, c.target) == ("float32", "bfloat16") for c in report), shape
    assert any(c.backward and c.shape == shape and (c.source, c.target) == ("bfloat16", "float32")
               for c in report), shape
print(f"{len(linears)} Linear weights: each cast down in forward and its gradient up in backward")

# %%
# Cast time by cause and direction
# --------------------------------
# The time is kernel time on a GPU and op time on the CPU; the bars split each cause into
# down-casts and up-casts.
from mpguide import plots

on_gpu = dev.type == "cuda"
fig = plots.cast_costs(report, title=f"Casts of one training step, {device.describe(dev).caption()}")
assert len(fig.axes[0].get_yticklabels()) == len({c.cause for c in report})

# %%
# Share of the step
# -----------------
# The step is the ``ProfilerStep#N`` range on the CPU side. On the CPU the share is over its
# duration; on a GPU over the time of the kernels launched during it, by any thread: autograd
# runs the backward pass on a thread of its own, whose launches fall inside the step's time
# but not under its node. The check below counts those kernels one by one.
import math

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def launched_during(tree, step) -> float:
    """Time of the GPU work whose launch began during ``step``, on any thread."""
    end = step.start + step.dur
    return sum(
        n.dur
        for n in tree.find(predicate=lambda n: n.cat in GPU_WORK and n.parent is not None)
        if step.start <= n.parent.start < end
    )


(step,) = tree.steps()
cast_us, step_us, share = report.share_of_steps(gpu=on_gpu)
assert math.isclose(step_us, launched_during(tree, step) if on_gpu else step.dur, rel_tol=1e-9)
assert 0 < share < 1
print(f"{len(report)} casts took {cast_us:.0f} us of a {step_us:.0f} us step: {share:.1%}")

# %%
# Cast costs recorded on a GPU
# ----------------------------
# On a GPU the casts are kernels whose time the profiler measures on the device. Recordings
# made on GPU machines with ``nox -s record`` profile one autocast training step of a
# 4-layer, width-1024 transformer encoder (``mpguide.core.record``) and show its casts by cause,
# labelled with where, when and by which command they were measured.
import dataclasses

from mpguide.core import record
from mpguide.core.table import Table

STALE = ("gpu share of step", "cast share of step")


def without_stale_shares(found: record.Beside) -> record.Beside:
    """The recorded tables without their GPU share of the step: the recordings were made by
    an earlier mpguide, which counted only the kernels the main thread launched (see below)."""

    def drop(table: Table) -> Table:
        keep = [i for i, c in enumerate(table.columns) if c not in STALE]
        rows = tuple(tuple(r[i] for i in keep) for r in table.rows)
        return Table(tuple(table.columns[i] for i in keep), rows, table.caption, table.notes)

    return dataclasses.replace(found, recorded=tuple((p, drop(t)) for p, t in found.recorded))


without_stale_shares(record.beside("profiler.training_step_casts"))

# %%
# The same step with the encoder compiled by inductor, beside the eager one, recorded on the
# GPU: the cast ops left per step and their kernel time, and the kernels inductor fused casts
# into (their whole time, casts and the work around them).
compiled_casts = record.beside("compile.training_step_casts")
without_stale_shares(compiled_casts)

# %%
# The recorded step's share, recomputed from its trace
# ----------------------------------------------------
# The recordings above were made by an earlier mpguide, whose GPU share of the step counted
# only the kernels launched under the step's node, by the main thread: the backward pass's
# kernels, launched by autograd's engine thread, were left out of the step, so the share came
# out too high; those columns are left out above. The trace of the same eager step, recorded
# on the H100 with the Python stack and stored in the repository
# (``tests/data/gpu/h100_mpguide_bf16_train_step.json.gz``; ``tests/data/gpu/PROVENANCE.md``
# says when and by which command), gives the share with every kernel of the step counted.
# This is recomputed from the stored trace each time the page is built.
from collections import Counter
from pathlib import Path

from mpguide.traces import trace

try:
    HERE = Path(__file__).resolve().parent
except NameError:  # run cell by cell
    HERE = Path.cwd()
STORED = HERE.parents[1] / "tests" / "data" / "gpu" / "h100_mpguide_bf16_train_step.json.gz"
h100_tree = trace.load(STORED, args_of=casts.needs_args).tree(python=True)
h100 = casts.report(h100_tree)
(h100_step,) = h100_tree.steps()
by_thread = Counter()
for kernel in h100_tree.find(predicate=lambda n: n.cat in GPU_WORK and n.parent is not None):
    if h100_step.start <= kernel.parent.start < h100_step.start + h100_step.dur:
        by_thread[h100_tree.trace.tid.value(kernel.parent.id)] += kernel.dur
main_thread = h100_tree.trace.tid.value(h100_step.id)
under_node = by_thread[main_thread]
assert math.isclose(under_node, h100_step.gpu_time, rel_tol=1e-9)
h100_cast_us, h100_step_us, h100_share = h100.share_of_steps(gpu=True)
assert math.isclose(h100_step_us, sum(by_thread.values()), rel_tol=1e-9)
assert len(by_thread) == 2 and under_node < h100_step_us / 2
backward = [  # the other thread's launches are autograd's: inside its backward nodes
    k for k in h100_tree.find(predicate=lambda n: n.cat in GPU_WORK and n.parent is not None)
    if h100_tree.trace.tid.value(k.parent.id) != main_thread
]
assert backward and all(
    any(a.name.startswith(casts.BACKWARD_MARK) for a in k.ancestors()) for k in backward
)
for tid, us in by_thread.most_common():
    who = "the main thread, under the step's node" if tid == main_thread else "autograd's thread"
    print(f"thread {tid} ({who}): {us:,.1f} us of kernels launched during the step")
print(f"recorded H100 step, recomputed from its trace: {h100_cast_us:,.1f} us of cast kernels "
      f"over {h100_step_us:,.1f} us of step kernels = {h100_share:.1%} "
      f"(the main thread's kernels alone would give {h100_cast_us / under_node:.1%})")

# %%
# The recording's own figure had the main thread's kernels as its denominator: its cast
# kernel time over its share gives about the main thread's kernel time in the stored trace.
for provenance, table in compiled_casts.recorded:
    (eager,) = table.where(step="eager").records()
    recorded_share = float(eager["cast share of step"].rstrip("%")) / 100
    denominator = eager["cast kernel us"] / recorded_share
    assert abs(denominator / under_node - 1) < 0.02, (denominator, under_node)
    print(f"{provenance.label()}: cast share of step {eager['cast share of step']} = "
          f"{eager['cast kernel us']:,.1f} us over {denominator:,.0f} us, the main thread's "
          f"kernels only; superseded by the {h100_share:.1%} above")

# %%
# What we saw
# -----------
# - With float32 weights under bf16 autocast, each Linear's weight is cast down in every
#   forward pass and the gradient is cast back up in every backward pass: the assertions
#   above check this for all the block's Linear layers.
# - The report names the cause of every cast and splits the cost by direction; the share of
#   the step printed above is this machine's, for this small block.
# - On a GPU the step's kernel time counts the kernels autograd's thread launches for the
#   backward pass: on the recorded H100 step they are most of it, and the cast share printed
#   above from the stored trace counts them (the recordings' own share did not).
#
# .. admonition:: References
#
#    :torchapi:`torch.autocast`, :torchdoc:`amp.html`,
#    :torchapi:`torch.nn.functional.scaled_dot_product_attention`,
#    :torchapi:`torch.profiler.profile`

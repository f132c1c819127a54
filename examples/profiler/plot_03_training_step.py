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
# The step is the ``ProfilerStep#N`` range on the CPU side: on the CPU its duration, on a GPU
# the kernel time launched inside it.
(step,) = tree.steps()
cast_us, step_us, share = report.share_of_steps(gpu=on_gpu)
assert step_us == (step.gpu_time if on_gpu else step.dur) and 0 < share < 1
print(f"{len(report)} casts took {cast_us:.0f} us of a {step_us:.0f} us step: {share:.1%}")

# %%
# Cast costs recorded on a GPU
# ----------------------------
# On a GPU the casts are kernels whose time the profiler measures on the device. Recordings
# made on GPU machines with ``nox -s record`` profile one autocast training step of a
# 4-layer, width-1024 transformer encoder (``mpguide.core.record``) and show its casts by cause,
# labelled with where, when and by which command they were measured.
from mpguide.core import record

record.beside("profiler.training_step_casts")

# %%
# The same step with the encoder compiled by inductor, beside the eager one, recorded on the
# GPU: the cast ops left per step and their kernel time, and the kernels inductor fused casts
# into (their whole time, casts and the work around them).
record.beside("compile.training_step_casts")

# %%
# What we saw
# -----------
# - With float32 weights under bf16 autocast, each Linear's weight is cast down in every
#   forward pass and the gradient is cast back up in every backward pass: the assertions
#   above check this for all the block's Linear layers.
# - The report names the cause of every cast and splits the cost by direction; the share of
#   the step printed above is this machine's, for this small block.
#
# .. admonition:: References
#
#    :torchapi:`torch.autocast`, :torchdoc:`amp.html`,
#    :torchapi:`torch.nn.functional.scaled_dot_product_attention`,
#    :torchapi:`torch.profiler.profile`

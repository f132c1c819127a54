"""
A complete recipe: five ways to train the same model
====================================================

Which precision setup should a training loop use? We train one small next-character model
with AdamW five ways on this build's device, in lockstep from the same weights on the same
batches: float32, bf16 autocast, fp16 autocast with a GradScaler, pure bf16, and pure bf16
with stochastic rounding. We plot the held-out loss, and table the final loss, the memory
each setup keeps per parameter, and the time per step. Both autocast setups and stochastic
rounding end within a small fraction of pure bf16's gap to float32; pure bf16 halves the
memory of the float32 setups and trails them; the timings are this machine's.
"""

# %%
# Setup
# -----
# Everything runs on the device :func:`mpguide.core.device.pick` chooses: CUDA when present,
# else the CPU.
import torch

from mpguide.core import device
from mpguide.core.table import Table
from mpguide.training import loop, loss_scaling

dev = device.pick()
device.describe(dev)

# %%
# The five recipes
# ----------------
# Each is a :class:`mpguide.training.loop.Recipe`: the dtype the weights are held in, the autocast
# dtype, how the optimizer updates the weights, and a GradScaler where fp16 needs one.
# Stochastic rounding uses :class:`mpguide.training.optimizers.RoundedAdamW`, torch's AdamW
# arithmetic in float32 written back to bf16 weights stochastically (see the optimizer precision
# page).
KEYS = ("fp32", "autocast-bf16", "autocast-fp16", "bf16", "bf16-stochastic")
Table(("recipe", "short name", "setup"),
      tuple((loop.RECIPES[k].name, k, loop.RECIPES[k].setup) for k in KEYS))

# %%
# The training loop
# -----------------
# This is what :func:`mpguide.training.loop.train` runs for each recipe at every step, written out
# for one recipe (fp16 autocast with a GradScaler) and one step:
import torch.nn.functional as F

task = loop.char_task()
model = task.model(seed=0).to(dev)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scaler = torch.amp.GradScaler(dev.type)
x, y = task.batch(64, torch.Generator(device=dev).manual_seed(0))

with torch.autocast(dev.type, dtype=torch.float16):
    logits = model(x)
loss = F.cross_entropy(logits.float(), y)
scaler.scale(loss).backward()
scaler.step(optimizer)
scaler.update()
optimizer.zero_grad(set_to_none=True)
print(f"logits {logits.dtype}, loss {loss.dtype} {loss.item():.4f}, "
      f"weights {next(model.parameters()).dtype}, scale {scaler.get_scale():g}")
assert logits.dtype == torch.float16 and loss.dtype == torch.float32

# %%
# All five, 200 steps each
# ------------------------
# Batches of 64 windows, AdamW with a learning rate of ``3e-3`` on a cosine to zero and weight
# decay ``0.01``. Each step of each recipe is timed (device-synchronised) around its forward,
# backward and optimizer step; the recipes step in turn on the same batch, so a background
# load on this shared machine hits them alike. Every 10 steps the weights are evaluated in
# float32 on held-out text.
runs = loop.train(KEYS, task, steps=200, dev=dev)
runs

# %%
from mpguide import plots

_ = plots.training_runs(runs, title=f"five recipes, {runs.machine.caption()}")

# %%
# Recorded on a GPU
# -----------------
# Every recipe of :data:`mpguide.training.loop.RECIPES`, 60 steps each on the same task, timed
# on a GPU machine by ``nox -s record`` and labelled with its provenance. The model is small,
# so a step there is bound by kernel launches more than by arithmetic: the time ratios say
# what each recipe adds in extra kernels (the rounding and compensation steps), not what a
# large model would gain from bf16 matrix units.
from mpguide.core import record

record.beside("training.recipes")

# %%
# The loss each recipe reached
# ----------------------------
fp32 = runs["fp32"]
gap = {k: runs[k].final - fp32.final for k in KEYS}
print(", ".join(f"{runs[k].name}: {gap[k]:+.4f}" for k in KEYS))
assert gap["bf16"] > 0.02
for k in ("autocast-bf16", "autocast-fp16", "bf16-stochastic"):
    assert abs(gap[k]) < gap["bf16"] / 4, k
fp16 = runs["autocast-fp16"]
assert fp16.skipped == tuple(i for i, inf in enumerate(fp16.found_inf) if inf)
assert fp16.scales == loss_scaling.scale_schedule(fp16.found_inf, 2.0**16)
print(f"{fp16.name}: {len(fp16.skipped)} steps skipped, scale "
      f"{fp16.scales[0]:g} -> {fp16.scales[-1]:g}")

# %%
# Memory and time
# ---------------
# The bytes each recipe keeps per parameter between steps, and its step time against
# float32's, from the table above:
times = {k: runs[k].latency for k in KEYS}
Table(("recipe", "bytes/param", "median ms/step", "IQR ms", "x fp32", "faster than fp32 beyond the spread"),
      tuple((runs[k].name, runs[k].bytes_per_parameter, times[k].median * 1e3, times[k].spread * 1e3,
             f"{times[k].median / times['fp32'].median:.2f}", times[k].clearly_below(times["fp32"]))
            for k in KEYS),
      f"{runs.machine.caption()}; a shared machine, each step timed in turn")

# %%
# Autocast keeps float32 weights and states (12 bytes per parameter with AdamW, as float32);
# pure bf16 holds them in bf16 (6 bytes), and stochastic rounding keeps pure bf16's memory.
for k in ("fp32", "autocast-bf16", "autocast-fp16"):
    assert runs[k].bytes_per_parameter == 12
for k in ("bf16", "bf16-stochastic"):
    assert runs[k].bytes_per_parameter == 6
assert all(p.dtype == torch.float32 for p in runs["autocast-bf16"].model.parameters())
assert all(p.dtype == torch.bfloat16 for p in runs["bf16"].model.parameters())

# %%
# The timings are this machine's and are not asserted. A CPU without bf16 or fp16 matrix
# instructions converts to and from the low-precision dtypes around float32 arithmetic, so
# autocast can be slower than float32 there; the table above says what happened on this one.
# On a GPU with bf16 and fp16 tensor cores, autocast's matmuls run on them; timings on a GPU
# need the hardware: run this page there.
#
# What to choose when
# -------------------
# From what this page and the two before it measured:
#
# - **bf16 autocast** when the hardware has bf16 (on CUDA, ``torch.cuda.is_bf16_supported()``):
#   float32 weights and states, no scaler, and a loss that stayed within a quarter of pure
#   bf16's gap to float32 here.
# - **fp16 autocast with a GradScaler** where bf16 is missing: the same memory, a loss as
#   close, and a skipped step wherever the scaled gradients overflow (this run's count is
#   printed above, and may be zero). Without the
#   scaler, the loss-scaling page lost more than 1% of the activation gradients to zero.
# - **pure bf16** only where memory decides: it halves the weights and states and trails
#   float32, because bf16 weights and moments drop small updates (see the optimizer precision
#   page).
# - **pure bf16 with stochastic rounding** (or Kahan summation, 2 more bytes per parameter)
#   to keep pure bf16's memory and get most of the lost loss back.
# - **float32** as the reference every other setup is measured against.
#
# What we saw
# -----------
# - From the same weights on the same batches, bf16 autocast, fp16 autocast with a
#   GradScaler, and pure bf16 with stochastic rounding each ended within a quarter of pure
#   bf16's gap to float32's held-out loss; pure bf16 ended more than 0.02 above it.
# - The GradScaler skipped exactly the steps whose scaled gradients held an inf or NaN, and
#   its scale followed the documented rule.
# - Autocast keeps 12 bytes per parameter with AdamW, as float32 does; pure bf16, with or
#   without stochastic rounding, keeps 6.
#
# .. admonition:: References
#
#    :torchapi:`torch.autocast`, :torchapi:`torch.amp.GradScaler`,
#    :torchapi:`torch.optim.AdamW`, :torchdoc:`amp.html`,
#    :torchdoc:`notes/amp_examples.html`, :torchapi:`torch.cuda.is_bf16_supported`

"""
Layers with state or masks: norms, embeddings, attention
========================================================

Which layers of a model do not follow autocast's rules, and what do they keep between steps?
We call each normalization layer under bf16 autocast on the CPU and on CUDA (simulated from
this build's dispatch rules where there is no GPU) and read the dtype its statistics op
takes, the dtype it returns and the dtype it stores; train BatchNorms whose buffers are float32, bf16 and fp16;
send an fp16 overflow into a norm; sum an embedding row's gradient in each table dtype; and
pass attention masks of each kind through ``scaled_dot_product_attention`` under autocast.
The answer: BatchNorm has no autocast rule on either device and keeps float32 running
statistics, while LayerNorm, GroupNorm and RMSNorm (since torch 2.12) run in float32 on CUDA
and in the input's dtype on the CPU; bf16 running statistics stop short of the mean they track; an fp16 overflow
upstream turns a norm's output, and a BatchNorm's running statistics, into NaN for good; a
bf16 embedding table loses precision in its summed gradients; and autocast casts float
attention masks to the low-precision dtype, where large negative values become ``-inf``.
"""

# %%
# Setup
# -----
import torch
import torch.nn.functional as F
from torch import nn

from mpguide.core import device, dtypes, versions
from mpguide.core.table import Table
from mpguide.training import grad_sums, norm_layers

dev = device.pick()
device.describe(dev)
bf16, fp16 = torch.bfloat16, torch.float16

# %%
# What a norm takes, returns and keeps
# ------------------------------------
# :func:`mpguide.training.norm_layers.norms` builds each layer with float32 parameters (as a model
# under autocast has them), hands it the bf16 activations a matmul under autocast returns, and calls
# it under bf16 autocast, with :class:`mpguide.core.dtypes.Log` recording every op. "Statistics op
# takes" is the dtype of the input of the op that computes the mean and variance (the fused
# kernel, or the mean of squares where RMSNorm decomposes; a fused kernel may accumulate in
# float32 inside, which no log sees); "running statistics" is what a BatchNorm stores
# between steps. CUDA runs live on a GPU machine, else on fake tensors under CUDA's
# autocast.
norms = norm_layers.norms(bf16, devices=("cpu", "cuda"))
norms

# %%
# BatchNorm has no autocast rule on either device (CUDA live on a GPU, simulated without one): its
# kernel takes the bf16 input with the float32 weight and running statistics, returns bf16 and
# updates float32 buffers. LayerNorm, GroupNorm and RMSNorm (since torch 2.12) run in float32 under
# CUDA's autocast (a bf16 -> float32 cast, a float32 output), and stay in bf16 under the CPU's.
# RMSNorm without an autocast rule (the CPU's, and CUDA's before 2.12) refuses its fused kernel for
# a bf16 input with a float32 weight, warns, and computes in float32 through its decomposition,
# casting back to bf16. This torch:
rms_rule = versions.change("rms_norm_cuda_autocast")
print(rms_rule.describe())
assert rms_rule.since == "2.12"  # the release this page's prose names
cuda_how = norms["LayerNorm", "cuda"].how
float32_on_cuda = ("LayerNorm", "GroupNorm", "RMSNorm") if rms_rule.holds else (
    "LayerNorm", "GroupNorm")
for where in ("cpu", "cuda"):
    bn = norms["BatchNorm1d", where]
    assert (bn.computes, bn.out, bn.keeps, bn.casts) == (bf16, bf16, torch.float32, ()), where
for layer in float32_on_cuda:
    on_cuda = norms[layer, "cuda"]
    assert (on_cuda.computes, on_cuda.out) == (torch.float32, torch.float32), layer
    assert (bf16, torch.float32) in on_cuda.casts and on_cuda.keeps is None, layer
for layer in ("LayerNorm", "GroupNorm"):
    on_cpu = norms[layer, "cpu"]
    assert (on_cpu.computes, on_cpu.out, on_cpu.casts) == (bf16, bf16, ()), layer
for where in ("cpu",) if rms_rule.holds else ("cpu", "cuda"):
    rms = norms["RMSNorm", where]
    assert (rms.computes, rms.out) == (torch.float32, bf16), where
    assert rms.casts == ((bf16, torch.float32), (torch.float32, bf16)), where
    assert rms.warning is not None and rms.warning.startswith("UserWarning"), where
rms = norms["RMSNorm", "cpu"]
print(f"cuda column: {cuda_how}")
print(f"RMSNorm on the cpu: {rms.warning.split(' (Triggered')[0]}")

# %%
# The same table as a map of dtypes.
from mpguide import plots

places = {"cpu": device.LIVE, "cuda": cuda_how}
columns = [f"{what}, {device.label(d, how)}" for d, how in places.items()
           for what in ("takes", "returns", "keeps")]
rows = []
for layer in norm_layers.NORMS:
    cells = []
    for d in places:
        run = norms[layer, d]
        cells += [run.computes, run.out, run.keeps or "none"]
    rows.append((layer, *cells))
grid = Table(("layer", *columns), tuple(rows))
_ = plots.dtype_grid(
    grid, title=f"norms with float32 parameters on bf16 activations under bf16 autocast, "
    f"torch {torch.__version__}",
)

# %%
# Running statistics in the buffers' dtype
# ----------------------------------------
# Under autocast a BatchNorm's buffers stay float32 (above). A model cast with
# ``model.to(torch.bfloat16)`` has bf16 buffers instead:
print(f"nn.BatchNorm1d(4).to(bf16).running_mean: "
      f"{dtypes.name(nn.BatchNorm1d(4).to(bf16).running_mean.dtype)}")

# %%
# Each training step moves the running mean a tenth of the way to the batch mean
# (``momentum=0.1``). In bf16 that step is rounded to the buffer's spacing, and once the tenth
# of the remaining distance is below half a spacing, the running mean stops moving.
# :func:`mpguide.training.norm_layers.running_means` trains a ``BatchNorm1d`` in each buffer dtype
# on batches whose every channel has mean 3.
means = norm_layers.running_means(("float32", "bfloat16", "float16"), steps=100, mean=3.0,
                               dev=dev)
means

# %%
spacing = {dt: (torch.nextafter(torch.tensor(3.0, dtype=dt), torch.tensor(4.0, dtype=dt))
                - 3.0).item() for dt in (bf16, fp16)}
assert means.gap(torch.float32) < spacing[bf16] / 100
print(f"bf16 buffers stop {means.gap(bf16):.3g} below the mean, "
      f"{means.gap(bf16) / spacing[bf16]:.0f} spacings of bf16 at 3; fp16 buffers "
      f"{means.gap(fp16):.3g} below; float32 buffers {means.gap(torch.float32):.2g} "
      f"({dev.type})")
for dt in (bf16, fp16):
    assert means.settled_at(dt) is not None, dt
    assert means.gap(dt) >= 2 * spacing[dt], dt
assert means.gap(bf16) > means.gap(fp16)
if dev.type == "cpu":  # the ratio on a GPU is not recorded: asserted on the CPU only
    assert means.gap(bf16) > 10 * means.gap(fp16)
_ = plots.running_means(
    means, title=f"BatchNorm1d running mean per step, batches of mean 3, torch "
    f"{torch.__version__} on {dev.type}",
)

# %%
# An overflow upstream of a norm
# ------------------------------
# A norm divides its input by its spread, so it would bring large activations back to unit scale, if
# they reached it. Under fp16 autocast a ``Linear`` whose outputs pass 65504 returns ``inf`` first.
# We feed a LayerNorm and a BatchNorm (training mode) such activations under each autocast dtype,
# live on this machine's device, then use the BatchNorm in eval mode on an ordinary batch. The
# float32 LayerNorm CUDA's autocast would run is here too: the same overflowed tensor cast to
# float32.
torch.manual_seed(0)
lin, ln = nn.Linear(8, 8, device=dev), nn.LayerNorm(8, device=dev)
bn = nn.BatchNorm1d(8, device=dev)
loud = torch.randn(16, 8, device=dev) * 3e4
quiet = torch.randn(16, 8, device=dev)
overflow = {}
for dt in (bf16, fp16):
    bn.reset_running_stats()
    bn.train()
    with torch.autocast(dev.type, dtype=dt):
        h = lin(loud)
        normed = ln(h)
        bn(h)
    bn.eval()
    with torch.autocast(dev.type, dtype=dt):
        later = bn(lin(quiet))
    stats = torch.cat([bn.running_mean, bn.running_var])
    overflow[dt] = {
        "inf in the Linear's output": torch.isinf(h).float().mean().item(),
        "NaN in the LayerNorm's output": normed.isnan().float().mean().item(),
        "NaN after a float32 LayerNorm": F.layer_norm(h.float(), (8,)).isnan().float().mean().item(),
        "non-finite running statistics": (~torch.isfinite(stats)).float().mean().item(),
        "NaN in a later eval output": later.isnan().float().mean().item(),
    }
Table(
    ("share of values", *(f"autocast {dtypes.name(dt)}" for dt in overflow)),
    tuple((what, *(f"{overflow[dt][what]:.0%}" for dt in overflow)) for what in overflow[bf16]),
    f"Linear outputs up to {lin(loud).abs().max().item():.3g} in float32, on {dev.type}",
)

# %%
# bf16 holds the activations (its range is float32's), so every share is zero. In fp16 the
# rows with an ``inf`` come out of the LayerNorm as NaN, in fp16 and in float32 alike: the
# upcast comes too late. One such batch makes the BatchNorm's running statistics NaN, and
# every output it gives in eval mode afterwards is NaN.
assert all(v == 0 for v in overflow[bf16].values())
fp16_overflow = overflow[fp16]
assert fp16_overflow["inf in the Linear's output"] > 0
assert fp16_overflow["NaN in the LayerNorm's output"] > 0
assert fp16_overflow["NaN after a float32 LayerNorm"] == fp16_overflow["NaN in the LayerNorm's output"]
assert fp16_overflow["non-finite running statistics"] == 1.0
assert fp16_overflow["NaN in a later eval output"] == 1.0

# %%
# Embeddings
# ----------
# An embedding looks its rows up; autocast has no rule for it on either device, so a float32
# table returns float32 rows and the first matmul after it does the cast.
from mpguide.autocast import policy


def embed(d):
    return nn.Embedding(10, 8, device=d)(torch.arange(4, device=d))


looked_up = {device.label(t.device.type, t.how): policy.observe(embed, t, bf16)
             for t in (device.target("cpu"), device.target("cuda"))}
for where, run in looked_up.items():
    print(f"{where}: embedding of a float32 table under bf16 autocast -> {dtypes.name(run.out)}, "
          f"casts added: {len(run.casts)}")
    assert run.out == torch.float32 and run.casts == (), where

# %%
# Its backward sums the gradients of every position that used a row into that row. For a token
# used ``n`` times in a batch, that is a sum of ``n`` terms, done in the table's dtype.
# :func:`mpguide.training.grad_sums.embedding_grads` compares the summed row with the float64 sum of
# the same incoming gradients.
sums = grad_sums.embedding_grads((1, 4, 16, 64, 256, 1024, 4096), ("float32", "bfloat16"), dev=dev)
sums

# %%
f32_errors, bf16_errors = sums.errors("float32 table"), sums.errors("bfloat16 table")
assert max(f32_errors) < 1e-5
assert bf16_errors[0] == 0 and bf16_errors[-1] > 100 * f32_errors[-1]
if dev.type == "cpu":
    # The CPU kernel adds in bf16: the error grows with the count.
    assert bf16_errors[-1] > 0.05 and bf16_errors[-1] > 5 * bf16_errors[1]
print(f"a row used {sums.counts[-1]} times: error {bf16_errors[-1]:.2g} in a bf16 table, "
      f"{f32_errors[-1]:.2g} in a float32 one ({dev.type})")
_ = plots.sum_errors(sums, title=f"{sums.what}, torch {torch.__version__} on {dev.type}")

# %%
# Attention masks and mixed inputs
# --------------------------------
# Outside autocast, ``scaled_dot_product_attention`` needs query, key and value in one dtype;
# the CPU kernel accepts a float32 additive mask beside bf16 inputs.
q = torch.randn(1, 2, 8, 16)
causal = torch.ones(8, 8, dtype=torch.bool).tril()
additive = torch.zeros(8, 8).masked_fill(~causal, -1e9)
try:
    F.scaled_dot_product_attention(q.to(bf16), q, q)
    mixed_error = None
except RuntimeError as err:
    mixed_error = str(err)
with dtypes.Log() as log:
    bf16_out = F.scaled_dot_product_attention(q.to(bf16), q.to(bf16), q.to(bf16),
                                              attn_mask=additive)
kernel = next(c for c in log.calls if "attention" in c.op)
print(f"bf16 query, float32 key and value: {mixed_error}")
print(f"bf16 inputs, float32 mask: {kernel.op} on {' + '.join(map(dtypes.name, kernel.ins))}")
assert "Expected query, key, and value to have the same dtype" in mixed_error
assert kernel.ins == (bf16, bf16, bf16, torch.float32) and bf16_out.dtype == bf16

# %%
# Under autocast, ``scaled_dot_product_attention`` is a lower-precision op on both devices (the
# CPU live, CUDA simulated where there is no GPU): every floating input is cast to bf16, the
# float mask included. On the CPU the fused
# ``_scaled_dot_product_flash_attention_for_cpu`` kernel runs. On CUDA, which kernel runs
# (flash, memory-efficient, cuDNN or math) is chosen from the GPU at run time: that needs
# hardware. Without a GPU, fake tensors take the math path, which this build computes in
# float32 before casting back.


def attention(d):
    x = torch.randn(1, 2, 8, 16, device=d)
    mask = torch.zeros(8, 8, device=d)
    return F.scaled_dot_product_attention(x, x.to(bf16), x, attn_mask=mask)


attended = {t.device.type: (t, policy.observe(attention, t, bf16))
            for t in (device.target("cpu"), device.target("cuda"))}


def first_casts(run, n):
    return [f"{dtypes.short(a)}->{dtypes.short(b)}" for a, b in run.casts[:n]]


def kernels(run):
    return sorted({c.op.removesuffix(".default") for c in run.calls if "attention" in c.op})


Table(
    ("device", "output", "casts autocast added before the op", "attention kernel in the log"),
    tuple((device.label(where, t.how), run.out, ", ".join(first_casts(run, 3)),
           ", ".join(kernels(run)) or "none (decomposed)") for where, (t, run) in attended.items()),
    "query float32, key bf16, value float32, float32 mask, under bf16 autocast",
)

# %%
# The key was bf16 already; query, value and mask are the three float32 inputs autocast cast.
for where, (_, run) in attended.items():
    assert run.out == bf16, where
    assert run.casts[:3] == ((torch.float32, bf16),) * 3, where
cpu_kernel = next(c for c in attended["cpu"][1].calls if "attention" in c.op)
assert cpu_kernel.op == "aten._scaled_dot_product_flash_attention_for_cpu.default"
assert cpu_kernel.ins == (bf16,) * 4
if attended["cuda"][0].simulated:
    assert kernels(attended["cuda"][1]) == []

# %%
# What the cast does to a mask
# ----------------------------
# Additive masks hold a large negative number where attention is not allowed. Cast to fp16,
# ``-1e9`` becomes ``-inf``; ``torch.finfo(torch.float32).min`` becomes ``-inf`` in bf16 as
# well, since it lies past bf16's largest finite value. Where a query may attend to nothing
# (a padding row), a finite mask gives it the mean of the values and ``-inf`` does not.
# We run one fully masked row on the CPU, in float32 and under each autocast dtype.
values = {"-1e9": torch.tensor(-1e9),
          "finfo(float32).min": torch.tensor(torch.finfo(torch.float32).min)}
cast_mask = Table(
    ("mask value", "in bf16", "in fp16"),
    tuple((name, v.to(bf16).item(), v.to(fp16).item()) for name, v in values.items()),
)
cast_mask

# %%
qkv = torch.randn(1, 1, 4, 8)
allowed = torch.ones(4, 4, dtype=torch.bool)
allowed[2] = False
masks = {"bool": allowed, "float, -1e9": torch.zeros(4, 4).masked_fill(~allowed, -1e9)}
padded_row = {}
for name, mask in masks.items():
    for dt in (None, bf16, fp16):
        with torch.autocast("cpu", dtype=dt or bf16, enabled=dt is not None):
            row = F.scaled_dot_product_attention(qkv, qkv, qkv, attn_mask=mask)[0, 0, 2].float()
        mean_v = qkv[0, 0].mean(0)
        padded_row[name, dt] = (
            "NaN" if row.isnan().any() else "zeros" if not row.any()
            else "mean of the values" if torch.allclose(row, mean_v, atol=1e-2) else "other"
        )
Table(
    ("mask", "float32 (no autocast)", "autocast bf16", "autocast fp16"),
    tuple((name, *(padded_row[name, dt] for dt in (None, bf16, fp16))) for name in masks),
    "output of a query row with every key masked, cpu (ran on hardware)",
)

# %%
assert values["-1e9"].to(fp16).isinf() and values["-1e9"].to(bf16).isfinite()
assert values["finfo(float32).min"].to(bf16).isinf()
assert padded_row["float, -1e9", None] == padded_row["float, -1e9", bf16] == "mean of the values"
assert padded_row["float, -1e9", fp16] == "zeros"
assert {padded_row["bool", dt] for dt in (None, bf16, fp16)} == {"zeros"}

# %%
# What we saw
# -----------
# - BatchNorm has no autocast rule on the CPU (live) or CUDA (simulated without a GPU): its
#   kernel takes the bf16 input with float32 weights, returns bf16 and keeps float32 running
#   statistics. LayerNorm, GroupNorm and RMSNorm (since torch 2.12) take and return float32
#   under CUDA's autocast, and stay in bf16 under the CPU's; without an autocast rule RMSNorm
#   warns and decomposes into float32 ops, returning bf16.
# - With bf16 buffers (a model cast with ``.to``), a BatchNorm's running mean stops short of
#   the mean it is fed, by more than two bf16 spacings; fp16 buffers stop closer, float32
#   buffers track it.
# - An fp16 ``inf`` upstream of a norm comes out as NaN, whether the norm runs in fp16 or float32,
#   and one such batch leaves a BatchNorm's running statistics NaN for every later eval output.
# - An embedding keeps its table's dtype under autocast; a bf16 table sums a repeated row's
#   gradient in bf16 on the CPU, with an error that grows with the count.
# - Autocast casts query, key, value and a float mask to bf16 for ``scaled_dot_product_attention``
#   on both devices; which CUDA kernel runs needs hardware. A mask value of ``-1e9`` becomes
#   ``-inf`` in fp16 and ``finfo(float32).min`` becomes ``-inf`` in bf16; a fully masked row
#   then returns zeros instead of the mean of the values.
#
# .. admonition:: References
#
#    :torchapi:`torch.nn.BatchNorm1d`, :torchapi:`torch.nn.LayerNorm`,
#    :torchapi:`torch.nn.RMSNorm`, :torchapi:`torch.nn.Embedding`,
#    :torchapi:`torch.nn.functional.scaled_dot_product_attention`, :torchdoc:`amp.html`

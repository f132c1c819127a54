"""
Training precision: readers' questions
======================================

Seven questions about the training loop in low precision: whether bf16 needs a
``GradScaler``, the error a scaler raises on fp16 weights, which dtype trainers' ``bf16=True``
keeps the weights in, pure bf16 against float32 master weights, summing a loss in bf16,
computing the cross-entropy on ``logits.float()``, and bf16 optimizer states. Each is the
reader's setup reduced to a few tensors and a step or two on this build's device. The answers
on this torch: bf16 has float32's range, so a scaler changes nothing (bit for bit here); a
scaler refuses fp16 gradients; autocast keeps the weights' dtype, so ``bf16=True`` trains
float32 weights unless the model was loaded in bf16; bf16 weights lose small updates that
float32 master weights keep; and the optimizer's states follow the parameters' dtype.
"""

# %%
# Setup
# -----
import torch
import torch.nn.functional as F
from torch import nn

from mpguide.core import device
from mpguide.core.table import Table
from mpguide.training import master_weights, optimizers

dev = device.pick()
device.describe(dev)
low = torch.bfloat16


def one_step(params_dtype, scaler=None, lr=0.1):
    """One SGD step of a seeded Linear under bf16 autocast; the updated weight."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16, device=dev).to(params_dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.randn(8, 16, device=dev)
    with torch.autocast(dev.type, dtype=low):
        loss = model(x).float().square().mean()
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return model


# %%
# Do I need GradScaler with bf16?
# -------------------------------
# Asked in `pytorch#127176 <https://github.com/pytorch/pytorch/issues/127176>`__,
# `trl#4901 <https://github.com/huggingface/trl/issues/4901>`__,
# `pytorch#194947 <https://github.com/pytorch/pytorch/pull/194947>`__,
# `WeatherGenerator#874 <https://github.com/ecmwf/WeatherGenerator/issues/874>`__ and
# `SAELens#723 <https://github.com/decoderesearch/SAELens/pull/723>`__, often after
# ``RuntimeError: "_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for
# 'BFloat16'`` (a scaler meeting bf16 gradients on CUDA). The ranges, and one step with and
# without a scaler under bf16 autocast, live on this build's device:
ranges = Table(
    ("dtype", "smallest normal", "largest"),
    tuple((str(dt).removeprefix("torch."), torch.finfo(dt).tiny, torch.finfo(dt).max)
          for dt in (torch.float16, torch.bfloat16, torch.float32)),
    "Range of each format (torch.finfo)",
)
plain = one_step(torch.float32)
scaled = one_step(torch.float32, torch.amp.GradScaler(dev.type))
ranges

# %%
assert torch.finfo(torch.bfloat16).tiny == torch.finfo(torch.float32).tiny
assert torch.equal(plain.weight, scaled.weight)
print(f"on torch {torch.__version__} ({dev.type}): with bf16 autocast, the step with a "
      "GradScaler gives the same weights bit for bit as the step without")

# %%
# A scaler multiplies the loss by a power of two so that fp16 gradients, whose smallest normal is
# 6.1e-05, do not flush to zero; bf16 has float32's exponent range, so nothing underflows and the
# scaling (exact, a power of two) cancels: same weights, extra work, and on CUDA hardware (not
# checked here) an unscale kernel without a bf16 variant for bf16 *parameters* (the thread's
# error; #194947 adds one). Fix: no scaler with bf16 (``GradScaler(enabled=False)`` keeps the
# code path). Loss scaling in depth:
# :ref:`sphx_glr_docs_auto_examples_training_plot_01_loss_scaling.py`.

# %%
# Why does GradScaler raise Attempting to unscale FP16 gradients?
# ---------------------------------------------------------------
# Asked in `Baichuan-13B-Finetuning#21 <https://github.com/mark1879/Baichuan-13B-Finetuning/issues/21>`__,
# `FunMusic#28 <https://github.com/QwenAudio/FunMusic/issues/28>`__,
# `S3Diff#19 <https://github.com/ArcticHare105/S3Diff/issues/19>`__ and
# `ai-algorithms#4 <https://github.com/Jaykef/ai-algorithms/issues/4>`__:
# ``ValueError: Attempting to unscale FP16 gradients.`` with ``fp16=True`` on a model loaded
# in float16. The same with fp16 parameters, then with float32 parameters under fp16 autocast:
torch.manual_seed(0)
half_model = nn.Linear(8, 8, device=dev).half()
opt = torch.optim.SGD(half_model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler(dev.type)
scaler.scale(half_model(torch.randn(2, 8, device=dev, dtype=torch.float16)).float().sum()
             ).backward()
try:
    scaler.step(opt)
    fp16_params = "stepped"
except ValueError as err:
    fp16_params = f"ValueError: {err}"
fp32_model = nn.Linear(8, 8, device=dev)
opt = torch.optim.SGD(fp32_model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler(dev.type)
with torch.autocast(dev.type, dtype=torch.float16):
    out = fp32_model(torch.randn(2, 8, device=dev))
scaler.scale(out.float().sum()).backward()
scaler.step(opt)
unscale = {"fp16 parameters": fp16_params,
           "float32 parameters, fp16 autocast": f"stepped, gradients {fp32_model.weight.grad.dtype}"}
unscale

# %%
assert unscale["fp16 parameters"] == "ValueError: Attempting to unscale FP16 gradients."
assert fp32_model.weight.grad.dtype == torch.float32

# %%
# ``GradScaler.unscale_`` divides the gradients by the scale in place and refuses fp16
# gradients: dividing them in fp16 would lose the small values the scale was there to keep,
# and the optimizer would then update fp16 weights. The scaler is designed for float32
# parameters under fp16 autocast. Fix: load the model in float32 (or keep the trainable
# parameters, such as LoRA adapters, in float32) and let autocast run the forward in fp16;
# or use bf16 and no scaler.

# %%
# With bf16=True, are my weights bf16 or float32?
# -----------------------------------------------
# Asked in `AiM#10 <https://github.com/hp-l33/AiM/issues/10>`__ ("although you set bf16=True in
# TrainingArguments, it seems the entire model is still being trained in fp32"),
# `CausVid#19 <https://github.com/tianweiy/CausVid/issues/19>`__,
# `LlamaFactory#3346 <https://github.com/hiyouga/LlamaFactory/issues/3346>`__,
# `transformers#30305 <https://github.com/huggingface/transformers/issues/30305>`__ ("load a
# bf16 model then train with --bf16 ... the final saved model parameter torch_dtype is
# float32") and `transformers#32622 <https://github.com/huggingface/transformers/issues/32622>`__.
# ``bf16=True`` in these trainers means "run the forward under bf16 autocast". The three ways
# a model reaches it, one step each:
rows = []
for how, start, upcast in (("loaded in float32", torch.float32, False),
                           ("loaded in bf16", low, False),
                           ("loaded in bf16, upcast with .float() for mixed precision", low, True)):
    torch.manual_seed(0)
    model = nn.Linear(16, 16, device=dev).to(start)
    if upcast:
        model.float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torch.autocast(dev.type, dtype=low):
        out = model(torch.randn(4, 16, device=dev))
    out.float().square().mean().backward()
    opt.step()
    saved = {v.dtype for v in model.state_dict().values()}
    rows.append((how, str(out.dtype).removeprefix("torch."),
                 str(model.weight.grad.dtype).removeprefix("torch."),
                 str(opt.state[model.weight]["exp_avg"].dtype).removeprefix("torch."),
                 ", ".join(sorted(str(s).removeprefix("torch.") for s in saved))))
trainer = Table(("model", "forward output", "gradient", "Adam state", "saved state_dict"),
                tuple(rows), f"One step under bf16 autocast on {dev.type}")
trainer

# %%
f32_row, bf16_row, upcast_row = trainer.records()
assert f32_row["forward output"] == bf16_row["forward output"] == "bfloat16"
assert f32_row["saved state_dict"] == upcast_row["saved state_dict"] == "float32"
assert bf16_row["gradient"] == bf16_row["Adam state"] == bf16_row["saved state_dict"] == "bfloat16"

# %%
# Autocast changes the dtype ops compute in, never the parameters: float32 weights stay
# float32 (with float32 gradients and optimizer states: mixed precision with master weights),
# bf16 weights stay bf16 (pure bf16, though called ``bf16=True`` too). Frameworks that want
# mixed precision upcast the trainable parameters to float32 (LlamaFactory's ``.float()``),
# so the checkpoint they save is float32, as in #30305; cast it at save time
# (``model.to(torch.bfloat16).save_pretrained(...)``) or load it with ``torch_dtype=``. The
# accelerate config's ``mixed_precision: bf16`` sets the same autocast, so setting both is
# redundant (#32622; accelerate's plumbing is not run here). Casting a model in depth:
# :ref:`sphx_glr_docs_auto_examples_autograd_plot_02_casting_a_model.py`.

# %%
# Pure bf16 or bf16 with float32 master weights?
# ----------------------------------------------
# Asked in `TransformerEngine#950 <https://github.com/NVIDIA/TransformerEngine/issues/950>`__
# ("Pure bfloat16 vs. mixed precision bfloat16: what's recommended?"),
# `torchtune#2254 <https://github.com/meta-pytorch/torchtune/issues/2254>`__ ("Very bad
# convergence with bf16"), `RLCSD#2 <https://github.com/THU-BPM/RLCSD/issues/2>`__ and
# `ml-by-hand#85 <https://github.com/workofart/ml-by-hand/pull/85>`__. A hundred SGD steps of
# size 1e-3 on weights near 1, stored in bf16 and in float32:
steps, lr, grad = 100, 1e-3, 1.0
weights = {"bf16 weights": torch.ones(4, device=dev, dtype=low),
           "float32 master weights": torch.ones(4, device=dev)}
for w in weights.values():
    for _ in range(steps):
        w -= lr * grad
lost = master_weights.lost(torch.ones(4, device=dev, dtype=low),
                           torch.full((4,), -lr, device=dev))
master = {name: w[0].item() for name, w in weights.items()}
master["bf16: a 1e-3 update is lost"] = bool(lost.all())
master

# %%
assert master["bf16 weights"] == 1.0 and master["bf16: a 1e-3 update is lost"]
assert abs(master["float32 master weights"] - (1 - steps * lr)) < 1e-5
print(f"after {steps} steps: bf16 weights still {master['bf16 weights']}, float32 master "
      f"weights {master['float32 master weights']:.4f}")

# %%
# The loop above decreases the weight. Whether an update is lost depends on its direction: bf16
# values are twice as far apart just above 1 as just below it. Per direction, the spacing next
# to 1, the largest update that rounds back to 1 (half the spacing: a tie rounds to the even
# neighbour, 1), and what a 1e-3 and a 2e-3 step make of a bf16 1:
one = torch.ones((), device=dev, dtype=low)
near_one = []
for direction, sign in (("up (1 + u)", 1.0), ("down (1 - u)", -1.0)):
    spacing = (torch.nextafter(one, one + sign) - one).abs().item()
    near_one.append((direction, spacing, spacing / 2, (one + sign * spacing / 2).item(),
                     (one + sign * 1e-3).item(), (one + sign * 2e-3).item()))
threshold = Table(("direction", "spacing", "lost up to u =", "1 ± that", "1 ± 0.001",
                   "1 ± 0.002"), tuple(near_one), f"bf16 updates of a weight at 1, on {dev.type}")
threshold

# %%
up, down = threshold.records()
assert up["spacing"] == 2 * down["spacing"] == 2**-7
assert up["1 ± that"] == down["1 ± that"] == 1.0
assert up["1 ± 0.001"] == down["1 ± 0.001"] == 1.0
assert up["1 ± 0.002"] == 1.0 and down["1 ± 0.002"] == 1 - down["spacing"]
print(
    f"a bf16 weight at 1 ignores an increase of up to {up['lost up to u =']:.8f} and a decrease "
    f"of up to {down['lost up to u =']:.9f}: 1 + 0.002 stays {up['1 ± 0.002']}, 1 - 0.002 "
    f"becomes {down['1 ± 0.002']}"
)

# %%
# Above 1 bf16 values are 2**-7 apart, below it 2**-8 (both asserted), so an update that moves
# the weight by half the spacing or less rounds back to 1: up to 0.0039 upwards, up to 0.00195
# downwards (printed above). An update of 0.001 (a learning rate of 1e-3 times a unit step)
# leaves the bf16 weight at 1 in both directions (the ``1 ± 0.001`` column above), and moves
# the float32 copy. That is the convergence gap of the threads. Master
# weights cost 4 bytes per parameter more; the alternatives that keep bf16 weights are
# stochastic rounding and Kahan summation (:func:`mpguide.training.optimizers.stochastic_round`,
# :func:`mpguide.training.optimizers.kahan_add_`). In depth:
# :ref:`sphx_glr_docs_auto_examples_autograd_plot_04_master_weights.py`.

# %%
# Is my loss summed in bf16 over many tokens?
# -------------------------------------------
# Asked in `torchtitan#2336 <https://github.com/pytorch/torchtitan/issues/2336>`__ ("performing
# this accumulation in float16/bfloat16 could introduce compounded numerical error ... over
# 1-2M tokens") and `DeepEP#176 <https://github.com/deepseek-ai/DeepEP/issues/176>`__ ("Why is it
# necessary to convert BF16 to FP32 for addition in reduce operations?"). 20,000 per-token
# losses near 2.3, summed three ways:
gen = torch.Generator(device=dev).manual_seed(0)
losses = (2.3 + 0.1 * torch.randn(20_000, generator=gen, device=dev)).to(low)
exact = losses.double().sum().item()
running = torch.zeros((), dtype=low, device=dev)
for chunk in losses.split(1000):
    for value in chunk:  # a running total kept in bf16, one token at a time
        running = running + value
sums = Table(
    ("how", "sum", "relative error"),
    tuple((how, v, abs(v - exact) / exact) for how, v in (
        ("exact (float64)", exact),
        ("losses.sum() on the bf16 tensor", losses.sum().item()),
        ("running total in bf16", running.item()),
        ("losses.float().sum()", losses.float().sum().item()))),
    f"20,000 bf16 losses on {dev.type}",
)
sums

# %%
errors = {r["how"]: r["relative error"] for r in sums.records()}
assert errors["running total in bf16"] > 0.5 and running.item() == 1024
assert errors["losses.sum() on the bf16 tensor"] < 0.01 and errors["losses.float().sum()"] < 1e-6
print(f"a bf16 running total stops growing at {running.item():.0f} (of {exact:.0f}); "
      "torch.sum accumulates in float32 and rounds once")

# %%
# Once the bf16 total reaches 1024 (asserted), its spacing is 8, and adding a loss of 2.3 (less
# than half of 8) rounds back to the total: the sum stalls. ``torch.sum`` of a bf16 tensor accumulates in float32 internally and
# rounds once, which is why the thread's ``.float()`` before the sum (torchtitan's loss
# already does it) and DeepEP's float32 reduce matter only for hand-written accumulation,
# across steps or across ranks. Accumulation in depth:
# :ref:`sphx_glr_docs_auto_examples_numerics_plot_03_error_vs_k.py`.

# %%
# Why compute the cross-entropy on logits.float()?
# ------------------------------------------------
# Asked in `transformers#34147 <https://github.com/huggingface/transformers/pull/34147>`__
# ("Only cast logits to float when computing loss"),
# `Modalities#464 <https://github.com/Modalities/modalities/pull/464>`__ and
# `speculators#788 <https://github.com/vllm-project/speculators/pull/788>`__. Cross-entropy of
# bf16 logits (vocabulary 32,000), as is and upcast, against float64:
logits = (3 * torch.randn(64, 32_000, generator=gen, device=dev)).to(low)
labels = torch.randint(0, 32_000, (64,), generator=gen, device=dev)
ref = F.cross_entropy(logits.double(), labels).item()
bf16_loss = F.cross_entropy(logits, labels)
f32_loss = F.cross_entropy(logits.float(), labels)
with torch.autocast(dev.type, dtype=low):
    autocast_loss = F.cross_entropy(logits, labels)
ce = Table(("loss computed", "dtype", "value", "error vs float64"),
           tuple((how, str(t.dtype).removeprefix("torch."), t.item(), abs(t.item() - ref))
                 for how, t in (("on bf16 logits", bf16_loss), ("on logits.float()", f32_loss),
                                ("on bf16 logits under autocast", autocast_loss))),
           f"cross_entropy, 64 x 32,000 logits, on {dev.type}")
ce

# %%
assert bf16_loss.dtype == low and f32_loss.dtype == torch.float32 and 8 <= ref < 16
assert abs(f32_loss.item() - ref) < abs(bf16_loss.item() - ref)
assert autocast_loss.dtype == torch.float32

# %%
# Where the bf16 loss parts from float32: ``cross_entropy`` is ``log_softmax`` followed by
# ``nll_loss``, and on bf16 logits both run in bf16. The float32 loss rounded once to bf16, the
# mean of the bf16 log-probabilities taken in float32, and ``nll_loss`` on them in bf16:
log_probs = F.log_softmax(logits, dim=-1)
steps_ce = {
    "float32 loss": f32_loss.item(),
    "float32 loss rounded once to bf16": f32_loss.to(low).item(),
    "bf16 log-probabilities, mean in float32": F.nll_loss(log_probs.float(), labels).item(),
    "bf16 log-probabilities, nll_loss in bf16": F.nll_loss(log_probs, labels).item(),
    "cross_entropy on bf16 logits": bf16_loss.item(),
}
same_as_rounded = 0
for seed in range(20):
    g = torch.Generator(device=dev).manual_seed(seed)
    lg = (3 * torch.randn(64, 32_000, generator=g, device=dev)).to(low)
    lb = torch.randint(0, 32_000, (64,), generator=g, device=dev)
    rounded_once = F.cross_entropy(lg.float(), lb).to(low).item()
    same_as_rounded += F.cross_entropy(lg, lb).item() == rounded_once
steps_ce

# %%
assert log_probs.dtype == low
assert steps_ce["cross_entropy on bf16 logits"] == (
    steps_ce["bf16 log-probabilities, nll_loss in bf16"])
assert (bf16_loss - torch.nextafter(bf16_loss, torch.zeros_like(bf16_loss))).item() == 0.0625
if dev.type == "cpu":  # the CPU's nll_loss; another device's kernel may sum otherwise
    assert steps_ce["cross_entropy on bf16 logits"] != steps_ce["float32 loss rounded once to bf16"]
    assert same_as_rounded < 20
print(
    f"bf16 loss {bf16_loss.item()}, float32 loss {f32_loss.item():.4f} rounded once "
    f"{f32_loss.to(low).item()}; over 20 seeds the bf16 loss equals the float32 loss rounded once "
    f"{same_as_rounded} times ({dev.type})"
)

# %%
# So bf16 loses more than the stored result. The log-probabilities are stored in bf16 (at the
# loss's size, between 8 and 16, bf16's spacing is 0.0625, asserted), and on the CPU
# ``nll_loss``'s mean over them in bf16 loses more again: on this batch the bf16 loss is the
# value printed above, not the float32 loss rounded once, and over 20 seeds the two agree only
# the printed number of times (asserted on the CPU; on another device the printed count is that
# device's kernel's, which may keep its sum in float32). Autocast lists ``cross_entropy``
# among the ops it runs in float32, so under autocast the upcast happens by itself (asserted
# above); without autocast (pure bf16 weights, or FSDP2's parameter policy, which installs no
# autocast) upcast the logits at the loss only: the full-vocabulary float32 copy is the memory
# transformers#34147 avoids elsewhere. Output dtypes under autocast:
# :ref:`sphx_glr_docs_auto_examples_autocast_plot_03_output_dtypes.py`.

# %%
# Can the optimizer states be bf16?
# ---------------------------------
# Asked in `pytorch#146542 <https://github.com/pytorch/pytorch/issues/146542>`__ ("DeepSeek
# mentions that they keep optimizer states in bf16, this is something that afaik our
# optimizers don't support"), `torchtitan#2732 <https://github.com/pytorch/torchtitan/pull/2732>`__,
# `pytorch#178034 <https://github.com/pytorch/pytorch/pull/178034>`__ and TransformerEngine
# `#1465 <https://github.com/NVIDIA/TransformerEngine/pull/1465>`__ /
# `#1640 <https://github.com/NVIDIA/TransformerEngine/pull/1640>`__. The states AdamW keeps
# after one step, for float32 and bf16 parameters (CUDA simulated where absent):
states = optimizers.optimizer_states(("AdamW", "AdamW(fused=True)"), ("float32", "bfloat16"))
states

# %%
for target in ("cpu",):
    for name in ("AdamW",):
        assert states.get(name, "float32", target).dtype("exp_avg") == torch.float32
        assert states.get(name, "bfloat16", target).dtype("exp_avg") == torch.bfloat16

# %%
# Built-in optimizers create their states like the parameter (``torch.zeros_like``), and
# ``param.grad`` must have the parameter's dtype: float32 parameters get float32 states, bf16
# parameters bf16 states. Mixed layouts (float32 weights, bf16 moments) need states created
# before the first step, which the fused CUDA Adam accepts on hardware (torchtitan's pre-hook;
# not checked here), or a custom optimizer;
# :class:`mpguide.training.optimizers.RoundedAdamW` keeps bf16 moments with rounding under
# control. Every optimizer and dtype:
# :ref:`sphx_glr_docs_auto_examples_training_plot_02_optimizer_precision.py`.

# %%
# What we saw
# -----------
# - bf16 needs no scaler: the scaled and unscaled steps give the same weights.
# - A scaler refuses fp16 gradients; keep fp16 for autocast and the parameters float32.
# - ``bf16=True`` keeps whatever dtype the weights were loaded in; upcast for master weights.
# - A bf16 weight at 1 ignores an increase of up to half its upper spacing (0.0039) and a
#   decrease of up to half its lower spacing (0.00195); float32 master weights keep both.
# - A running bf16 total stalls; ``torch.sum`` and a float32 accumulator do not.
# - Cross-entropy on bf16 logits returns a bf16 loss; on the CPU it differs from the float32
#   loss rounded once (log-probabilities and their mean in bf16); upcast at the loss or run it
#   under autocast. Optimizer states follow the parameters' dtype.
#
# .. admonition:: References
#
#    :torchdoc:`amp.html#gradient-scaling`, :torchapi:`torch.amp.GradScaler`,
#    :torchapi:`torch.optim.AdamW`, :torchapi:`torch.nn.functional.cross_entropy`

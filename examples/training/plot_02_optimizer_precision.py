"""
Optimizer precision: bf16 weights and states, and three remedies
=================================================================

Training in pure bf16 keeps the weights and AdamW's moments in bf16. Which updates do they
lose, and what do fp32 master weights, stochastic rounding and Kahan summation win back? We
check every positive bf16 number against AdamW's per-step factors, read the state dtypes of
the built-in optimizers on the CPU and CUDA (CUDA's simulated without a GPU), add many small
updates to one bf16 weight each way, and train a small next-character model for 200 steps
with each setup against float32, on this build's device. bf16 states cannot decay by
``beta2`` and pure bf16 trails float32; a master copy, stochastic rounding and Kahan summation
each end within a small fraction of that gap, at different memory costs.
"""

# %%
# Setup
# -----
# Results are live, on the device :func:`mpguide.core.device.pick` chooses: CUDA when present,
# else the CPU (the optimizers' CUDA states are simulated without a GPU, and say so). Why a bf16
# weight loses an update smaller than half its spacing is shown on
# :ref:`sphx_glr_docs_auto_examples_autograd_plot_04_master_weights.py`, with SGD; this page starts
# from there.
import torch

from mpguide.core import device
from mpguide.core.table import Table
from mpguide.training import loop, optimizers

dev = device.pick()
device.describe(dev)
BF16 = torch.bfloat16

# %%
# What bf16 states lose
# ---------------------
# Each AdamW step multiplies ``exp_avg`` by ``beta1 = 0.9``, ``exp_avg_sq`` by
# ``beta2 = 0.999`` and, with weight decay, the weight by ``1 - lr * weight_decay``. A product
# that moves a bf16 number by less than half its spacing rounds back to it. We apply each
# factor to every positive normal bf16 number (bit patterns ``0x0080`` to ``0x7f7f``), the way
# torch multiplies a bf16 tensor by a Python float: in float32, rounded once.
positive = torch.arange(0x0080, 0x7F80, dtype=torch.int16, device=dev).view(BF16)
LR, WEIGHT_DECAY = 3e-3, 1e-2
factors = {"beta1 (exp_avg)": 0.9, "beta2 (exp_avg_sq)": 0.999,
           f"1 - lr * weight_decay (lr {LR:g})": 1 - LR * WEIGHT_DECAY}
unchanged = {name: (positive * f == positive).float().mean().item() for name, f in factors.items()}
Table(("factor", "value", "bf16 numbers it leaves unchanged"),
      tuple((name, f, f"{unchanged[name]:.2%}") for name, f in factors.items()),
      f"all {positive.numel()} positive normal bf16 numbers, {device.LIVE} ({dev.type})")

# %%
# A relative change below ``2**-9`` is always lost (bf16 keeps 8 significant bits, so half a
# spacing is between ``2**-9`` and ``2**-8`` of the number): ``exp_avg_sq`` in bf16 can never
# decay, and AdamW's weight decay never acts on bf16 weights at these settings.
assert unchanged["beta1 (exp_avg)"] == 0.0
assert all(v == 1.0 for name, v in unchanged.items() if name != "beta1 (exp_avg)")
assert 1 - 0.999 < 2**-9 and LR * WEIGHT_DECAY < 2**-9

# %%
# ``torch.optim.AdamW`` on a bf16 parameter shows it: one step with a gradient, then 50 with a
# zero gradient. In float32 ``exp_avg_sq`` decays by ``0.999**50``; in bf16 it stays put.
def second_moment_after(dtype, quiet_steps=50):
    p = torch.nn.Parameter(torch.ones(4, device=dev, dtype=dtype))
    adamw = torch.optim.AdamW([p], lr=LR)
    p.grad = torch.ones_like(p)
    adamw.step()
    first = adamw.state[p]["exp_avg_sq"].clone()
    for _ in range(quiet_steps):
        p.grad = torch.zeros_like(p)
        adamw.step()
    return first[0].item(), adamw.state[p]["exp_avg_sq"][0].item()


(f32_first, f32_last), (bf16_first, bf16_last) = map(second_moment_after, (torch.float32, BF16))
print(f"float32 exp_avg_sq: {f32_first:.6g} -> {f32_last:.6g} (x {f32_last / f32_first:.4f})")
print(f"bf16 exp_avg_sq:    {bf16_first:.6g} -> {bf16_last:.6g}")
assert abs(f32_last / f32_first - 0.999**50) < 1e-4
assert bf16_last == bf16_first

# %%
# The dtypes three built-in optimizers keep
# -----------------------------------------
# AdamW, SGD with momentum and Adafactor, in their for-loop, foreach and fused forms where
# they have them: each is built over one parameter of each dtype and takes one step
# (:func:`mpguide.training.optimizers.optimizer_states`); on a machine without CUDA, the CUDA
# columns are simulated on fake tensors, and a step the simulation cannot run is marked
# ``needs hardware``.
states = optimizers.optimizer_states()
states

# %%
from mpguide import plots

table = states.table()
_ = plots.dtype_grid(table, title=f"optimizer states by weight dtype and device, torch "
                                  f"{torch.__version__}")

# %%
# For these three, every state but ``step`` takes the parameter's dtype, on either device, for
# the for-loop, foreach and fused implementations alike, and so do Adafactor's factored second
# moments (``row_var`` and ``col_var``); ``step`` is a float32 scalar, on the CPU unless the
# optimizer is fused, and SGD keeps none. Other optimizers are not probed here, and may keep
# states of their own dtype. Autocast and master weights give the optimizer
# float32 parameters, so their states are float32 (the runs below confirm it).
for r in states.results:
    for name, dt, where in r.states:
        if name == "step":
            assert dt == torch.float32
            assert where == (r.target if "fused" in r.optimizer else "cpu"), r
        else:
            assert dt == r.weights, r
    if r.how == device.LIVE:
        assert not r.error, r
assert states.get("AdamW", "bf16", "cuda").dtype("exp_avg_sq") == BF16
assert not any(name == "step" for r in states.results if r.optimizer.startswith("SGD")
               for name, _, _ in r.states)
print("optimizers probed: " + ", ".join(dict.fromkeys(r.optimizer for r in states.results)))
assert states.get("Adafactor", "bf16", "cpu").dtype("row_var") == BF16

# %%
# Three remedies on one weight
# ----------------------------
# Add ``1e-4`` a thousand times to 4096 bf16 weights that start at 1.0
# (:func:`mpguide.training.optimizers.accumulate`). Each update is under half of bf16's spacing
# above 1.0, ``2**-7``, so rounding to nearest loses every one. Stochastic rounding
# (:func:`mpguide.training.optimizers.stochastic_round`) rounds up with probability
# ``update / spacing``, so the weights move in whole spacings and their mean follows float32.
# Kahan summation (:func:`mpguide.training.optimizers.kahan_add_`) keeps what rounding dropped in
# a second bf16 tensor and adds it to the next update, so the weight moves one spacing once enough
# has built up.
UPDATE, STEPS = 1e-4, 1000
start = torch.ones(4096, device=dev, dtype=BF16)
gen = torch.Generator(device=dev).manual_seed(0)
histories = {
    "float32": optimizers.accumulate(start.float(), UPDATE, STEPS),
    "bf16, round to nearest": optimizers.accumulate(start, UPDATE, STEPS, "nearest"),
    "bf16, stochastic rounding": optimizers.accumulate(start, UPDATE, STEPS, "stochastic", gen),
    "bf16, Kahan summation": optimizers.accumulate(start, UPDATE, STEPS, "kahan"),
}
_ = plots.accumulation(histories, title=f"{STEPS} updates of {UPDATE:g} to 4096 weights at 1.0, "
                                        f"{device.LIVE} ({dev.type})")

# %%
final = {name: h[-1] for name, h in histories.items()}
exact = final["float32"][0].item()
sr = final["bf16, stochastic rounding"]
spacing = 2**-7
print(f"float32: {exact:.6f}; nearest: {final['bf16, round to nearest'][0].item()}; "
      f"stochastic: mean {sr.mean().item():.6f}, from {sr.min().item()} to {sr.max().item()}; "
      f"Kahan: {final['bf16, Kahan summation'][0].item()}")
assert spacing > 2 * UPDATE and abs(exact - (1 + STEPS * UPDATE)) < 1e-4
assert (final["bf16, round to nearest"] == 1.0).all()
assert abs(sr.mean().item() - exact) < 0.002 and sr.std().item() > spacing
assert ((sr - 1) / spacing).frac().abs().max() == 0  # whole spacings
assert (final["bf16, Kahan summation"] - exact).abs().max().item() <= spacing / 2

# %%
# A real training loop
# --------------------
# :func:`mpguide.training.loop.train` trains the small next-character model of the loss-scaling
# page for 200 steps with AdamW (learning rate ``3e-3`` on a cosine to zero, weight decay
# ``0.01``), six ways, all from the same initial weights on the same batches:
#
# - float32 weights and ``torch.optim.AdamW``;
# - pure bf16: the model cast to bf16 and ``torch.optim.AdamW`` on it;
# - bf16 weights with an fp32 master copy that ``torch.optim.AdamW`` steps, cast into the
#   weights after each step;
# - :class:`mpguide.training.optimizers.RoundedAdamW`: torch's AdamW arithmetic in float32 on copies
#   of the bf16 weights and moments, written back to bf16 by rounding to nearest, by stochastic
#   rounding, or with Kahan compensation (the moments are rounded to nearest in all three).
#
# Per step it records the shares of weights and of ``exp_avg_sq`` entries with a nonzero
# gradient that the step left as they were (for the master copy, the float32 copy; for Kahan,
# weight plus compensation); every 10 steps, the loss of the weights on held-out text.
runs = loop.train(
    ["fp32", "bf16", "bf16-master", "bf16-nearest", "bf16-stochastic", "bf16-kahan"],
    steps=200, lr=LR, dev=dev,
)
runs

# %%
_ = plots.training_runs(runs, unchanged=True,
                        title=f"AdamW on the character model, {runs.machine.caption()}")

# %%
fp32 = runs["fp32"]
gap = {r.name: r.final - fp32.final for r in runs.runs}
late = {r.name: sum(r.weights_unchanged[-50:]) / 50 for r in runs.runs}
late_states = {r.name: sum(r.states_unchanged[-50:]) / 50 for r in runs.runs}
Table(("recipe", "held-out loss minus fp32's", "weights unchanged", "exp_avg_sq unchanged"),
      tuple((r.name, f"{gap[r.name]:+.4f}", f"{late[r.name]:.2%}", f"{late_states[r.name]:.2%}")
            for r in runs.runs),
      "shares: mean over the last 50 steps, of the entries with a nonzero gradient")

# %%
pure, master = runs["bf16"], runs["bf16-master"]
nearest, sr_run, kahan = runs["bf16-nearest"], runs["bf16-stochastic"], runs["bf16-kahan"]
assert gap[pure.name] > 0.02 and gap[nearest.name] > 0.02
for remedy in (master, sr_run, kahan):
    assert abs(gap[remedy.name]) < gap[pure.name] / 4, remedy.name
assert late[pure.name] > 0.3 and late[nearest.name] > 0.3
assert late[fp32.name] < 0.01 and late[master.name] < 0.01 and late[kahan.name] < late[pure.name] / 10
assert late_states[pure.name] > 0.3 and late_states[fp32.name] < 0.01
assert late_states[kahan.name] > 0.3  # the moments stay bf16, rounded to nearest

# %%
# Stochastic rounding leaves about as many weights unchanged in a step as rounding to nearest,
# yet ends near float32: the updates it does not take are made up, on average, by the ones it
# rounds up to a whole spacing. Kahan keeps the dropped part and leaves fewer than a tenth as
# many weights unchanged (its bf16 compensation drops the smallest updates late in the
# schedule); the master copy loses no more than float32 does. None of the three fixes the second
# moment: its decay is still lost in bf16, and here that cost little.
#
# What each setup keeps
# ---------------------
# The dtypes of the optimizer's states after the run, and the bytes per parameter held
# between steps (weights, master copy, moments, compensation; gradients not counted):
Table(("recipe", "optimizer states", "bytes/param"),
      tuple((r.name, ", ".join(f"{k} {d}" for k, d in r.state_dtypes), r.bytes_per_parameter)
            for r in runs.runs))

# %%
size = {torch.float32: 4, BF16: 2}
assert all(dt == torch.float32 for _, dt in fp32.state_dtypes + master.state_dtypes)
assert dict(pure.state_dtypes)["exp_avg_sq"] == dict(kahan.state_dtypes)["compensation"] == BF16
assert fp32.bytes_per_parameter == 3 * size[torch.float32]
assert master.bytes_per_parameter == size[BF16] + 3 * size[torch.float32]
assert pure.bytes_per_parameter == sr_run.bytes_per_parameter == 3 * size[BF16]
assert kahan.bytes_per_parameter == 4 * size[BF16]

# %%
# What we saw
# -----------
# - Multiplying by ``beta2 = 0.999`` or by ``1 - lr * weight_decay`` leaves every positive
#   bf16 number unchanged, so a bf16 ``exp_avg_sq`` never decays and AdamW's weight decay
#   never acts on bf16 weights at these settings; ``beta1 = 0.9`` changes all of them.
# - AdamW, SGD with momentum and Adafactor keep their moments in the parameter's dtype, on the
#   CPU and (live or simulated) on CUDA, in their for-loop, foreach and fused forms; ``step``
#   is float32 where they keep one (SGD keeps none).
# - Adding many updates smaller than half a spacing: bf16 with rounding to nearest did not
#   move, stochastic rounding followed float32 on average, Kahan summation stayed within half
#   a spacing of it.
# - Training the character model, pure bf16 ended more than 0.02 above float32's held-out
#   loss, with over 30% of weights and of ``exp_avg_sq`` entries left unchanged per step; a
#   float32 master copy, stochastic rounding and Kahan summation each ended within a quarter
#   of that gap. The master copy holds 14 bytes per parameter here, Kahan 8, stochastic
#   rounding 6, as pure bf16 does.
#
# .. admonition:: References
#
#    :torchapi:`torch.optim.AdamW`, :torchapi:`torch.optim.SGD`,
#    :torchapi:`torch.optim.Adafactor`, :torchdoc:`optim.html`,
#    :ref:`sphx_glr_docs_auto_examples_autograd_plot_01_autocast_master_weights.py`,
#    :ref:`sphx_glr_docs_auto_examples_autograd_plot_04_master_weights.py`

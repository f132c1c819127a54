"""
Loss scaling: why fp16 needs a GradScaler and bf16 does not
===========================================================

Gradients are small numbers, and fp16's smallest normal number is ``2**-14``: how many of a
real model's gradients does fp16 flush to zero, and what does ``torch.amp.GradScaler`` do
about it? We take the gradients of a small next-character model on this build's device, cast
them to fp16 and bf16, run the backward pass under fp16 and bf16 autocast with and without a
loss scale, then follow a GradScaler through its steps: scaling, the inf/NaN check, skipped
steps, growth and backoff, clipping, and the errors readers meet. fp16 autocast loses a few
percent of the activation gradients to zero and a loss scale of ``2**16`` brings them back;
bf16 has float32's exponent range and loses none.
"""

# %%
# Setup
# -----
# Results are live, on the device :func:`mpguide.core.device.pick` chooses: CUDA when present,
# else the CPU (the one section about CUDA's rules simulates them without a GPU, and says so).
# This torch runs fp16 autocast on the CPU as well.
import torch

from mpguide.core import device
from mpguide.core.table import Table
from mpguide.precision import formats
from mpguide.training import loop, loss_scaling

dev = device.pick()
device.describe(dev)
FP16, BF16 = torch.float16, torch.bfloat16

# %%
# The smallest numbers of each format
# -----------------------------------
# A value below a format's smallest normal number is stored as a subnormal, with fewer
# significant bits, and below the smallest subnormal it becomes zero. fp16 has 5 exponent
# bits, bf16 has float32's 8.
fmts = [formats.get(n) for n in ("float32", "bfloat16", "float16")]
Table(
    ("format", "smallest subnormal", "smallest normal", "largest finite"),
    tuple((f.name, f.smallest_subnormal, f.smallest_normal, f.max) for f in fmts),
    f"from torch.finfo and each format's layout, torch {torch.__version__}",
)

# %%
fp32_fmt, bf16_fmt, fp16_fmt = fmts
assert fp16_fmt.smallest_normal == 2**-14 and fp16_fmt.smallest_subnormal == 2**-24
assert bf16_fmt.smallest_normal == fp32_fmt.smallest_normal == 2**-126
assert fp16_fmt.max == 65504

# %%
# The gradients of a real model
# -----------------------------
# The task: predict the next character of the source of ``torch/optim/optimizer.py`` from the
# eight before it, with a small MLP (:func:`mpguide.training.loop.char_task`). We train it in
# float32 for 200 steps (:func:`mpguide.training.loop.train`), then take the gradients of one
# batch of 256 windows in float32 (:func:`mpguide.training.loss_scaling.gradients`): of the
# parameters, and of the output of each ``Linear`` layer, the activation gradients autocast computes
# in its low-precision dtype.
task = loop.char_task()
print(task)
trained = loop.train(["fp32"], task, steps=200, dev=dev)["fp32"]
print(trained)
x, y = task.batch(256, torch.Generator(device=dev).manual_seed(1))
ref = loss_scaling.gradients(trained.model, x, y)
ref

# %%
# Where those float32 gradients land when cast to fp16 and bf16, as they are and multiplied by
# a loss scale of ``2**16`` (:func:`mpguide.training.loss_scaling.landing`; a power of two scales
# exactly):
SCALE = 2.0**16
landings = {
    (kind, dt, s): loss_scaling.landing(getattr(ref, kind), dt, s)
    for kind in ("activations", "parameters")
    for dt in (FP16, BF16)
    for s in (1.0, SCALE)
}
loss_scaling.landing_table(
    [v for (kind, _, _), v in landings.items() if kind == "activations"],
    f"activation gradients of one batch, {device.LIVE} ({dev.type})",
)

# %%
loss_scaling.landing_table(
    [v for (kind, _, _), v in landings.items() if kind == "parameters"],
    f"parameter gradients of one batch, {device.LIVE} ({dev.type})",
)

# %%
act16, act16_scaled = landings["activations", FP16, 1.0], landings["activations", FP16, SCALE]
print(f"fp16: {act16.share('flushed'):.2%} of activation gradients flushed to zero, "
      f"{act16.share('subnormal'):.2%} subnormal; with the loss x 2**16: "
      f"{act16_scaled.share('flushed'):.2%} and {act16_scaled.share('subnormal'):.2%}")
assert act16.flushed > 0 and act16.share("subnormal") > 0.1
assert act16_scaled.flushed < act16.flushed and act16_scaled.overflow == 0
assert act16_scaled.share("normal") > act16.share("normal")
for (kind, dt, s), land in landings.items():
    if dt == BF16:
        assert land.flushed == land.subnormal == land.overflow == 0, (kind, s)

# %%
# The magnitudes of the activation gradients, as they are and scaled by ``2**16``, against
# fp16's limits: the shaded bins flush to zero, the scaled ones sit inside fp16's normal range
# and below its largest value. bf16's smallest normal, ``2**-126``, is far off the left edge.
from mpguide import plots

acts = ref.activations
_ = plots.magnitude_histogram(
    {"activation gradients": acts, "x 2**16 (the loss scale)": acts * SCALE},
    {
        "fp16 smallest subnormal": fp16_fmt.smallest_subnormal,
        "fp16 smallest normal": fp16_fmt.smallest_normal,
        "fp16 largest": fp16_fmt.max,
    },
    title=f"gradients of one batch of the character model, float32 on {dev.type}",
)
assert acts.abs().max().item() * SCALE < fp16_fmt.max
assert acts[acts != 0].abs().min().item() > bf16_fmt.smallest_normal

# %%
# Measured: the backward pass under autocast
# ------------------------------------------
# Casting is what a format can hold; autocast is what a training step really does. We run the
# same batch's backward under fp16 and bf16 autocast, with the loss as it is and multiplied by
# ``2**16`` (divided back in float32 afterwards), and count the gradients that came out zero
# where float32 had a nonzero one.
rows = []
runs_of = {}
for dt in (FP16, BF16):
    for s in (1.0, SCALE):
        runs_of[dt, s] = g = loss_scaling.gradients(trained.model, x, y, dt, s)
        rows.append((g.label, g.activation_dtype, *(f"{v:.3%}" for v in g.flushed(ref))))
Table(("backward", "activation gradients in", "parameter gradients zero", "activation gradients zero"),
      tuple(rows), f"zero under autocast, nonzero in float32; {device.LIVE} ({dev.type})")

# %%
measured = {key: g.flushed(ref)[1] for key, g in runs_of.items()}
print(f"fp16 autocast lost {measured[FP16, 1.0]:.2%} of the activation gradients; "
      f"with the loss x 2**16, {measured[FP16, SCALE]:.3%}")
assert measured[FP16, 1.0] > 0.01
assert measured[FP16, SCALE] < measured[FP16, 1.0] / 10
assert measured[BF16, 1.0] == measured[BF16, SCALE] == 0.0

# %%
# A zero can also come from rounding: a parameter's gradient is a sum over the batch, and a
# sum of terms that nearly cancel can round to zero in the low-precision matmul. The
# parameter gradients bf16 autocast returned as zero were far above any underflow threshold
# in float32:
bf16_run = runs_of[BF16, 1.0]
zeroed = ref.parameters[(bf16_run.parameters == 0) & (ref.parameters != 0)]
print(f"bf16 autocast: {zeroed.numel()} parameter gradients zero, float32 values "
      f"{[f'{v:.3g}' for v in zeroed.tolist()]}")
assert zeroed.numel() < 1e-4 * ref.parameters.numel()
assert (zeroed.abs() > 2**-100).all()

# %%
# The gradient of an op's output has the output's dtype, so the activation gradients above are
# fp16 exactly where autocast ran the ``Linear`` in fp16. Does CUDA's autocast run it in fp16
# too? Its dtype rules come from this build's dispatcher; without a GPU they are simulated on
# fake tensors (no kernel runs, so the numbers above need the hardware).
targets = [device.target("cpu"), device.target("cuda")]
rows = []
for t in targets:
    with device.tensors(t), device.autocast(t, FP16):
        out = torch.nn.functional.linear(torch.randn(4, 128, device=t.device),
                                         torch.randn(88, 128, device=t.device))
    rows.append((device.label(t.device.type, t.how), out.dtype))
Table(("device", "Linear output under fp16 autocast"), tuple(rows))

# %%
assert [dt for _, dt in rows] == [FP16, FP16]

# %%
# What GradScaler does in one step
# --------------------------------
# ``scaler.scale(loss)`` multiplies the loss by the scale, so backward produces scaled
# gradients; ``scaler.unscale_(optimizer)`` divides them by the scale in place and records
# whether any is inf or NaN; ``scaler.step(optimizer)`` calls ``optimizer.step()`` only if
# none was (and unscales first if ``unscale_`` was not called); ``scaler.update()`` sets the
# next scale. One step on a copy of the trained model:
import copy

model = copy.deepcopy(trained.model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler(dev.type, init_scale=SCALE)
params = list(model.parameters())
stages = []

with torch.autocast(dev.type, dtype=FP16):
    logits = model(x)
loss = torch.nn.functional.cross_entropy(logits.float(), y)
scaled = scaler.scale(loss)
assert scaled.item() == loss.item() * SCALE
stages.append(("scaler.scale(loss)", scaler.get_scale(), f"loss {loss.item():.4f} -> {scaled.item():.6g}"))

scaled.backward()
norm = torch.cat([p.grad.flatten() for p in params]).norm().item()
stages.append(("backward()", scaler.get_scale(), f"gradient norm {norm:.6g}"))

scaler.unscale_(opt)
unscaled = torch.cat([p.grad.flatten() for p in params])
stages.append(("scaler.unscale_(opt)", scaler.get_scale(), f"gradient norm {unscaled.norm().item():.6g}"))
assert torch.equal(unscaled, loss_scaling.gradients(trained.model, x, y, FP16, SCALE).parameters)

before = [p.detach().clone() for p in params]
scaler.step(opt)
moved = sum(int((p.detach() != b).sum()) for p, b in zip(params, before, strict=True))
stages.append(("scaler.step(opt)", scaler.get_scale(), f"{moved} of {unscaled.numel()} weights changed"))
scaler.update()
stages.append(("scaler.update()", scaler.get_scale(), "no inf or NaN: the scale stays until 2000 clean steps"))
Table(("call", "scale after it", "what changed"), tuple(stages), f"one fp16 autocast step on {dev.type}")

# %%
assert abs(norm / unscaled.norm().item() / SCALE - 1) < 1e-6
assert moved > 0 and scaler.get_scale() == SCALE

# %%
# Skipped steps, backoff and growth
# ---------------------------------
# The same model trained from scratch under fp16 autocast, with a GradScaler that starts at
# ``2**24`` and grows after every 10 clean steps (the default is 2000, so growth would not
# show in a short run). :func:`mpguide.training.loop.train` records, per step, the scale used,
# whether the scaled gradients held an inf or NaN (checked by us, before ``scaler.step``), and
# which steps left every weight as it was.
import dataclasses

sawtooth = dataclasses.replace(
    loop.RECIPES["autocast-fp16"], name="autocast fp16, GradScaler from 2**24",
    init_scale=2.0**24, growth_interval=10,
)
run = loop.train([sawtooth], task, steps=150, dev=dev)[sawtooth.name]
run

# %%
_ = plots.scale_trace(run, title=f"{run.name}, growth every 10 clean steps, on {dev.type}, "
                                 f"torch {torch.__version__}")

# %%
# The scale halves at every step whose gradients overflowed, and that step changes no weight;
# after 10 clean steps in a row it doubles. The scales the run used are the ones
# :func:`mpguide.training.loss_scaling.scale_schedule` computes from the documented rule and the
# overflow pattern alone:
import math

inf_steps = tuple(i for i, inf in enumerate(run.found_inf) if inf)
first_clean = run.found_inf.index(False)
print(f"skipped: {len(run.skipped)} of {len(run.scales)} steps; the first {first_clean} "
      f"while the scale came down from 2**24 to 2**{math.log2(run.scales[first_clean]):g}")
print(f"scales used: 2**{min(map(math.log2, run.scales)):g} to 2**{max(map(math.log2, run.scales)):g}")
assert run.skipped == inf_steps and first_clean > 0
assert run.scales == loss_scaling.scale_schedule(run.found_inf, 2.0**24, growth_interval=10)
grew = [i for i in range(1, len(run.scales)) if run.scales[i] > run.scales[i - 1]]
assert grew and all(not any(run.found_inf[i - 10 : i]) for i in grew)
assert len(inf_steps) > first_clean  # the scale grew into overflow again later

# %%
# How a program can tell a step was skipped
# -----------------------------------------
# ``scaler.step`` returns ``None`` either way, so compare the scale before and after
# ``scaler.update()``: it went down exactly at the skipped steps above.
dropped = tuple(i for i in range(len(run.scales) - 1) if run.scales[i + 1] < run.scales[i])
assert dropped == tuple(i for i in run.skipped if i < len(run.scales) - 1)

# %%
# Counting ``optimizer.step()`` calls does not tell. A plain AdamW is not called on a skipped
# step, and a learning-rate scheduler stepped after it warns that the optimizer did not step.
# A fused AdamW takes the scale and the inf flag into its kernel: it is called, changes no
# weight, and takes its step count back. One step whose gradient holds an inf, each way:
import warnings


def skipped_step(**kwargs):
    p = torch.nn.Parameter(torch.ones(4, device=dev))
    adamw = torch.optim.AdamW([p], lr=0.1, **kwargs)
    calls = []
    adamw.register_step_post_hook(lambda *_: calls.append(1))
    sched = torch.optim.lr_scheduler.LambdaLR(adamw, lambda _: 1.0)
    gs = torch.amp.GradScaler(dev.type)
    gs.scale(p.sum()).backward()
    p.grad[0] = float("inf")
    before = gs.get_scale()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gs.step(adamw)
        gs.update()
        sched.step()
    step = adamw.state[p].get("step")
    return (", ".join(f"{k}={v}" for k, v in kwargs.items()) or "default", len(calls), bool((p.detach() == 1).all()), gs.get_scale() < before,
            None if step is None else step.item(),
            "; ".join(str(w.message).split(". ")[0] for w in caught) or "none")


skips = Table(("AdamW", "optimizer.step() calls", "weights unchanged", "scale went down",
               "state step", "warnings"),
              (skipped_step(), skipped_step(fused=True)), f"torch {torch.__version__} on {dev.type}")
skips

# %%
plain, fused = skips.records()
assert plain["optimizer.step() calls"] == 0 and fused["optimizer.step() calls"] == 1
assert plain["weights unchanged"] and fused["weights unchanged"]
assert plain["scale went down"] and fused["scale went down"]
assert plain["state step"] is None and fused["state step"] == 0
assert "lr_scheduler.step()" in plain["warnings"] and fused["warnings"] == "none"

# %%
# Unscale before clipping
# -----------------------
# ``clip_grad_norm_`` on scaled gradients measures a norm ``2**16`` times too large and clips
# to ``max_norm`` in scaled units; ``scaler.step`` then divides by the scale, and the update is
# tiny. Calling ``scaler.unscale_(optimizer)`` first clips the true gradients. Both orders,
# against clipping float32 gradients, with plain SGD so the update is ``-lr * gradient``:
MAX_NORM, LR = 0.1, 0.1


def clipped_update(unscale_first, dtype=FP16):
    m = copy.deepcopy(trained.model)
    sgd = torch.optim.SGD(m.parameters(), lr=LR)
    gs = torch.amp.GradScaler(dev.type, init_scale=SCALE, enabled=dtype is not None)
    with torch.autocast(dev.type, dtype=dtype or FP16, enabled=dtype is not None):
        out = m(x)
    gs.scale(torch.nn.functional.cross_entropy(out.float(), y)).backward()
    if unscale_first:
        gs.unscale_(sgd)
    seen = torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM).item()
    start = torch.cat([p.detach().flatten() for p in m.parameters()])
    gs.step(sgd)
    return seen, torch.cat([p.detach().flatten() for p in m.parameters()]) - start


ref_norm, ref_update = clipped_update(True, dtype=None)
rows = []
for label, first in (("unscale_, then clip", True), ("clip the scaled gradients", False)):
    seen, update = clipped_update(first)
    rows.append((label, seen, update.norm().item(), update.norm().item() / ref_update.norm().item()))
clipping = Table(("order", "norm clip_grad_norm_ saw", "update norm", "update / float32's"),
                 tuple(rows), f"clip to {MAX_NORM}, SGD lr {LR}, fp16 autocast on {dev.type}; "
                 f"float32 gradient norm {ref_norm:.4g}")
clipping

# %%
right, wrong = clipping.records()
assert ref_norm > MAX_NORM  # clipping acts
assert abs(right["update / float32's"] - 1) < 1e-3
assert abs(wrong["norm clip_grad_norm_ saw"] / right["norm clip_grad_norm_ saw"] / SCALE - 1) < 1e-3
assert wrong["update / float32's"] < 1e-3

# %%
# Errors readers meet
# -------------------
# Each call below, run on this build; an error or a warning is shown as its first line.
from mpguide import error_line


def outcome(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = call()
        except Exception as err:  # noqa: BLE001 - the table shows what was raised
            return error_line(err)
    if caught:
        return f"{caught[0].category.__name__}: {str(caught[0].message).splitlines()[0]}; {result}"
    return result


def scaler_on(weights, autocast=None, device_type=dev.type):
    lin = torch.nn.Linear(8, 8, device=dev, dtype=weights)
    sgd = torch.optim.SGD(lin.parameters(), lr=0.1)
    gs = torch.amp.GradScaler(device_type)
    with torch.autocast(dev.type, dtype=autocast or BF16, enabled=autocast is not None):
        out = lin(torch.randn(2, 8, device=dev, dtype=weights))
    gs.scale(out.float().sum()).backward()
    start = lin.weight.detach().clone()
    gs.step(sgd)
    gs.update()
    return f"ran, weights changed: {not torch.equal(lin.weight.detach(), start)}, scale {gs.get_scale():g}"


def unscale_twice():
    lin = torch.nn.Linear(8, 8, device=dev)
    sgd = torch.optim.SGD(lin.parameters(), lr=0.1)
    gs = torch.amp.GradScaler(dev.type)
    gs.scale(lin(torch.randn(2, 8, device=dev)).sum()).backward()
    gs.unscale_(sgd)
    gs.unscale_(sgd)


def cuda_scaler_here():
    gs = torch.amp.GradScaler("cuda")
    loss = torch.tensor(2.0)
    return f"enabled: {gs.is_enabled()}, scale(loss) returns {gs.scale(loss).item():g}"


errors = Table(
    ("call", f"torch {torch.__version__} on {dev.type}"),
    (
        ("GradScaler with fp16 weights", outcome(lambda: scaler_on(FP16))),
        ("GradScaler with bf16 weights", outcome(lambda: scaler_on(BF16))),
        ("GradScaler with bf16 autocast", outcome(lambda: scaler_on(torch.float32, BF16))),
        ("scaler.unscale_ twice in one step", outcome(unscale_twice)),
        ('torch.amp.GradScaler("cuda")', outcome(cuda_scaler_here)),
        ("torch.cuda.amp.GradScaler()", outcome(lambda: torch.cuda.amp.GradScaler() and "ran")),
    ),
)
errors

# %%
found = dict(errors.rows)
assert found["GradScaler with fp16 weights"] == "ValueError: Attempting to unscale FP16 gradients."
RAN = "ran, weights changed: True"
NO_CUDA_KERNEL = 'NotImplementedError: "_amp_foreach_non_finite_check_and_unscale_cuda"'
assert found["GradScaler with bf16 autocast"].startswith(RAN), found
bf16_weights = found["GradScaler with bf16 weights"]
assert bf16_weights.startswith((RAN, NO_CUDA_KERNEL) if dev.type == "cuda" else RAN), bf16_weights
print(f"torch {torch.__version__} on {dev.type}: a GradScaler over bf16 autocast raised nothing "
      f"and the weights moved; over bf16 weights: {bf16_weights}")
assert found["scaler.unscale_ twice in one step"].startswith("RuntimeError: unscale_() has already")
assert found["torch.cuda.amp.GradScaler()"].startswith("FutureWarning: `torch.cuda.amp.GradScaler(args...)` is deprecated")
if not torch.cuda.is_available():
    assert found['torch.amp.GradScaler("cuda")'] == (
        "UserWarning: torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  "
        "Disabling.; enabled: False, scale(loss) returns 2"
    )

# %%
# Live on this device: fp16 weights cannot be unscaled, a GradScaler is for float32 weights
# under fp16 autocast (or fp16 weights with a float32 master copy the optimizer steps). Over
# bf16 autocast, the running torch (printed above) raises nothing: the scaler multiplies and
# divides by powers of two, which bf16 does exactly, and the scale is not needed, since bf16
# flushed no gradient above. Over bf16 weights the CPU's unscale kernel runs too. Whether CUDA's
# unscale kernel (``_amp_foreach_non_finite_check_and_unscale_cuda``) accepts bf16 gradients
# the CPU build does not show; the GPU gallery run will (once recorded, the site shows the
# GPU output beside each block). A scaler made for ``"cuda"`` on a machine without CUDA
# switches itself off with a warning, and the loss goes unscaled.
#
# What we saw
# -----------
# - fp16's smallest normal is ``2**-14`` and its smallest subnormal ``2**-24``; bf16's smallest
#   normal is float32's ``2**-126``.
# - Of the activation gradients of the character model, fp16 holds about a third as normal
#   numbers, most of the rest as subnormals, and flushes a few percent to zero; under fp16
#   autocast the backward pass lost that share, measured on this device, and a loss scale of
#   ``2**16`` brought the loss below a tenth of it. bf16 flushed none, scaled or not. CUDA's
#   autocast runs the ``Linear`` in fp16 as well (simulated without a GPU).
# - ``GradScaler`` halved its scale and skipped the step at each overflow, and doubled it after
#   10 clean steps, exactly as its documented rule predicts; the scale going down is how a
#   program tells a step was skipped. A plain AdamW is then not called (and a scheduler warns);
#   a fused one is called and changes nothing.
# - Clipping scaled gradients made the update about ``2**16`` times too small; unscaling first
#   matched float32's clipped update.
# - fp16 weights with a scaler raise ``Attempting to unscale FP16 gradients``; bf16 autocast
#   with a scaler runs in this torch, bf16 weights with a scaler on the CPU (CUDA's unscale
#   kernel with bf16: the GPU gallery run will show it); a ``"cuda"`` scaler without CUDA
#   disables itself.
#
# .. admonition:: References
#
#    :torchapi:`torch.amp.GradScaler`, :torchdoc:`amp.html`,
#    :torchdoc:`notes/amp_examples.html`, :torchapi:`torch.nn.utils.clip_grad_norm_`,
#    :torchapi:`torch.optim.AdamW`, :torchdoc:`type_info.html` (torch.finfo)

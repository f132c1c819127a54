"""
Recompute and no-grad paths in a training step
==============================================

Parts of a training step run outside the forward pass that autocast wrapped: a checkpoint
recomputes its forward during backward, an evaluation runs under ``no_grad`` inside the
training autocast region, a custom autograd function runs its own backward, and ``.grad``
sums gradients across micro-batches. In which dtype does each run? We log every op with
:class:`mpguide.training.autograd.DtypeLog` while checkpointed blocks (reentrant and not) run forward
and backward, count autocast's casts per call under each grad mode, run a custom function with
and without ``torch.amp.custom_fwd``/``custom_bwd``, and compare gradients accumulated in each
dtype with their float64 sum. The answer: the recomputed forward runs in the autocast dtype
of the original forward, even when backward runs under another autocast, and casts every
weight again; the cast cache is shared between ``no_grad`` and grad calls in one region, and
not used under ``inference_mode``; a custom function's backward runs without autocast unless
``custom_bwd`` restores it; and a bf16 ``.grad`` loses precision with every micro-batch,
unless ``grad_dtype`` keeps it in float32.
"""

# %%
# Setup
# -----
import re
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mpguide.core import device, dtypes, versions
from mpguide.core.table import Table
from mpguide.training import autograd, grad_sums

dev = device.pick()
device.describe(dev)
bf16, fp16 = torch.bfloat16, torch.float16


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(dev)


x = torch.randn(8, 16, device=dev, requires_grad=True)
n_tensors = len(list(mlp().parameters()))

# %%
# The recomputed forward
# ----------------------
# A block run through :func:`torch.utils.checkpoint.checkpoint` keeps no activations: backward
# runs its forward again. We run the MLP under bf16 autocast plainly and through a checkpoint,
# both reentrant and not, call backward after leaving the autocast region, and log each phase.
ways = {"no checkpoint": None, "reentrant": True, "non-reentrant": False}
logs, grads = {}, {}
for name, reentrant in ways.items():
    model = mlp()
    x.grad = None
    with autograd.DtypeLog(model) as log:
        with torch.autocast(dev.type, dtype=bf16):
            out = model(x) if reentrant is None else checkpoint(model, x, use_reentrant=reentrant)
        out.float().sum().backward()
    logs[name] = log
    grads[name] = [p.grad for p in model.parameters()] + [x.grad]


def matmuls(log, phase):
    return sorted({r.signature() for r in log.select(phase) if r.op_name == "aten.addmm"})


def n_matmuls(log, phase):
    return sum(r.op_name == "aten.addmm" for r in log.select(phase))


Table(
    ("checkpoint", "forward casts", "backward casts", "addmm run in backward", "how many",
     "gradients equal to no checkpoint"),
    tuple(
        (name, len(log.select("forward", casts=True)), len(log.select("backward", casts=True)),
         ", ".join(matmuls(log, "backward")) or "none", n_matmuls(log, "backward"),
         all(torch.equal(a, b) for a, b in zip(grads[name], grads["no checkpoint"], strict=True)))
        for name, log in logs.items()
    ),
    f"Linear-GELU-Linear under bf16 autocast, backward outside it, on {dev.type}",
)

# %%
# Without a checkpoint, backward runs no ``addmm``. The reentrant checkpoint runs the whole
# forward again, both ``addmm``; the non-reentrant one stops its recompute as soon as it has
# every tensor backward saved, before the second ``addmm`` runs, so it runs one. Both run it in
# bf16, although autocast was off when backward ran: the checkpoint recorded the autocast state
# of its forward and restores it. Autocast's cast cache was cleared
# when the region closed, so the recompute casts every weight, bias and the input again: one
# more cast per parameter tensor and one for the input. The gradients are bit-identical.
plain = len(logs["no checkpoint"].select("backward", casts=True))
for name in ("reentrant", "non-reentrant"):
    assert matmuls(logs[name], "backward") == ["(bfloat16, bfloat16, bfloat16) -> (bfloat16)"]
    assert len(logs[name].select("backward", casts=True)) == plain + n_tensors + 1, name
    assert all(torch.equal(a, b) for a, b in zip(grads[name], grads["no checkpoint"], strict=True))
assert matmuls(logs["no checkpoint"], "backward") == []
counts = {name: n_matmuls(logs[name], "backward") for name in ("reentrant", "non-reentrant")}
assert counts == {"reentrant": 2, "non-reentrant": 1}, counts
print(f"addmm recomputed in backward: {counts}")

# %%
# The forward, the backward and the recompute inside it, op by op: each box an op coloured by
# the dtype it returns, the casts outlined.
from mpguide import plots

_ = plots.log_strips(
    logs["non-reentrant"],
    title=f"non-reentrant checkpoint under bf16 autocast, torch {torch.__version__} on {dev.type}",
)

# %%
# Backward inside another autocast region
# ---------------------------------------
# A training loop that calls backward inside an fp16 autocast region (a mistake, but a common
# one) does not change the recompute: the checkpoint's forward ran under bf16, and so does its
# recompute.
recomputed = {}
for name in ("reentrant", "non-reentrant"):
    model = mlp()
    with autograd.DtypeLog(model) as log:
        with torch.autocast(dev.type, dtype=bf16):
            out = checkpoint(model, x, use_reentrant=ways[name])
        with torch.autocast(dev.type, dtype=fp16):
            out.float().sum().backward()
    recomputed[name] = matmuls(log, "backward")
    print(f"{name}: recomputed addmm {recomputed[name]}")
    assert recomputed[name] == ["(bfloat16, bfloat16, bfloat16) -> (bfloat16)"], name

# %%
# Reentrant and not: what else differs
# -------------------------------------
# The reentrant checkpoint is an autograd function of its tensor inputs: when none of them
# requires grad (the first block of a model, fed data), its output does not either, and the
# parameters inside get no gradient, with a warning. The non-reentrant one follows the
# parameters. And in this torch, leaving ``use_reentrant`` out still only warns.
data = torch.randn(8, 16, device=dev)
first_block = {}
for name in ("reentrant", "non-reentrant"):
    model = mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast(dev.type, dtype=bf16):
            out = checkpoint(model, data, use_reentrant=ways[name])
    if out.requires_grad:
        out.float().sum().backward()
    first_block[name] = (out.requires_grad, model[0].weight.grad is not None,
                         str(caught[0].message) if caught else "")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    checkpoint(mlp(), x)
unspecified = [str(w.message) for w in caught]
Table(
    ("checkpoint", "output requires grad", "weights get a gradient", "warning"),
    tuple((name, *row) for name, row in first_block.items()),
    f"a checkpointed first block fed data that does not require grad, on {dev.type}",
)

# %%
print(f"torch {torch.__version__}, use_reentrant left out: {unspecified[0]}")
assert first_block["reentrant"] == (
    False, False, "None of the inputs have requires_grad=True. Gradients will be None")
assert first_block["non-reentrant"] == (True, True, "")
assert len(unspecified) == 1 and "use_reentrant parameter should be passed explicitly" in unspecified[0]
# The warning announces an exception from a release on; the running torch, at or past that
# release, still only warns (the call above returned).
announced = re.search(r"Starting in PyTorch (\d+\.\d+)", unspecified[0])
assert announced is not None and versions.at_least(announced[1]), unspecified[0]
print(f"torch {torch.__version__} still only warns about an exception announced for "
      f"torch {announced[1]}")

# %%
# The cast cache under ``no_grad`` and ``inference_mode``
# -------------------------------------------------------
# Inside one autocast region, autocast keeps the low-precision copies of float32 leaf tensors
# that require grad (the parameters) and reuses them, until the region exits. A training loop
# may evaluate inside its autocast region, under ``no_grad`` or ``inference_mode``, and then
# train. We call the model twice in one region, each call under a grad mode, and count the
# casts each call made with :class:`mpguide.core.dtypes.Log`; then run backward from the second
# call when it tracked gradients.
from contextlib import nullcontext

modes = {"grad": nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
pairs = [("grad", "grad"), ("no_grad", "grad"), ("no_grad", "no_grad"),
         ("inference_mode", "grad"), ("inference_mode", "inference_mode")]
model = mlp()
inputs = torch.randn(8, 16, device=dev)
cache = {}
for pair in pairs:
    model.zero_grad(set_to_none=True)
    counts = []
    with torch.autocast(dev.type, dtype=bf16):
        for mode in pair:
            with dtypes.Log() as log, modes[mode]():
                out = model(inputs)
            counts.append(len(log.conversions()))
    if out.requires_grad:
        out.float().sum().backward()
    cache[pair] = (*counts, None if model[0].weight.grad is None else model[0].weight.grad.clone())
Table(
    ("first call", "second call", "casts in the first", "casts in the second",
     "weight gradient from the second"),
    tuple((*pair, c1, c2, "none" if g is None else "equal to a fresh region's"
           if torch.equal(g, cache["grad", "grad"][2]) else "differs")
          for pair, (c1, c2, g) in cache.items()),
    f"two calls of a model with {n_tensors} parameter tensors in one bf16 autocast region, "
    f"{dev.type}, torch {torch.__version__}",
)

# %%
# The first call casts each parameter tensor and the input. A second call after ``grad`` or
# ``no_grad`` casts only its input: the copies cast under ``no_grad`` are reused by the call
# that tracks gradients, and its backward still reaches the float32 weights, with the same
# gradient as a fresh region. Under ``inference_mode`` nothing is cached, and a later call
# casts everything again.
for pair, (first, second, grad) in cache.items():
    assert first == n_tensors + 1, pair
    if "inference_mode" in pair:
        assert second == n_tensors + 1, pair
    else:
        assert second == 1, pair
    if pair[1] == "grad":
        assert torch.equal(grad, cache["grad", "grad"][2]), pair

# %%
# Custom autograd functions
# -------------------------
# A :class:`torch.autograd.Function` runs its ``forward`` under whatever autocast is on, and its
# ``backward`` under whatever is on when backward runs: usually nothing. ``torch.amp.custom_fwd``
# records the autocast state at forward and ``custom_bwd`` restores it for backward;
# ``custom_fwd(cast_inputs=torch.float32)`` instead runs forward with autocast off and floating
# inputs cast to float32. The function below multiplies its two inputs, a bf16 activation and a
# float32 weight, and records what each pass saw.
seen = []


def matmul_function(fwd, bwd):
    class MatMul(torch.autograd.Function):
        @staticmethod
        @fwd
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            out = a @ b
            seen.append(("forward", torch.is_autocast_enabled(dev.type), a.dtype, b.dtype,
                         out.dtype))
            return out

        @staticmethod
        @bwd
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            try:
                grad_a, grad_b = grad @ b.T, a.T @ grad
            except RuntimeError:
                seen.append(("backward raised", torch.is_autocast_enabled(dev.type), grad.dtype))
                raise
            seen.append(("backward", torch.is_autocast_enabled(dev.type), grad.dtype,
                         grad_a.dtype, grad_b.dtype))
            return grad_a, grad_b

    return MatMul


def unchanged(fn):
    return fn


variants = {
    "plain": (unchanged, unchanged),
    "custom_fwd + custom_bwd": (torch.amp.custom_fwd(device_type=dev.type),
                                torch.amp.custom_bwd(device_type=dev.type)),
    "custom_fwd(cast_inputs=float32) + custom_bwd": (
        torch.amp.custom_fwd(device_type=dev.type, cast_inputs=torch.float32),
        torch.amp.custom_bwd(device_type=dev.type)),
}
custom = {}
for name, (fwd, bwd) in variants.items():
    seen.clear()
    torch.manual_seed(0)
    a0 = torch.randn(4, 8, device=dev, requires_grad=True)
    w0 = torch.randn(8, 8, device=dev)
    w = torch.randn(8, 3, device=dev, requires_grad=True)
    with torch.autocast(dev.type, dtype=bf16):
        activation = a0 @ w0
        out = matmul_function(fwd, bwd).apply(activation, w)
    try:
        out.float().sum().backward()
        error = None
    except RuntimeError as err:
        error = str(err).splitlines()[0]
    custom[name] = (list(seen), out.dtype, w.grad.dtype if w.grad is not None else None, error)


def passes(records, which):
    found = [r for r in records if r[0] == which]
    entered = [r for r in records if r[0] == f"{which} raised"]
    if not found and entered:
        _, on, grad = entered[0]
        return f"autocast {'on' if on else 'off'}; grad {dtypes.short(grad)}, then raised"
    if not found:
        return "did not run"
    _, on, *kinds = found[0]
    return f"autocast {'on' if on else 'off'}; " + ", ".join(map(dtypes.short, kinds))


Table(
    ("function", "forward: autocast; a, b, out", "backward: autocast; grad, grad a, grad b",
     "weight .grad", "error"),
    tuple((name, passes(records, "forward"), passes(records, "backward"), wgrad, error or "")
          for name, (records, _, wgrad, error) in custom.items()),
    f"a bf16 activation times a float32 weight inside bf16 autocast, on {dev.type}",
)

# %%
# The plain function's forward ran under autocast (its ``@`` cast the weight to bf16) but saved
# the float32 weight; its backward ran with autocast off and raised on the mixed matmul. With
# ``custom_bwd`` backward runs under the forward's bf16 autocast and works. With
# ``cast_inputs=float32``, both passes run in float32 with autocast off.
plain_records, _, _, plain_error = custom["plain"]
assert plain_records[0][1:] == (True, bf16, torch.float32, bf16)
assert passes(plain_records, "backward").endswith("then raised")  # it ran, and raised
assert "to have the same dtype" in plain_error
both = custom["custom_fwd + custom_bwd"]
assert both[0][1][1:] == (True, bf16, bf16, bf16) and both[2] == torch.float32 and both[3] is None
cast = custom["custom_fwd(cast_inputs=float32) + custom_bwd"]
assert cast[0][0][1:] == (False, torch.float32, torch.float32, torch.float32)
assert cast[0][1][1:] == (False, torch.float32, torch.float32, torch.float32) and cast[3] is None
print(f"plain function's backward: {plain_error}")

# %%
# The decorators under ``torch.cuda.amp`` are deprecated in this torch in favour of
# ``torch.amp.custom_fwd(device_type=...)``:
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.cuda.amp.custom_fwd(lambda ctx, a: a)
print(f"torch {torch.__version__}: {caught[0].category.__name__}: {caught[0].message}")
assert caught[0].category is FutureWarning

# %%
# Gradient accumulation
# ---------------------
# Accumulating micro-batches calls backward once per micro-batch and lets autograd add each
# gradient into ``.grad``, in ``.grad``'s dtype.
# :func:`mpguide.training.grad_sums.grad_accumulation` compares ``.grad`` after each count of
# micro-batches with the float64 sum of the gradients the micro-batches delivered, for a float32
# weight under autocast (its gradient arrives in bf16 and is cast to float32), a bf16 weight, and a
# bf16 weight whose ``grad_dtype`` is float32 (an attribute of tensors in this torch).
accumulated = grad_sums.grad_accumulation((1, 2, 4, 8, 16, 32, 64), dev=dev)
accumulated

# %%
# Sums of bf16 gradients are exact in float32 here (their 8 significant bits leave float32
# room for many of them), so the float32 ways show no error at all; the bf16 ``.grad`` rounds
# after each addition and drifts away from the sum.
f32_way, bf16_way, kept_way = grad_sums.GRAD_ACCUMULATION
assert max(accumulated.errors(f32_way)) < 2**-20
assert max(accumulated.errors(kept_way)) < 2**-20
bf16_errors = accumulated.errors(bf16_way)
assert bf16_errors[0] == 0 and bf16_errors[-1] > 1e-2 and bf16_errors[-1] > bf16_errors[1]
weight = torch.zeros(3, device=dev, dtype=bf16, requires_grad=True)
weight.grad_dtype = torch.float32
(weight * 2).sum().backward()
assert weight.grad.dtype == torch.float32
print(f"bf16 .grad after {accumulated.counts[-1]} micro-batches: error {bf16_errors[-1]:.2g}; "
      f"a bf16 weight with grad_dtype=float32 holds a {dtypes.name(weight.grad.dtype)} .grad")
_ = plots.sum_errors(
    accumulated, title=f"{accumulated.what}, torch {torch.__version__} on {dev.type}"
)

# %%
# What we saw
# -----------
# - A checkpoint's recomputed forward runs in the autocast dtype of the original forward, with
#   the reentrant and the non-reentrant implementation, even when backward runs outside autocast
#   or under another autocast; it casts every parameter again, and the gradients are
#   bit-identical to the run without a checkpoint.
# - A reentrant checkpoint whose inputs do not require grad leaves the parameters inside
#   without gradients (with a warning); the non-reentrant one does not. Leaving
#   ``use_reentrant`` out still only warns in this torch.
# - In one autocast region, copies cast under ``no_grad`` are reused by a later call that tracks
#   gradients, and its backward reaches the float32 weights; ``inference_mode`` caches nothing.
# - A custom autograd function's backward runs with autocast off unless ``custom_bwd`` restores
#   the forward's state; ``custom_fwd(cast_inputs=float32)`` runs it in float32 throughout.
# - Micro-batch gradients accumulate exactly into a float32 ``.grad``; a bf16 ``.grad`` drifts
#   from their sum, and ``grad_dtype=float32`` on a bf16 weight keeps ``.grad`` in float32.
#
# .. admonition:: References
#
#    :torchapi:`torch.utils.checkpoint.checkpoint`, :torchapi:`torch.autocast`,
#    :torchapi:`torch.amp.custom_fwd`, :torchapi:`torch.amp.custom_bwd`,
#    :torchapi:`torch.autograd.Function`, :torchapi:`torch.inference_mode`,
#    :torchapi:`torch.Tensor.grad`, :torchdoc:`amp.html`, :torchdoc:`checkpoint.html`

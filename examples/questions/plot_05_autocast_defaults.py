"""
Autocast's defaults and dtypes: readers' questions
==================================================

Five questions about what autocast accepts and picks on each device, its deprecated
spellings, the dtype of gradients under it, and the error a bf16 input meets outside it. Each
is answered by entering autocast here (live on this build's device, simulated for CUDA where
there is no GPU) and reading what comes out. The answers on this torch: CPU and MPS autocast
accept bf16 and fp16 and switch themselves off, with a warning, for float32 and float64, while
CUDA autocast accepts those too; with no dtype it
picks bf16 on the CPU and fp16 on CUDA; ``torch.cuda.amp.autocast`` warns and does what
``torch.autocast("cuda")`` does; gradients take the parameters' dtype; and a matmul needs its
operands in one dtype unless autocast casts them.
"""

# %%
# Setup
# -----
import warnings

import torch
from torch import nn

from mpguide.core import device, dtypes
from mpguide.core.table import Table

dev = device.pick()
device.describe(dev)

# %%
# Which dtypes does autocast accept on each device?
# -------------------------------------------------
# Asked in `pytorch#136082 <https://github.com/pytorch/pytorch/pull/136082>`__ (the docs of CPU
# autocast's float16), `LivePortrait#347 <https://github.com/KlingAIResearch/LivePortrait/issues/347>`__,
# `pytorch#138423 <https://github.com/pytorch/pytorch/pull/138423>`__,
# `AutoForge#55 <https://github.com/hvoss-tech/AutoForge/issues/55>`__ and
# `ComfyUI-MochiWrapper#67 <https://github.com/kijai/ComfyUI-MochiWrapper/pull/67>`__, after
# ``UserWarning: In CPU autocast, but the target dtype is not supported. Disabling autocast.``
# (or ``In MPS autocast, ...``). We enter CPU autocast with each floating dtype, live:
rows = []
for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
    on, said = device.accepts("cpu", dt)
    rows.append((str(dt).removeprefix("torch."), on, said or "none"))
accepted = Table(("dtype", "autocast enabled", "warning"), tuple(rows),
                 f"torch.autocast('cpu', dtype=...), torch {torch.__version__} ({device.LIVE})")
accepted

# %%
by_dtype = {r["dtype"]: r for r in accepted.records()}
assert by_dtype["bfloat16"]["autocast enabled"] and by_dtype["float16"]["autocast enabled"]
for name in ("float32", "float64"):
    assert not by_dtype[name]["autocast enabled"]
    assert "target dtype is not supported. Disabling autocast" in by_dtype[name]["warning"]
print(f"on torch {torch.__version__}: CPU autocast accepts bfloat16 and float16; float32 and "
      "float64 disable it with a warning, not an error")

# %%
# The other devices: :func:`mpguide.autocast.accepts.check` constructs ``torch.autocast`` for
# CUDA and MPS as well, live where this machine has the device, simulated elsewhere (the
# device's availability queries answer as on a machine that has it; for CUDA, a GPU with bf16):
from mpguide.autocast import accepts

TRIED = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
others = tuple(accepts.check(d, dt) for d in ("cpu", "cuda", "mps") for dt in (None, *TRIED))
outcome = {(c.device, c.dtype): c for c in others}
accepts.table(others)

# %%
for d in ("cpu", "cuda", "mps"):
    for dt in (torch.bfloat16, torch.float16):
        assert outcome[d, dt].outcome == "accepted", (d, dt)
for d in ("cpu", "mps"):
    for dt in (torch.float32, torch.float64):
        assert outcome[d, dt].outcome == "autocast disabled" and "not supported" in (
            outcome[d, dt].warning), (d, dt)
for dt in (torch.float32, torch.float64):
    assert outcome["cuda", dt].outcome == "accepted" and not outcome["cuda", dt].warning
defaults_seen = {d: dtypes.name(outcome[d, None].casts_to) for d in ("cpu", "cuda", "mps")}
how = {
    d: "simulated" if outcome[d, None].how == device.SIMULATED else "live" for d in defaults_seen
}
print(
    f"on torch {torch.__version__}: CPU ({how['cpu']}) and MPS ({how['mps']}) accept bfloat16 "
    f"and float16 only; CUDA ({how['cuda']}) also accepts float32 and float64; no dtype= casts "
    "to " + ", ".join(f"{v} on {k}" for k, v in defaults_seen.items())
)

# %%
# ``torch.autocast`` checks the dtype in Python when it is constructed. On this torch, for the three
# devices above (the full set of device types:
# :ref:`sphx_glr_docs_auto_examples_autocast_plot_02_policy_table.py`), CPU and MPS share one list,
# bf16 and fp16, and warn and switch off for float32 and float64; the MPS row is checked here
# without an Apple GPU or macOS (simulated), as torch's check asks for neither. CUDA has no dtype
# list: it accepts float32 and float64 without a warning (autocast then casts to that dtype), and it
# raises only for bf16 on a GPU that lacks it. An unsupported dtype does not raise: autocast warns
# and turns itself off, so the region runs in whatever dtypes the tensors have. Check with
# ``torch.is_autocast_enabled(device_type)`` inside the region.

# %%
# Which dtype does autocast pick when I pass none?
# ------------------------------------------------
# Asked in `Open-Rig3R#35 <https://github.com/engichang1467/Open-Rig3R/issues/35>`__
# ("autocast defaults to fp16 with no GradScaler"): ``torch.autocast(device_type=...)``
# without ``dtype=``. The defaults this build stores, and a ``Linear`` run under each
# device's autocast with no dtype (CUDA simulated where there is no GPU):
lin = nn.Linear(8, 8)
picked = []
for kind in ("cpu", "cuda"):
    target = device.target(kind)
    default = torch.get_autocast_dtype(kind)
    with device.tensors(target, [lin]):
        x = device.move(torch.randn(2, 8), target)
        with device.autocast(target, default):
            out = lin(x)
    picked.append((kind, str(default).removeprefix("torch."), str(out.dtype).removeprefix(
        "torch."), target.how))
defaults = Table(("device", "default autocast dtype", "Linear output", "how"), tuple(picked),
                 f"torch.autocast(device_type) with no dtype, torch {torch.__version__}")
defaults

# %%
cpu_row, cuda_row = defaults.records()
assert cpu_row["default autocast dtype"] == cpu_row["Linear output"] == "bfloat16"
assert cuda_row["default autocast dtype"] == cuda_row["Linear output"] == "float16"
tiny = torch.tensor(1e-8)
assert tiny.half().item() == 0.0 and tiny.bfloat16().item() > 0
print("a gradient of 1e-8 is 0 in fp16 and kept in bf16: fp16 autocast needs a GradScaler")

# %%
# Each device type has its own default, ``torch.get_autocast_dtype(device_type)``: float16 on CUDA
# and on MPS (simulated above where the device is absent; the table of the first question shows what
# ``dtype=None`` casts to on each), bfloat16 on the CPU. Code written with
# ``torch.autocast("cuda")`` therefore trains in fp16, where small gradients underflow (shown above)
# unless a ``GradScaler`` scales the loss. Pass ``dtype=torch.bfloat16`` explicitly, or keep the
# scaler. Loss scaling in depth:
# :ref:`sphx_glr_docs_auto_examples_training_plot_01_loss_scaling.py`.

# %%
# torch.cuda.amp.autocast is deprecated: what replaces it?
# --------------------------------------------------------
# Asked in `pytorch/tutorials#3331 <https://github.com/pytorch/tutorials/issues/3331>`__,
# `trl#1921 <https://github.com/huggingface/trl/pull/1921>`__ and
# `x-transformers#265 <https://github.com/lucidrains/x-transformers/issues/265>`__ after
# ``FutureWarning: `torch.cuda.amp.autocast(args...)` is deprecated. Please use
# `torch.amp.autocast('cuda', args...)` instead.`` The warnings each old spelling raises here:
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.cpu.amp.autocast()
    torch.cuda.amp.autocast()
    torch.cuda.amp.GradScaler()
deprecations = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
for message in deprecations:
    print(message)

# %%
assert any("torch.cuda.amp.autocast(args...)` is deprecated" in m for m in deprecations)
assert any("torch.cpu.amp.autocast(args...)` is deprecated" in m for m in deprecations)
assert any("torch.cuda.amp.GradScaler(args...)` is deprecated" in m for m in deprecations)
with torch.autocast("cpu"):
    new_state = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    with torch.cpu.amp.autocast():
        old_state = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
assert old_state == new_state == (True, torch.bfloat16)
print(f"on torch {torch.__version__}: the old spelling sets the same autocast state as "
      "torch.autocast('cpu')")

# %%
# The device-specific classes are thin subclasses of ``torch.amp.autocast`` (and
# ``torch.amp.GradScaler``) that warn since 2.4 and pass their arguments on: replace
# ``torch.cuda.amp.autocast(...)`` by ``torch.autocast("cuda", ...)`` and
# ``torch.cuda.amp.GradScaler(...)`` by ``torch.amp.GradScaler("cuda", ...)``; the behaviour is
# the same (asserted for the CPU above).

# %%
# Why are my gradients float32 when I autocast?
# ---------------------------------------------
# Asked on the forums, `Is autocast failing to cast gradients?
# <https://discuss.pytorch.org/t/is-autocast-failing-to-cast-gradients/197299>`__: "when I use
# autocast, the gradients are computed in fp32 ... after manually calling ``.half()``,
# gradient is computed in fp16". The reader's repro on this build's device (bf16 on a CPU):
low = torch.get_autocast_dtype(dev.type) if dev.type == "cuda" else torch.bfloat16
model = nn.Linear(8, 1, device=dev)
x = torch.randn(12, 8, device=dev, dtype=low)
with torch.autocast(dev.type, dtype=low):
    model(x).mean().backward()
autocast_grad = model.weight.grad.dtype
model.zero_grad(set_to_none=True)
model.to(low)
with torch.autocast(dev.type, dtype=low):
    model(x).mean().backward()
grads = {"float32 parameters under autocast": autocast_grad,
         f"parameters cast with .to({low})": model.weight.grad.dtype}
grads

# %%
assert grads == {"float32 parameters under autocast": torch.float32,
                 f"parameters cast with .to({low})": low}

# %%
# Autocast casts a copy of each float32 weight to the low dtype inside the forward; autograd
# records that cast, and its backward casts the gradient back to the parameter's dtype. The
# backward matmuls run in the low dtype; the gradient lands in float32, next to the float32
# weight the optimizer updates: that is mixed precision working, not failing. A ``.half()``
# model has fp16 parameters and so fp16 gradients. The casts of the backward, traced:
# :ref:`sphx_glr_docs_auto_examples_autograd_plot_01_autocast_master_weights.py`.

# %%
# Why does a bf16 input and a float32 weight fail with mat1 and mat2 must have the same dtype?
# --------------------------------------------------------------------------------------------
# Asked in `Lightning#19980 <https://github.com/Lightning-AI/pytorch-lightning/issues/19980>`__,
# `ColossalAI#6169 <https://github.com/hpcaitech/ColossalAI/issues/6169>`__ and
# `sdnext#4459 <https://github.com/vladmandic/sdnext/issues/4459>`__:
# ``RuntimeError: mat1 and mat2 must have the same dtype, but got Float and BFloat16`` (the
# CUDA wording). A bf16 activation into a float32 ``Linear``, outside and inside autocast,
# live on the CPU:
weight = nn.Linear(4, 3)
act = torch.randn(2, 4, dtype=torch.bfloat16)
try:
    weight(act)
    outside = "ran"
except RuntimeError as err:
    outside = str(err)
with torch.autocast("cpu", dtype=torch.bfloat16):
    inside = weight(act).dtype
mixing = {"outside autocast": outside, "inside autocast": inside}
mixing

# %%
assert "to have the same dtype" in mixing["outside autocast"] or "must have the same dtype" in (
    mixing["outside autocast"])
assert inside == torch.bfloat16
print(f"on torch {torch.__version__} (cpu) the message reads: {outside}")

# %%
# ``linear`` and ``matmul`` do not promote: outside autocast both operands must already share
# a dtype (the message, printed above, comes from ``addmm``; a ``Linear`` without bias words
# it ``expected m1 and m2 to have the same dtype``). Under autocast the op casts both to the
# autocast dtype first. The error means a tensor left the autocast region (a module called
# outside it, a cached bf16 activation, an input cast by hand); wrap that call in autocast
# or cast the input with ``.to(weight.dtype)``. Every such case:
# :ref:`sphx_glr_docs_auto_examples_autocast_plot_01_mixing_dtypes.py`.

# %%
# What we saw
# -----------
# - CPU autocast (live) and MPS autocast (simulated) accept bf16 and fp16; float32 and float64
#   disable them with a warning. CUDA autocast (simulated without a GPU) accepts all four.
# - With no dtype, autocast picks bf16 on the CPU and fp16 on CUDA (simulated here when no
#   GPU is present), and fp16 needs a GradScaler.
# - ``torch.cuda.amp.autocast``, ``torch.cpu.amp.autocast`` and ``torch.cuda.amp.GradScaler``
#   warn and behave like ``torch.autocast`` and ``torch.amp.GradScaler``.
# - Gradients take the parameters' dtype: float32 under autocast.
# - A bf16 input into a float32 ``Linear`` fails outside autocast and runs inside.
#
# .. admonition:: References
#
#    :torchdoc:`amp.html`, :torchapi:`torch.autocast`, :torchapi:`torch.get_autocast_dtype`,
#    :torchapi:`torch.is_autocast_enabled`

"""
A transformers model, module by module
======================================

In a real model under bf16 autocast, which module runs in which dtype, where does autocast
insert casts, and where is precision lost? We build a small Qwen2 language model from its
configuration with Hugging Face ``transformers`` (random weights, nothing downloaded) and run
:func:`mpguide.models.per_module.report` on it: hooks on every module and a dispatch-mode log count each
op and cast in the innermost module running it, forward and backward, and a float64 copy of
the model on the same tokens gives each module's error. The projections run in bf16 with
their float32 weights cast on every call, Qwen2's RMSNorm keeps float32 (its inputs and
weights are float32), and the error of the logits is a few bf16 roundings; CUDA's autocast, simulated beside it, casts
differently inside attention.
"""

# %%
# Setup
# -----
# The report runs live on the device :func:`mpguide.core.device.pick` chooses: CUDA when
# present, else the CPU. Its float64 reference runs on the same device.
import torch

from mpguide.core import device

dev = device.pick()
device.describe(dev)

# %%
# A Qwen2 model from its configuration
# ------------------------------------
# Two decoder layers of width 64, the architecture of the Qwen2 checkpoints at a size that
# runs in seconds. A fixed seed gives the random weights; the inputs are token ids, passed as
# keyword arguments as ``transformers`` models take them, without a key-value cache.
import transformers

from mpguide.models import zoo

model = zoo.qwen2(hidden=64, intermediate=128, layers=2)
inputs = zoo.token_inputs(model, 2, 32)
print(f"transformers {transformers.__version__}, {type(model).__name__}: "
      f"{sum(p.numel() for p in model.parameters()):,} parameters")

# %%
# The report
# ----------
# One row per module call, in call order. ``ops`` and ``casts`` count what the module ran
# itself, not its submodules; ``autocast casts`` are the casts a run with autocast off does
# not make; ``bwd`` columns count the backward pass (ones as output gradients), each op in the
# module whose forward op made its autograd node. The error columns compare the first input
# and the output with the float64 run: ``max |error| / mean |ref|``. The same report on your
# model: ``python -m mpguide model mymodel.py:make --backward`` (see :doc:`/docs/cli`).
from mpguide.models import per_module

report = per_module.report(model, inputs, autocast="bfloat16", device=dev, backward=True)
report

# %%
# Where the dtypes change
# -----------------------
# Every linear projection returns bf16 while its weight stays float32: autocast casts the
# weight (and bias) on every call, and the input when it arrives in float32. Each of those
# casts has its mirror in the backward pass, where the gradients are cast back to float32.
# Every RMSNorm call here gets a float32 input (the residual stream stays float32) and has a
# float32 weight, so it returns float32 and autocast adds nothing.
linears = {c.name: c for c in report.calls if c.kind == "Linear"}
for name, row in linears.items():
    params = len(list(model.get_submodule(name).parameters()))
    assert row.outputs == (torch.bfloat16,) and row.params == (torch.float32,)
    assert row.autocast_casts == params + (row.inputs[0] == torch.float32)
    assert row.backward_autocast_casts == row.autocast_casts
q = report["model.layers.0.self_attn.q_proj"]
o = report["model.layers.0.self_attn.o_proj"]
assert q.inputs == (torch.float32,) and model.model.layers[0].self_attn.q_proj.bias is not None
assert o.inputs == (torch.bfloat16,) and model.model.layers[0].self_attn.o_proj.bias is None
print(f"q_proj: {q.autocast_casts} casts (float32 input, weight, bias); "
      f"o_proj: {o.autocast_casts} (a bf16 input from the attention, a weight, no bias)")
norms = [c for c in report.calls if c.kind == "Qwen2RMSNorm"]
assert all(c.inputs == (torch.float32,) and c.params == (torch.float32,) for c in norms)
assert all(c.outputs == (torch.float32,) and c.autocast_casts == 0 for c in norms)
print(f"{len(norms)} RMSNorm calls, all with float32 inputs and weights, all returning float32 "
      "with no cast from autocast")

# %%
# Where precision goes
# --------------------
# The report names the first module whose output error is ten times its input's (an error
# below bf16's unit roundoff counting as the unit roundoff) and the first non-finite value,
# if any. The float64 reference is not float64 everywhere: Qwen2's RMSNorm and rotary
# embedding convert to float32 themselves, and the report lists where.
for line in report.findings():
    print(line)
assert report.first_nonfinite is None
assert report["model.rotary_emb"].key in report.narrowed
assert all(c.key in report.narrowed for c in norms)
logits = report[""].error.max_rel
print(f"logits: max |error| / mean |ref| = {logits:.3g}, "
      f"{logits / (torch.finfo(torch.bfloat16).eps / 2):.1f} bf16 unit roundoffs")

# %%
# bf16 against fp16, module by module
# -----------------------------------
# The same model under fp16 autocast: fp16 keeps three more significand bits than bf16, and
# nothing in this model comes near its range, so every module's error is smaller.
fp16 = per_module.report(model, inputs, autocast="float16", device=dev)
assert fp16.first_nonfinite is None
assert fp16[""].error.max_rel < report[""].error.max_rel
smaller = sum(
    b.error.max_rel <= a.error.max_rel for a, b in zip(report.calls, fp16.calls, strict=True)
)
print(f"fp16's output error is at most bf16's in {smaller} of {len(fp16.calls)} module calls; "
      f"logits {fp16[''].error.max_rel:.3g} against {report[''].error.max_rel:.3g}")

from mpguide import plots

fig = plots.module_errors(
    {"autocast bf16": report, "autocast fp16": fp16},
    title=f"Qwen2 (2 layers, width 64): output error per module call, {report.machine.caption()}",
)

# %%
# The other device's autocast
# ---------------------------
# Autocast's rules differ per device. The same report on the other device (simulated from
# this build's dispatch rules where the machine lacks it: dtypes and casts, no errors) beside
# this one, for the module calls that differ.
other_type = "cuda" if dev.type == "cpu" else "cpu"
other = per_module.report(model, inputs, autocast="bfloat16", device=other_type)
assert [c.key for c in other.calls] == [c.key for c in report.calls]
differ = per_module.differences(report, other)
attention = [r for r in differ.rows if r[0].endswith("self_attn")]
if other.simulated:  # a simulated transformers model builds its mask (per_module.TRANSFORMERS_PATH)
    assert attention
differ

# %%
# What we saw
# -----------
# Restated from the values computed above.
largest_jump = report.largest_jump
print(f"- Every one of the {len(linears)} linear projections ran in bf16 with float32 weights "
      "that autocast cast on each call, and the backward pass cast back as many gradients.")
print(f"- The {len(norms)} RMSNorm calls returned float32 with no cast from autocast: their "
      "inputs and weights are float32, and the float64 reference rounds to float32 there too.")
print(f"- The logits' error was {report[''].error.max_rel:.3g} of their mean magnitude in bf16, "
      f"{fp16[''].error.max_rel:.3g} in fp16; the largest growth in error: "
      f"{largest_jump.label if largest_jump else 'none'}.")
print(f"- {len(differ.rows)} module calls differ between {device.label(dev.type, report.how)} "
      f"and {device.label(other_type, other.how)}, {len(attention)} of them attention modules.")

# %%
# .. admonition:: References
#
#    :torchapi:`torch.autocast`, :torchdoc:`amp.html`,
#    :torchapi:`torch.nn.Module.register_forward_pre_hook`,
#    :torchapi:`torch.nn.Module.register_forward_hook`,
#    :torchdoc:`notes/extending.html` (``__torch_dispatch__``),
#    :torchapi:`torch.autograd.grad`

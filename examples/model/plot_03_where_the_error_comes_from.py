"""
Where the error comes from, op by op
====================================

A model in bf16 is off: which op is to blame, and what is the cheapest fix? We run a small
Qwen2 language model (built from its configuration with ``transformers``, random weights,
nothing downloaded) with :func:`mpguide.models.diff.diff`: beside the bf16 run, a float64
shadow is carried op by op, and each op's error is split into what the op adds itself (*local*:
its output against the exact result on the inputs it was given) and what it received
(*inherited*). We plant one hazard, an activation
rounded to float8, and meet a real one, rotary position embeddings at position 8000 in a model
cast whole to bf16. Then :func:`mpguide.models.fixes.fix_list` keeps the worst sources in
float32 and measures what that buys, and PyTorch's own ``DebugMode`` runs on the same model for
comparison.
"""

# %%
# Setup
# -----
# The runs are live on the device :func:`mpguide.core.device.pick` chooses: CUDA when present,
# else the CPU. The float64 shadow runs on the same device.
import torch

from mpguide.core import device

dev = device.pick()
device.describe(dev)

# %%
# A Qwen2 model with a planted hazard
# -----------------------------------
# Two decoder layers of width 64. The planted hazard: the final norm is followed by a module that
# rounds its output to float8 (e4m3) and back, as an activation quantized to fp8 before the
# language-model head would be. The tokens sit at positions 8000 to 8015, as in a long context.
import transformers
from torch import nn


class RoundsToFloat8(nn.Module):
    """The planted hazard: an activation rounded to float8 e4m3 and back."""

    def forward(self, x):
        return x.to(torch.float8_e4m3fn).to(x.dtype)


def make():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16384,
    )
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.model.norm = nn.Sequential(model.model.norm, RoundsToFloat8())
    ids = torch.randint(0, config.vocab_size, (1, 16))
    positions = torch.arange(8000, 8016)[None]
    return model, {"input_ids": ids, "position_ids": positions, "use_cache": False}


model, inputs = make()
PLANTED = "model.norm.1"
positions = inputs["position_ids"]
print(f"transformers {transformers.__version__}, {type(model).__name__}: "
      f"{sum(p.numel() for p in model.parameters()):,} parameters; positions "
      f"{positions.min().item()} to {positions.max().item()}")

# %%
# The diff under bf16 autocast
# ----------------------------
# One row per *source*: a module call's line of code, with the ops it ran there (autocast's
# casts included). ``local`` sums its ops' local errors, the error the source creates;
# ``inherited`` and ``total`` are those of its last op's output. The errors of this page are
# ``‖error‖ / ‖ref‖`` against the shadow. Backward ops are placed at the line of the forward
# op that made their autograd node. The same on your model:
# ``python -m mpguide diff mymodel.py:make --backward`` (see :doc:`/docs/cli`).
from mpguide.models import diff
from mpguide.training.autograd import BACKWARD, FORWARD

found = diff.diff(model, inputs, autocast="bfloat16", device=dev, backward=True)
top = found.sources(FORWARD)[0]
assert top.module == PLANTED, top
held, checked = found.closure
assert held == checked > 100
found.table("sources", limit=12)

# %%
# The split adds up as the triangle inequality says
# -------------------------------------------------
# With ``t`` the op's bf16 output, ``a`` the shadow's and ``b`` the op run in float64 on the
# bf16 run's own inputs, ``t − a = (t − b) + (b − a)``, so for every op of this run
# ``|local − inherited| ≤ total ≤ local + inherited``. The check ran on every op of this run.
from mpguide.models.shadow import TOLERANCE

planted_op = found.ranked(FORWARD)[0]
assert planted_op.module == PLANTED
print(f"{held} of {checked} ops hold the bounds (tolerance {TOLERANCE:g} relative).")
bf16_unit = torch.finfo(torch.bfloat16).eps / 2
print(f"The planted cast: local {planted_op.local:.3g}, inherited {planted_op.inherited:.3g}, "
      f"total {planted_op.total:.3g}: {planted_op.local / bf16_unit:.1f} times bf16's unit "
      f"roundoff, below float8 e4m3's ({torch.finfo(torch.float8_e4m3fn).eps / 2:g}).")
assert 3 * bf16_unit < planted_op.local < torch.finfo(torch.float8_e4m3fn).eps / 2

# %%
# The error budget per stage
# --------------------------
# A module call's error splits as an op's does, one level up: with ``t`` its bf16 output, ``a``
# the shadow's and ``b`` the same call run again in float64 on the bf16 run's own inputs, its
# *local* error ``‖t − b‖ / ‖a‖`` is what the call adds itself and its *inherited* error
# ``‖b − a‖ / ‖a‖`` is what it received, carried through it. Below, each decoder layer, the final
# norm and the head: inherited (blue) under local (orange), and a dot at the total, which the
# triangle inequality keeps at or below the bar's top; the check held on every module call
# here. The final norm, which holds the planted rounding, adds most; the head adds little and
# carries what it received. A stage's *created* error, the sum of its ops' local errors, adds
# errors measured on different tensors, each relative to its own op's output, so it is no error
# of the stage's output: for each decoder layer here it is many times what the layer adds. The
# bars show the module's own split, in the units of its output.
from mpguide.plots import models as model_plots

STAGES = ("model.layers.0", "model.layers.1", "model.norm", "lm_head")
budget = {m.name: m for m in found.modules if m.name in STAGES}
assert max(budget.values(), key=lambda m: m.worst).name == "model.norm"
assert max(budget.values(), key=lambda m: m.local).name == "model.norm"
calls_held, calls_checked = found.module_closure
assert calls_held == calls_checked == len(found.modules), found.findings()
print(f"{calls_held} of {calls_checked} module calls hold the bounds.")
for m in budget.values():
    print(f"{m.label}: {m.ops} ops, local {m.local:.3g}, inherited {m.inherited:.3g}, "
          f"total {m.output:.3g}; created {m.created:.3g} ({m.created / m.local:.1f}× local)")
layers = [budget[name] for name in STAGES[:2]]
assert all(m.created > 5 * m.local for m in layers)
assert budget["lm_head"].inherited > 5 * budget["lm_head"].local
_ = model_plots.error_budget(
    found,
    modules=STAGES,
    title=f"Qwen2, bf16 autocast, error budget per stage, {found.machine.caption()}",
)

# %%
# Gradients
# ---------
# With ``backward=True`` every parameter of this model has its gradient compared with the
# shadow's (seeded standard-normal output gradients). The backward ops rank the same way as
# the forward ones: the planted cast's backward rounds the gradient to float8 too.
backward_top = found.sources(BACKWARD)[0]
print(f"Largest backward source: {backward_top.module} ({backward_top.names}), local "
      f"{backward_top.local:.3g}")
assert backward_top.module == PLANTED
found.table("grads", limit=6)

# %%
# What keeping a source in float32 buys
# -------------------------------------
# The three worst forward sources, each kept in float32 alone, then one after another, the one
# that buys most first. The measure is the log-probability error in nats (the model returns
# logits): the mean over positions of ``|Δ log p|`` of the token the float64 reference ranks
# first. Keeping the planted rounding in float32 removes more than half of it.
from mpguide.models import fixes

fixed = fixes.fix_list(model, inputs, found, 3, autocast="bfloat16", device=dev)
first = fixed.steps[0]
assert first.module == PLANTED and fixed.drop(0) > 0.5
print(fixed.sentence())
fixed

# %%
# A real hazard: RoPE at position 8000 in a model cast whole
# ----------------------------------------------------------
# Cast to bf16 whole (``model.to(torch.bfloat16)``), the rotary embedding's buffer of inverse
# frequencies is rounded to bf16 with the weights: a relative error of a few thousandths,
# which the angle ``position × inv_freq`` multiplies by 8000. The diff names the cast buffer
# as a source of its own (a ``cast`` row), and the rotation lines inherit a large error. Under
# autocast the buffer stays float32.
pure = diff.diff(make()[0], inputs, dtype="bfloat16", device=dev)
ROPE_LINE = "model.layers.0.self_attn"


def rope_error(result):
    """The largest total error of the rotation's ops (those that mix q or k with cos, sin)."""
    return max(
        o.total
        for o in result.ops
        if o.phase == FORWARD and o.module == ROPE_LINE and o.op.startswith("aten.mul")
    )


cast_freq = next(s for s in pure.sources(diff.CAST) if s.line == "model.rotary_emb.inv_freq")
print(f"inv_freq rounded to bf16: local error {cast_freq.local:.3g}")
print(f"Largest error of a product in layer 0's attention: {rope_error(pure):.3g} cast whole, "
      f"{rope_error(found):.3g} under autocast.")
assert rope_error(pure) > 10 * rope_error(found)

# %%
# Keeping the line that reads ``inv_freq`` in float32 (the kept op reads the buffer as it was
# before the cast) is what fixes it; the fix list says what that buys at the output of this
# small random model.
freq_line = next(
    s for s in pure.sources(FORWARD)
    if s.module == "model.rotary_emb" and any(o.op == "aten._to_copy" for o in s.ops)
    and "mul" in s.names
)
rope_fixed = fixes.fix_list(
    make()[0], inputs, pure, 0, sources=((freq_line.module, freq_line.line),),
    dtype="bfloat16", device=dev,
)
print(f"Keeping {freq_line.module} at {freq_line.line} in float32 "
      f"{'removes' if rope_fixed.drop(0) > 0 else 'adds'} "
      f"{abs(100 * rope_fixed.drop(0)):.0f} % of the log-probability error.")
rope_fixed

# %%
# Under a low-bit target: linear layers in NVFP4
# ----------------------------------------------
# ``target="nvfp4"`` (``--target nvfp4`` on the command line, with the targets of
# ``mpguide model --target``) runs the model in float32 with each linear layer computing on
# its input and its weight quantized to NVFP4 (emulated), the embedding left out. Each
# quantization is an op of its own, ``quantize nvfp4 (input)`` or ``(weight)``, placed in the
# layer's call at the line that called the layer, and the layer's GEMM inherits its error. This run has no backward
# pass: the emulated quantization has no gradient of its own.
lowbit = diff.diff(model, inputs, target="nvfp4", device=dev)
lowbit_sources = lowbit.sources(FORWARD)
layer_calls = [s for s in lowbit_sources if "quantize nvfp4" in s.names]
quantizations = [o for o in lowbit.ops if o.op.startswith("quantize nvfp4")]
planted_rank = next(i for i, s in enumerate(lowbit_sources, 1) if s.module == PLANTED)
lowbit_held, lowbit_checked = lowbit.closure
assert lowbit_held == lowbit_checked and len(quantizations) == 2 * len(layer_calls)
assert lowbit_sources[: len(layer_calls)] == layer_calls  # the layers first, then the rest
smallest, largest = min(s.local for s in layer_calls), max(s.local for s in layer_calls)
assert largest < 1.25 * smallest
print(f"{len(layer_calls)} layer calls, {len(quantizations)} quantizations: the "
      f"{len(layer_calls)} largest sources, local {smallest:.3g} to {largest:.3g}; the planted "
      f"float8 rounding ranks {planted_rank} of {len(lowbit_sources)} (local "
      f"{lowbit_sources[planted_rank - 1].local:.3g}). {lowbit_held} of {lowbit_checked} ops "
      "hold the bounds.")
lowbit.table("sources", limit=6)

# %%
# With random weights the layers here quantize alike: the largest source's local error is less
# than 1.25 times the smallest's. The fix list keeps the three worst layers unquantized (in
# float32), alone and then one after another, the one that buys most first; its ``alone``
# column says what keeping each alone does to the log-probability error.
lowbit_fixed = fixes.fix_list(model, inputs, lowbit, 3, target="nvfp4", device=dev, repeat=1)
worse = [s for s in lowbit_fixed.steps if s.alone < 0]
print(lowbit_fixed.sentence())
print(f"Ranked first: {lowbit_sources[0].module}; kept first: {lowbit_fixed.steps[0].module}. "
      f"{len(worse)} of {len(lowbit_fixed.steps)} layers kept alone made the log-probability "
      "error larger.")
lowbit_fixed

# %%
# Beside PyTorch's DebugMode
# --------------------------
# ``torch.utils._debug_mode.DebugMode`` (a private module, present on the torch this page runs
# on when the cell below says so) logs every op with its input and output dtypes and shapes,
# nested in modules, and can log a hash of every output (its L1 norm) to compare two runs. Its
# comparison needs two runs with the same ops: a bf16 autocast run against a float32 run has
# more ops (autocast's casts), so it refuses them.
import torch.utils

has_debug_mode = hasattr(torch.utils, "_debug_mode")
print(f"torch {torch.__version__}: torch.utils._debug_mode "
      f"{'present' if has_debug_mode else 'absent'}")
if has_debug_mode:
    from torch.utils._debug_mode import DebugMode

    logs = {}
    for name, precision in (("float32", None), ("bf16 autocast", torch.bfloat16)):
        with (
            DebugMode(record_nn_module=True) as debug,
            DebugMode.log_tensor_hashes(),
            torch.no_grad(),
            device.autocast(device.target(dev), precision),
        ):
            model(**inputs)
        logs[name] = debug.logs
        print(f"{name}: {len(debug.logs)} calls logged")
    print("\n".join(debug.debug_string().splitlines()[:8]))
    try:
        DebugMode.check_hash_mismatches(logs["float32"], logs["bf16 autocast"])
        compared = "compared"
    except ValueError as err:
        compared = f"refused: {str(err).splitlines()[0][:90]}"
    print(f"check_hash_mismatches on the two runs: {compared}")
    assert compared.startswith("refused")

# %%
# Side by side, on this model:
from mpguide.core.table import Table

Table(
    ("", "DebugMode", "diff"),
    (
        ("ops logged", "every op, dtypes, shapes, modules", "every op, module, reader's line"),
        ("numbers", "a hash (L1 norm) per output", "local, inherited, total error vs float64"),
        ("two precisions", "refused (different op lists)", "one run, float64 shadow per op"),
        ("ranking", "none", "sources, ops, modules, gradients"),
        ("fixes", "none", "kept in float32: error removed, casts, bytes, time"),
    ),
    "what each gives on the same forward pass",
)

# %%
# What we saw
# -----------
# Restated from the values computed above.
print(f"- The planted float8 rounding ranked first of {len(found.sources(FORWARD))} forward "
      f"sources (local {top.local:.3g}) and first of the backward ones.")
print(f"- On all {checked} ops, |local - inherited| <= total <= local + inherited held.")
print(f"- So it did on all {calls_checked} module calls; the final norm added the most "
      f"(local {budget['model.norm'].local:.3g}).")
print(f"- Keeping it in float32 removed {100 * fixed.drop(0):.0f} % of the log-probability "
      f"error ({fixed.logprob:.3g} nats before).")
print(f"- Cast whole to bf16 at position 8000, layer 0's rotation products were off by "
      f"{rope_error(pure):.3g}, {rope_error(pure) / rope_error(found):.0f} times their error under "
      "autocast, which keeps inv_freq in float32.")
print(f"- With its linear layers quantized to NVFP4, the {len(layer_calls)} layer calls were the "
      f"largest sources ({smallest:.3g} to {largest:.3g}), the planted rounding rank "
      f"{planted_rank}; keeping the first layer of the fix list unquantized removed "
      f"{100 * lowbit_fixed.drop(0):.0f} % of the log-probability error.")
if has_debug_mode:
    print("- DebugMode logged both runs and refused to compare them: their op lists differ.")

# %%
# .. admonition:: References
#
#    :torchdoc:`notes/extending.html` (``__torch_dispatch__``),
#    :torchapi:`torch.autocast`, :torchapi:`torch.autograd.grad`,
#    :torchapi:`torch.nn.Module.register_forward_pre_hook`,
#    ``torch.utils._debug_mode.DebugMode`` (a private module)

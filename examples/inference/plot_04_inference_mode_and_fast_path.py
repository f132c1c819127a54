"""
inference_mode, no_grad, and the TransformerEncoder fast path
=============================================================

Two switches change what a served transformer runs. :func:`torch.inference_mode` goes further
than :class:`torch.no_grad`: what does it forbid afterwards? And
:class:`torch.nn.TransformerEncoder` has a fused inference "fast path": is it taken under
autocast on this build's device, and what dtype and error come out? We run both and record
what happens.
"""

# %%
# Setup
# -----
import torch
from torch import nn

from mpguide.core import device

dev = device.pick()
device.describe(dev)

torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).to(dev).eval()
x = torch.randn(8, 16, 64, device=dev)

# %%
# What the outputs of ``inference_mode`` and ``no_grad`` allow
# ------------------------------------------------------------
# Both skip recording the autograd graph. ``inference_mode`` also marks its outputs as
# inference tensors: they cannot be updated in place outside the mode, and autograd cannot
# save them for a backward pass.
from mpguide.core.table import Table

with torch.inference_mode():
    y_inference = encoder(x)
with torch.no_grad():
    y_no_grad = encoder(x)

w = torch.ones(64, device=dev, requires_grad=True)


def outcome(fn) -> str:
    try:
        fn()
    except RuntimeError as err:
        return f"raises: {str(err).split('.')[0]}"
    return "works"


rows = []
for name, y in (("inference_mode", y_inference), ("no_grad", y_no_grad)):
    rows.append((name, y.is_inference(), y.requires_grad,
                 outcome(lambda y=y: y.add_(1)),
                 outcome(lambda y=y: (y * w).sum().backward())))
modes = Table(("output of", "is_inference", "requires_grad", "in-place add afterwards",
               "used in backward afterwards"), tuple(rows), f"on {dev.type}")
modes

# %%
inf_row, ng_row = modes.records()
assert inf_row["is_inference"] and not ng_row["is_inference"]
assert not inf_row["requires_grad"] and not ng_row["requires_grad"]
assert inf_row["in-place add afterwards"].startswith("raises")
assert inf_row["used in backward afterwards"].startswith("raises")
assert ng_row["in-place add afterwards"] == ng_row["used in backward afterwards"] == "works"

# %%
# Their latency on this model, measured in interleaved rounds; a relation is printed only
# when the gap between the medians exceeds both interquartile ranges.
from mpguide.core import timing


def run_inference_mode():
    with torch.inference_mode():
        encoder(x)


def run_no_grad():
    with torch.no_grad():
        encoder(x)


lat = timing.compare_latency({"inference_mode": run_inference_mode, "no_grad": run_no_grad},
                             dev, warmup=3, repeat=20, items=x.shape[0])
if lat["inference_mode"].clearly_below(lat["no_grad"]):
    verdict = "inference_mode is faster than no_grad here"
elif lat["no_grad"].clearly_below(lat["inference_mode"]):
    verdict = "no_grad is faster than inference_mode here"
else:
    verdict = "the difference is within the measurement spread here"
print(verdict)
timing.latency_table(lat, f"encoder forward, batch {x.shape[0]}, on {dev.type}")

# %%
# The fast path under autocast
# ----------------------------
# In eval mode, without grad, the encoder can run each layer as one fused op,
# ``aten::_transformer_encoder_layer_fwd``. We profile it with float32 weights under
# autocast bf16, and under the same autocast with grad enabled (which rules the fast path
# out), and compare both with the float32 output.
from torch.profiler import ProfilerActivity, profile


def fast_path_taken(fn) -> bool:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return any(e.key == "aten::_transformer_encoder_layer_fwd" for e in prof.key_averages())


with torch.inference_mode():
    reference = encoder(x).double()


def under_autocast(grad: bool) -> torch.Tensor:
    with torch.set_grad_enabled(grad), torch.autocast(dev.type, dtype=torch.bfloat16):
        return encoder(x).detach()


rows = []
for grad in (False, True):
    out = under_autocast(grad)
    err = (out.double() - reference).abs()
    rows.append(("enabled" if grad else "disabled", fast_path_taken(lambda g=grad: under_autocast(g)),
                 out.dtype, err.max().item(), err.mean().item()))
fast = Table(("grad", "fast path taken", "output", "max error", "mean error"), tuple(rows),
             f"TransformerEncoder under autocast({dev.type!r}, bfloat16), "
             f"torch {torch.__version__}")
fast

# %%
# The encoder decides with ``torch.is_autocast_enabled()``, which without a device argument
# reports CUDA's autocast state only. So on CUDA, autocast rules the fast path out (live on a
# GPU build; on every build, the switch it reads is simulated below under CUDA's autocast); on the
# CPU this torch takes the fast path under autocast, and the fused layer returns bf16 with a
# larger error than the unfused layers (which end in float32 LayerNorms after the residual).
no_grad_row, grad_row = fast.records()
with torch.autocast(dev.type, dtype=torch.bfloat16):
    seen = torch.is_autocast_enabled(), torch.is_autocast_enabled(dev.type)
print(f"under autocast({dev.type!r}): torch.is_autocast_enabled() -> {seen[0]}, "
      f"torch.is_autocast_enabled({dev.type!r}) -> {seen[1]}")
assert not grad_row["fast path taken"]
assert seen[1]
cuda = device.target("cuda")
with device.autocast(cuda, torch.bfloat16):
    cuda_seen = torch.is_autocast_enabled()
print(f"under {device.label('cuda', cuda.how)} autocast: torch.is_autocast_enabled() -> "
      f"{cuda_seen}")
assert cuda_seen
if dev.type == "cuda":
    assert seen[0] and not no_grad_row["fast path taken"]
else:
    assert not seen[0] and no_grad_row["fast path taken"]
    assert no_grad_row["output"] == torch.bfloat16 and grad_row["output"] == torch.float32
    assert no_grad_row["mean error"] > grad_row["mean error"]

# %%
# The errors of the two paths against the float32 output, on a log axis: what the fast path
# under autocast gives up on this device.
from mpguide import plots

errors = {
    f"grad {r['grad']}:\n{'fast path' if r['fast path taken'] else 'unfused layers'}, "
    f"{str(r['output']).removeprefix('torch.')} output": {
        "max error": r["max error"],
        "mean error": r["mean error"],
    }
    for r in (no_grad_row, grad_row)
}
fig = plots.bars(errors, xlabel="|error| against the float32 encoder (log scale)", log=True)
assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == list(errors)

# %%
# What we saw
# -----------
# - Outputs of ``inference_mode`` are inference tensors: an in-place update outside the mode
#   and their use in a backward pass raise; ``no_grad`` outputs allow both (asserted). The
#   latency verdict printed above holds only beyond the measurement spread.
# - On the CPU, this torch takes ``TransformerEncoder``'s fused fast path under autocast
#   (its check reads CUDA's autocast state only): the output is bf16 and further from fp32
#   than the unfused path's float32 output. On CUDA, autocast turns the fast path off (live on
#   a GPU build; elsewhere the switch it reads is simulated).
#
# .. admonition:: References
#
#    :torchapi:`torch.inference_mode`, :torchapi:`torch.no_grad`,
#    :torchdoc:`notes/autograd.html#inference-mode`, :torchapi:`torch.nn.TransformerEncoder`,
#    :torchapi:`torch.is_autocast_enabled`, :torchapi:`torch.autocast`

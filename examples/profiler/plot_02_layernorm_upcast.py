"""
What a LayerNorm's upcast costs
===============================

Normalisation layers are where bf16 activations go back to float32: CUDA autocast runs
``layer_norm`` in float32 (checked below, live on a GPU, simulated from this build's dispatch
rules elsewhere), and many model implementations compute their norms in float32
by hand. How much does that upcast cost next to the norm itself? We profile a LayerNorm on
a bf16 activation under autocast on this build's device, find the upcast with the cast
report, and set its time against the norm's own time: kernel time on a GPU, op time on a
CPU. The casts are asserted to be present; their cost is measured, not assumed.
"""

# %%
# Setup
# -----
# Everything below runs on the device :func:`mpguide.core.device.pick` chooses: CUDA when present,
# else the CPU.
import torch

from mpguide.core import device, versions

dev = device.pick()
device.describe(dev)

# %%
# LayerNorm under autocast
# ------------------------
# A float32 LayerNorm applied to a bf16 activation, inside autocast, profiled over five
# steps so that one slow step does not decide the figures.
from mpguide.traces import casts
from mpguide.traces.profiling import profile_fn

gen = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(512, 1024, device=dev, generator=gen).to(torch.bfloat16)
norm = torch.nn.LayerNorm(1024, device=dev)


def autocast_norm():
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        return norm(x)


out_dtype = autocast_norm().dtype
tree = profile_fn(autocast_norm, active=5).tree()
report = casts.report(tree)
print(f"LayerNorm on a bf16 input under {dev.type} autocast returns {out_dtype}")
print(tree.render(tree.find("aten::layer_norm")[0], fields=["Input type"], depth=2))

# %%
# On CUDA, autocast runs ``layer_norm`` in float32: the bf16 input is cast up inside the
# ``aten::layer_norm`` call, and the output is float32 (in the profile, live on a GPU build;
# on every build, simulated from this build's dispatch rules below). CPU autocast leaves
# ``layer_norm`` alone: it runs on the bf16 input and returns bf16, with no cast. The
# assertions pin down what this build saw.
autocast_upcasts = [c for c in report if c.cause == "aten::layer_norm"]
if dev.type == "cuda":
    assert out_dtype == torch.float32
    assert autocast_upcasts
    assert all((c.source, c.target) == ("bfloat16", "float32") for c in autocast_upcasts)
else:
    assert out_dtype == torch.bfloat16
    assert not autocast_upcasts and len(report) == 0

from mpguide.autocast import policy

cuda = device.target("cuda")
on_cuda = policy.observe(
    lambda d: torch.nn.functional.layer_norm(torch.randn(8, 64, device=d).bfloat16(), (64,)), cuda
)
print(f"layer_norm on a bf16 input under {device.label('cuda', cuda.how)} autocast: "
      f"returns {on_cuda.out}, casts {on_cuda.casts}")
assert on_cuda.out == torch.float32 and (torch.bfloat16, torch.float32) in on_cuda.casts

# %%
# A LayerNorm computed in float32 by hand
# ---------------------------------------
# Model code often does the upcast itself, whatever the device: cast the input to float32,
# normalise, cast back. A :func:`torch.profiler.record_function` range names the module, so
# the cast report names it as the cause.
import torch.nn.functional as F


def fp32_norm():
    with torch.profiler.record_function("FP32LayerNorm"):
        return F.layer_norm(x.float(), (1024,), norm.weight, norm.bias).to(x.dtype)


assert fp32_norm().dtype == torch.bfloat16
manual = profile_fn(fp32_norm, active=5).tree()
manual_report = casts.report(manual)
manual_report.summary("pair")

# %%
# Each step has one up-cast (bf16 to float32) and one down-cast back, both caused by the
# ``FP32LayerNorm`` range.
ups = [c for c in manual_report if c.direction == "up-cast"]
downs = [c for c in manual_report if c.direction == "down-cast"]
assert len(ups) == len(downs) == 5
assert {c.cause for c in manual_report} == {"FP32LayerNorm"}
assert all(c.shape == (512, 1024) and c.bytes_written == 512 * 1024 * 4 for c in ups)

# %%
# One of the five steps as an icicle chart, each op from its start to its end under its
# caller: the two casts (orange) sit on either side of the norm, and their widths are this
# machine's times.
from mpguide import plots

first_norm = manual.find("FP32LayerNorm")[0]
fig = plots.icicle(first_norm, manual_report, title=f"one FP32LayerNorm call on {dev.type}")
in_call = {str(n.id) for n in first_norm.walk()}
orange = {c.id for c in manual_report if str(c.id) in in_call}
assert len(orange) == 2

# %%
# The cost of the upcast against the norm
# ---------------------------------------
# :func:`mpguide.traces.cast_cost.norm_upcasts` profiles both norms the same way, under
# autocast and in float32 by hand, and sets the casts against the norm's own time (the norm op
# without the casts inside it): kernel time on a GPU, op time on the CPU, medians over five
# steps. Live here, beside the recordings made on GPU machines by ``nox -s record``.
from mpguide.core import record
from mpguide.traces import cast_cost

norm_costs = cast_cost.norm_upcasts(dev)
rows = {(r[0], r[1]): r for r in norm_costs.rows}
assert list(rows) == [
    ("LayerNorm", "autocast"), ("LayerNorm", "float32 by hand"),
    ("RMSNorm", "autocast"), ("RMSNorm", "float32 by hand"),
]
for norm in ("LayerNorm", "RMSNorm"):
    by_hand = rows[norm, "float32 by hand"]
    assert by_hand[3] == 2 and by_hand[4] > 0 and by_hand[5] > 0 and by_hand[6] > 0
if dev.type == "cuda":  # autocast casts LayerNorm's input up inside the call, and only that
    auto = rows["LayerNorm", "autocast"]
    assert auto[2] == "f32" and auto[3] == 1 and auto[4] > 0 and auto[5] > 0
record.beside("profiler.norm_upcasts", norm_costs, machine=device.describe(dev))

# %%
# What a cast costs against a plain copy of the same source: ``tensor.to(dtype)`` and
# ``clone()`` timed in the same rounds (:func:`mpguide.traces.cast_cost.cast_bandwidth`). A cast
# is a copy that converts on the way; where it runs near the copy's bandwidth, its cost is the
# bytes it moves.
bandwidth = cast_cost.cast_bandwidth(dev)
assert all(r[2] == r[1] * 6 for r in bandwidth.rows if r[0] in ("f32 -> bf16", "bf16 -> f32"))
record.beside("profiler.cast_bandwidth", bandwidth, machine=device.describe(dev))

# %%
# The times above are measured, not asserted: on a shared machine they vary from run to run.
# What is asserted is the traffic the trace records. The float32 norm reads its float32 input
# and writes a float32 output; the two casts around it read and write the activation twice
# more, which is 1.5 times the norm's own traffic.
per_step_casts = ups[0].bytes_read + ups[0].bytes_written + downs[0].bytes_read + (
    downs[0].bytes_written
)
norm_traffic = 2 * 512 * 1024 * 4  # float32 in, float32 out
print(f"casts move {per_step_casts / 2**20:.1f} MiB per step, the norm "
      f"{norm_traffic / 2**20:.1f} MiB: {per_step_casts / norm_traffic:.2f} x")
assert ups[0].bytes_read == downs[0].bytes_written == 512 * 1024 * 2
assert per_step_casts == 1.5 * norm_traffic

# %%
# RMSNorm beside LayerNorm, eager and compiled
# --------------------------------------------
# A float32 ``nn.RMSNorm`` on the same bf16 activation under autocast, profiled eagerly and
# compiled with inductor (profiled live on this build's device). Eagerly, CUDA autocast casts
# the input up (``rms_norm`` is on its float32 list since torch 2.12); on the CPU, where autocast
# leaves ``rms_norm`` alone (and on CUDA before 2.12), the mixed dtypes keep the fused kernel out
# and the composite form casts the input up and the result back down (with a warning, silenced
# here, that says so). Compiled, the casts are fused into inductor's kernel
# and no cast op is left in the trace. The counts keep tensor casts only: the report also finds
# 0-dim conversions of Python scalars inside ``mean`` and ``add_``.
import warnings

rms = torch.nn.RMSNorm(1024, device=dev)


def autocast_rms():
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        return rms(x)


def quiet(fn):
    def call():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Mismatch dtype between input and weight")
            return fn()

    return call


compiled_rms = torch.compile(autocast_rms)
quiet(compiled_rms)()
per_step = {}
for name, fn in (("eager", autocast_rms), ("inductor", compiled_rms)):
    found = [c for c in casts.report(profile_fn(quiet(fn), active=5).tree()) if c.shape]
    pairs = sorted({(c.source, c.target) for c in found})
    per_step[name] = [(*p, sum((c.source, c.target) == p for c in found) // 5) for p in pairs]
    print(f"RMSNorm under autocast, {name}: tensor casts per step (source, target, count): "
          f"{per_step[name]}")
rms_rule = versions.change("rms_norm_cuda_autocast")
print(rms_rule.describe())
if dev.type == "cuda" and rms_rule.holds:
    assert per_step["eager"] == [("bfloat16", "float32", 1)]
else:
    assert per_step["eager"] == [("bfloat16", "float32", 1), ("float32", "bfloat16", 1)]
assert per_step["inductor"] == []

# %%
# What we saw
# -----------
# - Under autocast, LayerNorm on a bf16 input returns the dtype printed above: float32 with
#   an upcast inside ``aten::layer_norm`` on CUDA (live on a GPU, simulated elsewhere), bf16
#   with no cast on the CPU.
# - A norm computed in float32 by hand costs one up-cast and one down-cast per call; the
#   cast report finds both and names the module.
# - A float32 RMSNorm on a bf16 activation casts per step as printed above when run eagerly,
#   and not at all as an op once compiled: inductor fuses the conversions into its kernel.
# - The two casts move 1.5 times the bytes the float32 norm itself reads and writes; the times
#   printed above are this machine's, measured in this build and not asserted.
#
# .. admonition:: References
#
#    :torchapi:`torch.nn.LayerNorm`, :torchapi:`torch.autocast`,
#    :torchapi:`torch.profiler.record_function`, :torchdoc:`amp.html#autocast-op-reference`

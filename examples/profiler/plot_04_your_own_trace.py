"""
Reading your own trace
======================

How do you find the casts in your own model? Profile a few steps of it, write the chrome
trace, and read it with ``python -m mpguide tree`` and ``python -m mpguide casts``, or with
:mod:`mpguide.traces.trace` in Python. We do it here for a small model and show each command with
the output it gave on this build's machine. Traces written by :func:`torch.profiler.profile`
directly work the same way, from CPU, CUDA or ROCm machines, as ``.json`` or ``.json.gz``.
"""

# %%
# Setup
# -----
# Everything below runs on the device :func:`mpguide.core.device.pick` chooses: CUDA when present,
# else the CPU.
import torch

from mpguide.core import device

dev = device.pick()
device.describe(dev)

# %%
# Profile your model with mpguide
# -------------------------------
# Give :func:`mpguide.traces.profiling.profile_fn` a callable that runs one step, and a path: it
# waits one step, warms up one, records the next, and writes the trace there (gzipped for a
# ``.gz`` name).
import tempfile
from pathlib import Path

from mpguide.traces.profiling import profile_fn

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512), torch.nn.Linear(512, 64)
).to(dev)
batch = torch.randn(32, 256, device=dev)


def step():
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        model(batch).float().sum().backward()


workdir = Path(tempfile.mkdtemp())
path = workdir / "my_model.json.gz"
recorded = profile_fn(step, path=path)
print(f"wrote {path.name}: {path.stat().st_size / 1024:.1f} KiB, {len(recorded.events)} events")

# %%
# What is in it, as an icicle chart
# ---------------------------------
# The recorded step read back from the file: each op a rectangle under its caller, in call
# order, the forward pass first and the backward pass after it; the width of an op is the
# number of ops without children below it, so the shape does not depend on this machine's
# timings. The casts found by :func:`mpguide.traces.casts.report` are orange, with the ops they ran.
from mpguide import plots
from mpguide.traces import casts, trace

mine = trace.load(path).tree()
mine_casts = casts.report(mine)
(profiled_step,) = mine.steps()
fig = plots.icicle(profiled_step, mine_casts, scale="ops",
                   title=f"one autocast training step of the model on {dev.type}")
drawn = {p.get_gid() for p in fig.axes[0].patches}
in_step = {str(n.id) for n in profiled_step.walk()}
assert {str(c.id) for c in mine_casts} & in_step <= drawn
print(f"{len(drawn)} ops drawn, {len({str(c.id) for c in mine_casts} & drawn)} of them casts")

# %%
# The chart is the step's call tree: the ops called inside ``ProfilerStep#N`` on the thread
# that ran it. Autograd runs the backward pass of CPU tensors on the calling thread, so on the
# CPU every cast is in the chart; for CUDA tensors it runs on its own device thread, so on a GPU
# the backward pass's casts sit under another thread's root, and the cast report still finds
# them (the recorded H100 trace below shows it).
step_tid = profiled_step.event.tid
elsewhere = [c for c in mine_casts if str(c.id) not in in_step]
threads = {mine.node(c.id).event.tid for c in elsewhere}
print(f"{len(elsewhere)} casts outside the step's call tree, on threads "
      f"{sorted(threads)} (the step ran on thread {step_tid})")
assert step_tid not in threads
if dev.type == "cpu":
    assert not elsewhere

# %%
# Recorded on a GPU: the same count on mpguide's own H100 trace of one bf16-autocast training
# step (another model, an ``nn.TransformerEncoder``; its size, the torch release and the
# machine are in ``tests/data/gpu/PROVENANCE.md``), read here:
try:
    HERE = Path(__file__).resolve().parent
except NameError:  # run cell by cell
    HERE = Path.cwd()
H100_TRACE = HERE.parents[1] / "tests" / "data" / "gpu" / "h100_mpguide_bf16_train_step.json.gz"
h100 = trace.load(H100_TRACE)
h100_tree = h100.tree()
h100_casts = casts.report(h100_tree)
(h100_step,) = h100_tree.steps()
h100_in_step = {str(n.id) for n in h100_step.walk()}
h100_elsewhere = [c for c in h100_casts if str(c.id) not in h100_in_step]
h100_threads = sorted({h100_tree.node(c.id).event.tid for c in h100_elsewhere})
print(f"recorded ({H100_TRACE.name}): {len(h100_elsewhere)} of {len(h100_casts)} casts outside the "
      f"step's call tree, on threads {h100_threads} (the step ran on thread "
      f"{h100_step.event.tid})")
assert h100_elsewhere and h100_step.event.tid not in h100_threads

# %%
# Or with torch.profiler itself
# -----------------------------
# A trace from your own profiling code is read the same way. Record shapes: the dtypes and
# shapes of the tree and of the cast report come from them.
from torch.profiler import ProfilerActivity, profile

acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
with profile(activities=acts, record_shapes=True) as prof:
    step()
own = workdir / "plain_profiler.json"
prof.export_chrome_trace(str(own))
plain = casts.report(trace.load(own).tree())
assert {(c.cause, c.source, c.target) for c in plain} >= {("aten::linear", "float32", "bfloat16")}
print(f"{len(plain)} casts in {own.name}")

# %%
# The call tree on the command line
# ---------------------------------
# ``tree`` prints each thread's call tree; ``--op`` picks the subtrees of one op, ``--fields``
# the profiler args shown, ``--depth`` how deep to go. The last line counts the anomalies
# met while nesting (overlapping or touching events, shared correlation ids, ...).
import contextlib
import io
import re
import shlex

from mpguide.cli import main


def mpguide(command: str) -> str:
    """Run ``python -m mpguide COMMAND`` in this process and show what it prints, with paths
    relative to the directory of the traces."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(shlex.split(command))
    print(f"$ python -m mpguide {command}\n{out.getvalue()}".replace(f"{workdir}/", ""))
    assert status == 0
    return out.getvalue()


shown = mpguide(f'tree {path} --op aten::linear --fields "Input Dims,Input type" --depth 1')
# each node: its name, its duration, then the fields asked for
assert re.search(r"aten::linear  [\d.]+ [µm]?s  Input Dims: \[\[32, 256\], \[512, 256\], \[512\]\]", shown)

# %%
# The cast report on the command line
# -----------------------------------
# ``casts`` prints a summary by cause (the default), ``--by module``, ``pair``, ``direction``
# or ``pass``, one row per cast (``--by cast``), or the casts fused into kernels
# (``--by fused``); ``--format`` is ``text``, ``json`` or ``csv`` (``markdown`` too).
shown = mpguide(f"casts {path} --by cause")
assert "aten::linear" in shown

# %%
import json

rows = json.loads(mpguide(f"casts {path} --by pair --format json"))["rows"]
assert {(r["source"], r["target"]) for r in rows} >= {("float32", "bfloat16"),
                                                      ("bfloat16", "float32")}

# %%
# A bad file gives one line naming the problem, and exit status 2:
broken = workdir / "broken.json"
broken.write_bytes(path.read_bytes()[:100])
err = io.StringIO()
with contextlib.redirect_stderr(err):
    assert main(["casts", str(broken)]) == 2
print(err.getvalue().replace(str(workdir) + "/", ""))

# %%
import shutil

shutil.rmtree(workdir)

# %%
# What we saw
# -----------
# - ``profile_fn(step, path=...)`` writes a trace that ``python -m mpguide tree`` and
#   ``casts`` read; so does ``export_chrome_trace`` from your own profiling code.
# - The commands print the call tree with the dtypes and shapes the profiler recorded, and
#   the casts with their cause, as a table, JSON or CSV.
#
# .. admonition:: References
#
#    :torchapi:`torch.profiler.profile`, :torchdoc:`profiler.html`,
#    :torchdoc:`amp.html`

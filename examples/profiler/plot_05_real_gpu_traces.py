"""
Casts on recorded GPU runs
==========================

What do casts cost on real GPU runs, and who asks for them? We read traces recorded
elsewhere, on an H100, an MI300X, a B200 and an A100, from the MIT-licensed test data of
AMD's TraceLens and Meta's HolisticTraceAnalysis, with the cast report. The same bf16 model on
the H100 and the MI300X casts in two modules only, named with their source line, and spends a
few percent of its kernel time there; compiled and vendor kernels hide further casts, which
the report lists apart with their kernel time.
"""

# %%
# Setup
# -----
# The traces were recorded on other machines; this machine only reads them, so what follows
# is the same on a CPU and on a GPU.
from mpguide.core import device

dev = device.pick()
device.describe(dev)

# %%
# The recorded traces
# -------------------
# Each file comes from a project's test data; ``tests/data/gpu/PROVENANCE.md`` names the
# repository, path, commit and licence of each, and how the two cut files were cut to a
# window of whole events. The GPU is the one each trace names.
import gzip
from pathlib import Path

import msgspec

from mpguide.core.table import Table


class _Header(msgspec.Struct):
    deviceProperties: list[dict] = []


def recorded_on(path: Path) -> str:
    """The GPU a trace names in its ``deviceProperties``."""
    with gzip.open(path) as f:
        props = msgspec.json.decode(f.read(), type=_Header).deviceProperties
    first = props[0] if props else {}
    name = first.get("name") or "name not recorded"
    return f"{name} (compute {first.get('computeMajor')}.{first.get('computeMinor')})"


try:
    HERE = Path(__file__).resolve().parent
except NameError:  # run cell by cell
    HERE = Path.cwd()
GPU = HERE.parents[1] / "tests" / "data" / "gpu"
SOURCES = {
    "h100_qwen1.5-0.5b_bf16_inference.json.gz": ("TraceLens (AMD), MIT", "bf16 Qwen1.5-0.5B"),
    "mi300x_qwen1.5-0.5b_bf16_inference.json.gz": ("TraceLens (AMD), MIT", "bf16 Qwen1.5-0.5B"),
    "mi300x_vllm_decode_graph.json.gz": ("TraceLens (AMD), MIT", "vLLM decode, graph replay"),
    "b200_vllm_gpt-oss_eager_window.json.gz": ("TraceLens (AMD), MIT", "vLLM GPT-OSS, eager"),
    "a100_torchrec_train_step.json.gz": ("HolisticTraceAnalysis (Meta), MIT", "DDP train step"),
}
gpus = {name: recorded_on(GPU / name) for name in SOURCES}
Table(
    ("file", "recorded on", "what ran", "from"),
    tuple((name, gpus[name], what, src) for name, (src, what) in SOURCES.items()),
    caption="Traces recorded elsewhere, read here (tests/data/gpu/PROVENANCE.md)",
)

# %%
# bf16 inference on an H100: who casts
# ------------------------------------
# The trace was recorded with ``with_stack=True`` and ``with_modules=True``, so the cast
# report names, for each cast, the innermost ``nn.Module`` and the Python function with its
# line (the line the profiler records: where that function starts).
from mpguide.traces import casts, trace


def read(name: str):
    tree = trace.load(GPU / name, args_of=casts.needs_args).tree(python=True)
    return tree, casts.report(tree)


h100_tree, h100 = read("h100_qwen1.5-0.5b_bf16_inference.json.gz")
h100.summary("cause")

# %%
# Every cast comes from two modules: each RMSNorm casts its bf16 input up to float32 and
# the result back down, and the rotary embedding casts its cos and sin tables. Nothing else
# in the forward pass converts a dtype.
modules = {r["module"]: r["casts"] for r in h100.summary("module").records()}
assert modules == {"Qwen2RMSNorm": 98, "Qwen2RotaryEmbedding": 3}
norm = [c for c in h100 if c.module == "Qwen2RMSNorm"]
assert {(c.source, c.target) for c in norm} == {("bfloat16", "float32"), ("float32", "bfloat16")}
assert all(c.cause.startswith("Qwen2RMSNorm (transformers/models/qwen2/modeling_qwen2.py:")
           for c in norm)
print(f"{len(norm)} RMSNorm casts of {norm[0].shape} activations, caused by {norm[0].cause}")

# %%
# What they cost
# --------------
# The step is the ``ProfilerStep#N`` range; its kernel time is the time of the kernels
# launched during it, by any of the process's threads (in a training step, autograd's thread
# launches the backward pass's kernels outside the step's node; in this inference step the
# main thread launches them all, under the node). The casts' share is their kernel time over
# it, and their effective bandwidth the bytes they read and wrote over their kernel time.
import math

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def launched_during(tree, step) -> float:
    """Time of the GPU work whose launch began during ``step``, on any thread."""
    end = step.start + step.dur
    return sum(
        n.dur
        for n in tree.find(predicate=lambda n: n.cat in GPU_WORK and n.parent is not None)
        if step.start <= n.parent.start < end
    )


def cost(tree, report, label: str) -> dict:
    (step,) = tree.steps()
    moved = sum(c.bytes_read + c.bytes_written for c in report)
    gpu_us, step_us, share = report.share_of_steps(gpu=True)
    assert math.isclose(step_us, launched_during(tree, step), rel_tol=1e-9)
    assert math.isclose(step_us, step.gpu_time, rel_tol=1e-9)  # one thread launched all
    return {
        "recorded on": label,
        "casts": len(report),
        "cast kernel us": round(gpu_us, 1),
        "step kernel us": round(step_us, 1),
        "share": share,
        "GB/s": moved / gpu_us / 1e3,
        "fused us": round(report.fused.total_us, 1),
    }


mi300_tree, mi300 = read("mi300x_qwen1.5-0.5b_bf16_inference.json.gz")
costs = [
    cost(h100_tree, h100, gpus["h100_qwen1.5-0.5b_bf16_inference.json.gz"]),
    cost(mi300_tree, mi300, gpus["mi300x_qwen1.5-0.5b_bf16_inference.json.gz"]),
]
Table(
    tuple(costs[0]),
    tuple(tuple(round(v, 4) if isinstance(v, float) else v for v in c.values()) for c in costs),
    caption="The same bf16 model and batch, recorded on two GPUs: cast kernel time and share "
    "of the step's kernel time (recorded elsewhere; TraceLens test data, MIT)",
)

# %%
# The MI300X run casts the same tensors, from the same modules, in the same dtypes: the casts
# are the model's, not the GPU's. What differs is their time. On both the casts take under a
# tenth of the step's kernel time; the fused column is ATen's bf16 copy kernels whose launch
# ran before the recorded step (the report lists them apart, with their kernel time).


def what(report):
    return sorted((c.cause, c.source, c.target, c.shape) for c in report)


assert what(h100) == what(mi300)
for c in costs:
    assert 0 < c["share"] < 0.1, c
    print(f"{c['recorded on']}: {c['casts']} casts, {c['cast kernel us']:.0f} us of "
          f"{c['step kernel us']:.0f} us kernel time ({c['share']:.1%}), {c['GB/s']:.0f} GB/s")

# %%
# Casts fused into kernels
# ------------------------
# Compiled and vendor kernels convert dtypes inside their own work, where no ``aten::to``
# shows it. A vLLM decode step replayed as a graph on an MI300X runs inductor's
# ``triton_poi_fused__to_copy_1`` kernels; vLLM's eager GPT-OSS on a B200 runs an RMSNorm
# kernel built on ``vllm::_typeConvert`` and kernels that quantize to fp8 and fp4. Their
# dtypes are not in the trace, and their time is the whole kernel's, not only the conversion's.
graph_tree, graph = read("mi300x_vllm_decode_graph.json.gz")
graph.fused

# %%
b200_tree, b200 = read("b200_vllm_gpt-oss_eager_window.json.gz")
b200.fused


# %%
# Against all the kernel time in each trace:
def kernel_us(tree) -> float:
    return sum(n.dur for n in tree.find(predicate=lambda n: n.cat == "kernel"))


for label, tree, report in (("MI300X graph", graph_tree, graph), ("B200 eager", b200_tree, b200)):
    total = kernel_us(tree)
    kinds = sorted(set(report.fused.table().column("kind")))
    assert 0 < report.fused.total_us < total
    print(f"{label}: {len(report.fused)} fused cast kernels ({', '.join(kinds)}), "
          f"{report.fused.total_us:.0f} us of {total:.0f} us kernel time "
          f"({report.fused.total_us / total:.1%}); ATen casts: {len(report)}")
assert set(graph.fused.table().column("kind")) == {"compiled"}
assert set(b200.fused.table().column("kind")) == {"vendor", "quantize"}

# %%
# Cast time by module and fused kind
# ----------------------------------
# Kernel time of the casts, per module, and of the fused casts per kind, for each recorded
# run (log scale).
from mpguide import plots

fig = plots.cast_time_by_module(
    {"H100 Qwen bf16": h100, "MI300X Qwen bf16": mi300, "MI300X vLLM graph": graph,
     "B200 vLLM eager": b200},
    title="Cast kernel time on recorded GPU runs (recorded elsewhere; TraceLens test data, MIT)",
)
assert [t.get_text() for t in fig.axes[0].get_yticklabels()][:2] == [
    "Qwen2RMSNorm", "Qwen2RotaryEmbedding"]

# %%
# A training step on an A100
# --------------------------
# This DDP step was recorded without the Python stack, so the causes are the enclosing ops
# and ranges; its timestamps are whole microseconds since the epoch, which the call tree
# converts to nanoseconds exactly, so no cast lands in an op it does not belong to and each
# cause's own time (``cause cpu us``) stays positive. Its one 0-d cast folds into a row of its
# own, sorted with the others by CPU time.
step_tree, step = read("a100_torchrec_train_step.json.gz")
assert step_tree.anomalies.overlaps == 0
summary = step.summary("cause", scalars=False)
rows = [r for r in summary.records() if r["cause"] != casts.FOLDED]
(folded,) = [r for r in summary.records() if r["cause"] == casts.FOLDED]
assert all(r["cause cpu us"] >= 0 for r in rows) and folded["casts"] == 1
cpu = summary.column("cpu us")
assert cpu == sorted(cpu, reverse=True)
summary

# %%
# Its GPU share counts the kernels launched during the step by every thread: autograd's
# thread launches the DDP step's backward pass, its communication included, outside the
# thread that holds the step's range (every such kernel's launch is inside an
# ``autograd::engine::evaluate_function`` node, checked below).
(a100_step,) = step_tree.steps()
_, a100_step_us, a100_share = step.share_of_steps(gpu=True)
assert math.isclose(a100_step_us, launched_during(step_tree, a100_step), rel_tol=1e-9)
assert a100_step.gpu_time < a100_step_us
main_tid = step_tree.trace.tid.value(a100_step.id)
others = step_tree.find(
    predicate=lambda n: n.cat in GPU_WORK and n.parent is not None
    and step_tree.trace.tid.value(n.parent.id) != main_tid
)
assert others and all(
    any(a.name.startswith(casts.BACKWARD_MARK) for a in k.ancestors()) for k in others
)
print(f"A100 step: {a100_step_us:,.0f} us of kernels launched during it, "
      f"{a100_step.gpu_time:,.0f} us of them under its node; casts: {a100_share:.2%}")

# %%
# What we saw
# -----------
# - The bf16 Qwen model recorded on an H100 and on an MI300X casts only in
#   ``Qwen2RMSNorm`` and ``Qwen2RotaryEmbedding``: the same tensors on both GPUs, named with
#   their module and source line because the traces carry the Python stack.
# - Those casts took under a tenth of each step's kernel time on both GPUs (the shares are
#   printed above); their time is what those runs recorded, not measured here.
# - Compiled (inductor) and vendor kernels convert and quantize inside their own work: the
#   report lists them apart, with their whole kernel time, since the trace gives neither
#   their dtypes nor the conversion's part.
#
# .. admonition:: References
#
#    :torchapi:`torch.profiler.profile`, :torchdoc:`profiler.html`,
#    :torchapi:`torch.autograd.graph.Node`, :torchdoc:`amp.html`

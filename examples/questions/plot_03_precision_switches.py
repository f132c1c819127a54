"""
Precision switches: readers' questions
======================================

Five questions about the switches that decide how float32 and low-precision matmuls are
computed: the TF32 flags old and new, the error torch raises when they are mixed, what the
switches change on a CPU, the reduced-precision reduction flags and the SDPA math backend's
upcast. Each is answered by setting the switch here, reading back what torch stored, and
running the computation with it on and off. The answers on this torch: every legacy call
writes into the ``fp32_precision`` tree and warns no more; reading a legacy value after a new
one raises; on this CPU the matmul switches change no result; the reduction flags default to
allowing reduced precision; and the SDPA math backend computes bf16 in float32 unless allowed
not to.
"""

# %%
# Setup
# -----
import torch

from mpguide.core import device, state, switches
from mpguide.core.table import Table

dev = device.pick()
device.describe(dev)

# %%
# allow_tf32 or fp32_precision: which one do I set?
# -------------------------------------------------
# Asked in `pytorch#158209 <https://github.com/pytorch/pytorch/pull/158209>`__,
# `transformers#45856 <https://github.com/huggingface/transformers/pull/45856>`__,
# `helion#592 <https://github.com/pytorch/helion/pull/592>`__,
# `helion#413 <https://github.com/pytorch/helion/pull/413>`__,
# `helion#835 <https://github.com/pytorch/helion/pull/835>`__ and
# `Lightning#21256 <https://github.com/Lightning-AI/pytorch-lightning/issues/21256>`__
# ("``torch.set_float32_matmul_precision`` deprecation"), all after torch 2.9 printed
# ``UserWarning: Please use the new API settings to control TF32 behavior, such as
# torch.backends.cudnn.conv.fp32_precision = 'tf32' or torch.backends.cuda.matmul.fp32_precision
# = 'ieee'``. What each spelling writes on this torch, and the warnings it raises:
calls = switches.changes([
    ("cuda.matmul.allow_tf32", True),
    ("cudnn.allow_tf32", False),
    (switches.MATMUL_PRECISION, "high"),
    ("cuda.matmul.fp32_precision", "tf32"),
])
calls.writes()

# %%
legacy_flag = calls["torch.backends.cuda.matmul.allow_tf32 = True"]
legacy_precision = calls["torch.set_float32_matmul_precision('high')"]
new = calls["torch.backends.cuda.matmul.fp32_precision = 'tf32'"]
assert legacy_flag.wrote("cuda.matmul.fp32_precision") == new.wrote("cuda.matmul.fp32_precision")
assert legacy_precision.wrote("cuda.matmul.fp32_precision") == "tf32"
assert legacy_precision.wrote("mkldnn.matmul.fp32_precision") == "tf32"
assert not any(c.warnings for c in calls.items)
print(f"on torch {torch.__version__}: the legacy calls write into the fp32_precision tree and "
      "raise no warning (the deprecation warning of 2.9 is gone)")

# %%
# Since 2.9 the state is one tree, ``torch.backends.fp32_precision`` with a child per backend and
# op (``cuda.matmul``, ``cudnn.conv``, ``mkldnn.matmul``, ...), each ``"ieee"``, ``"tf32"`` (or
# ``"bf16"`` on oneDNN) or ``"none"`` (inherit). The legacy flags are views on it (the writes
# above are read live): ``allow_tf32`` writes ``cuda.matmul``,
# ``set_float32_matmul_precision('high')`` writes the CUDA and the oneDNN matmul, so it also
# concerns CPUs with oneDNN. Set the tree directly in new code, and only the tree (next answer).
# The whole tree, call by call: :ref:`sphx_glr_docs_auto_examples_numerics_plot_04_switches.py`.

# %%
# Why does reading allow_tf32 raise after I set fp32_precision?
# -------------------------------------------------------------
# Asked in `pytorch#194680 <https://github.com/pytorch/pytorch/pull/194680>`__:
# ``RuntimeError: PyTorch is checking whether allow_tf32_new is enabled for cuBlas
# matmul,Current status indicate that you have used mix of the legacy and new APIs to set
# the TF32 status for cublas matmul.`` Set the root of the new tree, then read the legacy
# getters, as library code that saves and restores them does:
from mpguide import error_line

reads = {}
with state.preserved():
    torch.backends.fp32_precision = "tf32"
    for name, read in (
        ("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision),
        ("torch.backends.cuda.matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
    ):
        try:
            reads[name] = read()
        except RuntimeError as err:
            reads[name] = error_line(err)
reads

# %%
assert all(str(v).startswith("RuntimeError") and "mix of the legacy and new APIs" in str(v)
           for v in reads.values())
print(f"on torch {torch.__version__}: both legacy getters raise once the new tree disagrees "
      "with what they can express")

# %%
# A legacy getter answers with one boolean or one string, computed from the tree; when the
# tree's children disagree (the root says ``tf32``, the matmul child was never set), torch
# refuses to guess and raises. The fix: read and restore the tree itself
# (``torch.backends.cuda.matmul.fp32_precision``), never a legacy getter, in code that may
# run after someone set the new API; :func:`mpguide.core.state.preserved` does that here.

# %%
# Does set_float32_matmul_precision change results on the CPU?
# ------------------------------------------------------------
# Asked in `Lightning#21256 <https://github.com/Lightning-AI/pytorch-lightning/issues/21256>`__
# ("naively testing ``torch.set_float32_matmul_precision('high')`` in my REPL didn't seem to
# throw any errors"). We run a float32 matmul and a convolution with each setting and compare
# with plain IEEE float32, bit for bit:
effects = [switches.effect({switches.MATMUL_PRECISION: p}, dev) for p in ("high", "medium")]
for e in effects:
    print(e)

# %%
assert all(e.reproducible for e in effects)
if dev.type == "cpu":
    print(f"on torch {torch.__version__}, this CPU: "
          + "; ".join("changed " + ", ".join(e.changed) if e.changed else "no change" for e in effects))

# %%
# On CUDA hardware ``'high'`` lets cuBLAS use TF32 tensor cores for float32 matmuls (a 10-bit
# significand per product; not checked on a CPU build). On a CPU it sets oneDNN's matmul to TF32
# or bf16, which only changes results on processors with those instructions (AMX); the probe
# above says which held on the machine that built this page. The errors of each mode, measured:
# :ref:`sphx_glr_docs_auto_examples_numerics_plot_02_tf32_errors.py`.

# %%
# Are bf16 and fp16 matmuls reduced in reduced precision by default?
# ------------------------------------------------------------------
# Asked in `pytorch#116870 <https://github.com/pytorch/pytorch/issues/116870>`__ ("FP16
# default accumulation type differs between TensorIterator vs. torch.mm"),
# `#188998 <https://github.com/pytorch/pytorch/pull/188998>`__ (bf16 accumulation in inductor's
# Triton templates) and `DeepEP#176 <https://github.com/deepseek-ai/DeepEP/issues/176>`__. The
# defaults, read on this build:
flags = {name: state.get(name) for name in state.REDUCTION_SWITCHES}
flags

# %%
assert all(v is True for v in flags.values())
print(f"on torch {torch.__version__}: both reduced-precision reduction flags default to True")

# %%
# ``True`` allows cuBLAS to round partial sums of a split-K matmul to the output dtype (bf16 or
# fp16) before adding them; the products inside each split still accumulate in float32
# (ngimel in #116870: "there are only a handful of intermediate truncations"). The flags are
# read by cuBLAS only, so on a CPU they change nothing, asserted live below; what a split-K
# reduction in bf16 would add is emulated (labelled) with 4 splits of a K=4096 product:
gen = torch.Generator(device=dev).manual_seed(0)
a, b = (torch.randn(64, 4096, generator=gen, device=dev),
        torch.randn(4096, 64, generator=gen, device=dev))
ref = a.double() @ b.double()
with state.preserved():
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    off = a.bfloat16() @ b.bfloat16()
on = a.bfloat16() @ b.bfloat16()
partials = [(a[:, i:i + 1024].bfloat16().float() @ b[i:i + 1024].bfloat16().float()).bfloat16()
            for i in range(0, 4096, 1024)]
split_k = partials[0]
for p in partials[1:]:
    split_k = split_k + p  # added in bf16, as a reduced-precision reduction would
reduction = Table(
    ("bf16 matmul", "how", "max |error| vs float64"),
    (("flag True (default)", device.LIVE, (on.double() - ref).abs().max().item()),
     ("flag False", device.LIVE, (off.double() - ref).abs().max().item()),
     ("4 partial sums added in bf16", "emulated", (split_k.double() - ref).abs().max().item())),
    f"K = 4096 on {dev.type}, torch {torch.__version__}",
)
reduction

# %%
if dev.type == "cpu":
    assert torch.equal(on, off)
assert reduction.records()[2]["max |error| vs float64"] >= reduction.records()[1][
    "max |error| vs float64"]

# %%
# Does the SDPA math backend compute bf16 in fp32?
# ------------------------------------------------
# Asked in `pytorch#128922 <https://github.com/pytorch/pytorch/pull/128922>`__ and
# `#130704 <https://github.com/pytorch/pytorch/pull/130704>`__ ("we are not using higher
# precision FP32 for the intermediate accumulated/materialized parts") and the switch added in
# `#135964 <https://github.com/pytorch/pytorch/pull/135964>`__. We run the math backend on bf16
# inputs with the switch off (the default) and on, and the same attention written in bf16:
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

q, k, v = (torch.randn(2, 4, 64, 32, generator=gen, device=dev) * 3 for _ in range(3))
exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
lq, lk, lv = q.bfloat16(), k.bfloat16(), v.bfloat16()
default_allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
with sdpa_kernel(SDPBackend.MATH):
    upcast = F.scaled_dot_product_attention(lq, lk, lv)
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        low = F.scaled_dot_product_attention(lq, lk, lv)
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(default_allowed)
by_hand = torch.softmax(lq @ lk.transpose(-1, -2) / 32**0.5, -1) @ lv
math_sdp = Table(
    ("bf16 attention", "max |error| vs float64"),
    tuple((name, (o.double() - exact).abs().max().item()) for name, o in (
        ("math backend, default (upcast to float32)", upcast),
        ("math backend, allow_fp16_bf16_reduction_math_sdp(True)", low),
        ("softmax(q @ k.T) @ v written in bf16", by_hand))),
    f"64 x 64 scores, head 32, on {dev.type}, torch {torch.__version__}",
)
math_sdp

# %%
errs = [r["max |error| vs float64"] for r in math_sdp.records()]
assert default_allowed is False and errs[0] < errs[1] <= errs[2]
print(f"on torch {torch.__version__}: the math backend upcasts by default; allowing reduced "
      f"precision multiplies its error by {errs[1] / errs[0]:.1f}")

# %%
# Since 2.5 the math backend casts fp16/bf16 inputs to float32, computes the scores, softmax
# and weighted sum there, and rounds the output once; the switch brings back the old path
# with bf16 intermediates. The fused backends keep float32 accumulators too, so the math
# backend is a fair reference for them. Backends compared on this device:
# :ref:`sphx_glr_docs_auto_examples_questions_plot_04_attention.py`.

# %%
# What we saw
# -----------
# - ``allow_tf32`` and ``set_float32_matmul_precision`` write the ``fp32_precision`` tree and
#   warn no more on this torch; the legacy getters raise after the tree was set directly.
# - On this machine the matmul precision switches changed no CPU result (or did, as printed).
# - Both reduced-precision reduction flags default to ``True``; they act only in cuBLAS.
# - The SDPA math backend computes bf16 in float32 unless told otherwise.
#
# .. admonition:: References
#
#    :torchdoc:`notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices`,
#    :torchapi:`torch.set_float32_matmul_precision`, :torchdoc:`notes/numerical_accuracy.html`,
#    :torchapi:`torch.nn.functional.scaled_dot_product_attention`

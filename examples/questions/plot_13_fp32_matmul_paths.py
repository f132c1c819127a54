"""
float32 matmuls compiled and emulated: readers' questions
=========================================================

Two questions about how a float32 (or bf16) matmul is computed once it leaves eager PyTorch:
what inductor generates for it and for a reduction under each precision setting, and the
newer ways to emulate float32 with bf16 tensor-core products (bf16x3, bf16x9), with which of
them the installed torch accepts. Inductor's code is generated here and read; the emulation
schemes are computed here, product by product, against float64. The answers on this torch:
on a CPU inductor calls the same ``mm`` for every setting and accumulates a bf16 reduction in
``float``; its Triton side keeps a float32 accumulator for bf16 and asks ``tl.dot`` for TF32
only when ``fp32_precision`` is ``"tf32"``; bf16x6 and bf16x9 come out as accurate as float32
here, bf16x3 about ten times less; and the installed torch accepts none of the ``bf16x*`` spellings.
"""

# %%
# Setup
# -----
import inspect
import math

import torch

from mpguide.compiled import generated_code
from mpguide.core import device, dtypes
from mpguide.precision import split_matmul

dev = device.pick()
device.describe(dev)

# %%
# What does inductor generate for a matmul under each precision setting?
# ----------------------------------------------------------------------
# Asked in `triton#9080 <https://github.com/triton-lang/triton/pull/9080>`__ (Triton's
# default float32 dot precision changed to TF32x3), `triton#10176
# <https://github.com/triton-lang/triton/issues/10176>`__ ("When upcasting bf16 to fp32 inside
# the kernel, triton uses TF32 path despite I pass input_precision="ieee"") and
# `pytorch#188998 <https://github.com/pytorch/pytorch/pull/188998>`__ (bf16 matmuls under
# ``max-autotune`` accumulating in bf16 on Hopper). A float32 matmul and a bf16 row sum,
# compiled by inductor for this device with each value of the oneDNN matmul switch; what the
# generated module calls and accumulates in:
gen = torch.Generator(device=dev).manual_seed(0)
a, b = (torch.randn(64, 64, generator=gen, device=dev) for _ in range(2))
rows_bf16 = torch.randn(8, 1024, generator=gen, device=dev).to(torch.bfloat16)
switch = "cuda.matmul.fp32_precision" if dev.type == "cuda" else "mkldnn.matmul.fp32_precision"
values = ("ieee", "tf32") if dev.type == "cuda" else ("ieee", "tf32", "bf16")
code = generated_code.per_setting(
    {"float32 a @ b": (torch.matmul, (a, b)),
     "bf16 x.sum(-1)": (lambda x: x.sum(-1), (rows_bf16,))},
    {f"{switch} = {v!r}": {switch: v} for v in values},
    f"inductor on {dev.type} ({device.LIVE}), torch {torch.__version__}",
)
code

# %%
by_case = {}
for r in code.records():
    by_case.setdefault(r["case"], set()).add((r["calls"], r["accumulator"]))
if dev.type == "cpu":
    assert by_case["float32 a @ b"] == {("extern_kernels.mm", "none")}
    assert by_case["bf16 x.sum(-1)"] == {("none", "float")}
print(f"on torch {torch.__version__} ({dev.type}): the matmul's generated call per setting "
      f"{sorted(by_case['float32 a @ b'])}; the bf16 sum's accumulator "
      f"{sorted(by_case['bf16 x.sum(-1)'])}")

# %%
# On a CPU inductor leaves a lone matmul to ATen (``extern_kernels.mm``), whichever value the
# switch has: the switch then acts inside the library call at run time, as in eager. Its own
# C++ loops accumulate a bf16 reduction in ``float`` (``float tmp_acc0``) and round once at
# the store. On a GPU the matmul may become a Triton template instead (one of the candidates
# ``max-autotune`` times). What this build's Triton code generator
# writes, read from its source and functions (no GPU needed): the accumulator type of the mm
# templates per input dtype, and the precision a generated ``tl.dot`` asks for:
from torch._inductor.codegen.triton import TritonOverrides
from torch._inductor.kernel.mm_common import acc_type

accumulators = {dtypes.name(dt): acc_type(dt)
                for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)}
dot_rule = [line.strip() for line in inspect.getsource(TritonOverrides.dot).splitlines()
            if "fp32_precision" in line or "input_precision =" in line]
print("Triton mm template accumulator:", accumulators)
print("tl.dot precision rule:", *dot_rule, sep="\n  ")

# %%
release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
wide = {k: v for k, v in accumulators.items() if k != "float8_e4m3fn"}
assert set(wide.values()) == {"tl.float32"}
fp8_acc = accumulators["float8_e4m3fn"]
if release >= (2, 13):  # read on 2.13 and 2.14 (nox -s compat runs this page on both)
    assert fp8_acc == "tl.float32"
elif release == (2, 11):  # read on 2.11 by nox -s compat: acc_type returns fp8's own type
    assert fp8_acc == "tl.float8_e4m3fn"
assert any('== "tf32"' in line for line in dot_rule)
assert not any("dtype" in line for line in dot_rule)
print(f"on torch {torch.__version__}: the mm templates accumulate float32, bf16 and fp16 inputs "
      f"in tl.float32, and fp8 inputs in {fp8_acc}; a generated tl.dot asks for TF32 when "
      "cuda.matmul.fp32_precision is 'tf32', whatever its inputs' dtype")

# %%
# So inductor's templates keep a float32 accumulator for bf16 and fp16 inputs on every release
# this page ran on; for fp8 inputs the accumulator ``acc_type`` gives changed inside the
# supported window (an older release gives the fp8 type itself; the assertion above names the
# releases each was read on, and the line above is this build's).
# The TF32 request depends on the switch only, not on the dtype of the dot's inputs: the
# input-dtype gate that #188998 proposed is not in this build's code generator. For bf16
# inputs the TF32 request is moot (a bf16 dot has no TF32 path); what #188998 reports on
# Hopper is Triton (the release named in the issue) accumulating such a dot in bf16 when no
# ``out_dtype`` is passed, which only a GPU shows. On a GPU this page compiles a bf16 matmul
# with ``max-autotune`` and measures its error against float64; not yet recorded (the output
# below says where this build ran):
if dev.type == "cuda":
    x16, y16 = (torch.randn(512, 4096, generator=gen, device=dev).to(torch.bfloat16),
                torch.randn(4096, 512, generator=gen, device=dev).to(torch.bfloat16))
    exact = x16.double() @ y16.double()
    tuned = torch.compile(torch.matmul, mode="max-autotune-no-cudagraphs")(x16, y16)
    errs = {name: ((o.double() - exact).abs().max() / exact.abs().max()).item()
            for name, o in (("eager (cuBLAS)", x16 @ y16), ("max-autotune", tuned))}
    print(f"bf16 512 x 4096 x 512, max |error| / max |ref|: {errs}")
    assert errs["max-autotune"] < 4 * errs["eager (cuBLAS)"]
else:
    print(f"GPU half not recorded here: this page ran on {dev.type}")

# %%
# Which fp32 emulation is as accurate as fp32: bf16x3 or bf16x9?
# --------------------------------------------------------------
# Asked in `pytorch#195301 <https://github.com/pytorch/pytorch/pull/195301>`__ (a BF16x9
# precision mode for CUDA float32 matmuls, cuBLAS's ``CUBLAS_COMPUTE_32F_EMULATED_16BFX9``)
# and `pytorch#181849 <https://github.com/pytorch/pytorch/pull/181849>`__ (the same emulation
# in cuSOLVER), with `cutlass#2293 <https://github.com/NVIDIA/cutlass/issues/2293>`__ ("9xbf16
# is almost the same as true fp32 while 6xbf16/3xtf32 still has a tiny delta"). First, what
# the installed torch accepts for the float32 precision switches (live: each value set and
# read back on this build, no GPU needed):
spellings = ("ieee", "tf32", "bf16", "bf16x3", "bf16x9", "bfx9", "tf32x3")
accepted = {path: split_matmul.accepted(path, spellings)
            for path in ("cuda.matmul", "mkldnn.matmul")}
from mpguide.core.table import Table

Table(("value", *accepted), tuple((v, *(accepted[p][v] for p in accepted)) for v in spellings),
      f"torch.backends.<path>.fp32_precision = value, torch {torch.__version__}")

# %%
rejected = [v for v in spellings if all(accepted[p][v] != "accepted" for p in accepted)]
assert {"bf16x3", "bf16x9", "bfx9", "tf32x3"} <= set(rejected)
assert accepted["mkldnn.matmul"]["bf16"] == "accepted" != accepted["cuda.matmul"]["bf16"]
print(f"on torch {torch.__version__}: rejected everywhere: {', '.join(rejected)}; 'bf16' only "
      "for oneDNN (one bf16 pass, no emulation)")

# %%
# The installed torch knows ``ieee``, ``tf32``, ``bf16`` (oneDNN only) and ``none``: the
# BF16x9 mode of #195301 is not in this build, and the emulation is reachable only through
# cuBLAS itself or a library that calls it. What each scheme would give, computed here: each
# float32 operand split into bf16 (or tf32) terms, the kept products added in float32, against
# the float64 product of the same operands:
schemes = split_matmul.scheme_errors()
schemes

# %%
assert schemes.ratio("bf16x9") <= 1.0 and schemes.ratio("bf16x6") <= 1.0
assert schemes.errors["bf16x6"] == schemes.errors["bf16x9"]
assert 5 < schemes.ratio("bf16x3") < 20 and schemes.ratio("tf32x3") < 2
assert schemes.ratio("bf16") > 1000 and schemes.ratio("tf32") > 100
print(f"emulated: bf16x9 {schemes.ratio('bf16x9'):.2f}x, bf16x6 {schemes.ratio('bf16x6'):.2f}x, "
      f"tf32x3 {schemes.ratio('tf32x3'):.2f}x, bf16x3 {schemes.ratio('bf16x3'):.1f}x float32's "
      "error")
bits = {d: 1 - round(math.log2(torch.finfo(d).eps)) for d in (torch.bfloat16, torch.float32)}
assert 3 * bits[torch.bfloat16] == bits[torch.float32]
print(f"significand bits (torch.finfo): bf16 {bits[torch.bfloat16]}, three bf16 terms "
      f"{3 * bits[torch.bfloat16]}, float32 {bits[torch.float32]}")

# %%
# Three bf16 terms hold 24 significand bits, float32's, so a sum of all nine products is
# float32's product before accumulation; the products with ``i + j >= 3`` are below
# float32's rounding, which is why bf16x6 equals bf16x9 here. Every kept product is exact in
# float32, where IEEE float32 rounds each product, so the emulations came out slightly below
# float32's error on these standard-normal operands. bf16x3 drops the ``a1 b1``, ``a0 b2``
# and ``a2 b0`` products (2^-16 of the result), about ten times float32's error: enough to
# replace TF32 (Triton's use), not float32. The cost is the count of bf16 matmuls (the
# ``matmuls`` column), paid on tensor cores. Switches and TF32 on this machine:
# :ref:`sphx_glr_docs_auto_examples_questions_plot_03_precision_switches.py`.

# %%
# What we saw
# -----------
# - On the CPU inductor called ``extern_kernels.mm`` under every oneDNN setting tried and
#   accumulated the bf16 sum in ``float``; its Triton templates accumulate in ``tl.float32``
#   for the four input dtypes shown, and ``tl.dot`` asks for TF32 by the switch alone.
# - The installed torch rejects ``bf16x3``, ``bf16x9``, ``bfx9`` and ``tf32x3``.
# - Emulated, bf16x9 and bf16x6 matched float32's error, tf32x3 came close, bf16x3 was about
#   ten times off.
#
# .. admonition:: References
#
#    :torchdoc:`notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices`,
#    :torchapi:`torch.compile`

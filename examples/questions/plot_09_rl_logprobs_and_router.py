"""
Serving vs training: RL logprobs and MoE routers
================================================

Two questions readers of RL trainers and MoE serving engines ask in 2025-2026: how many nats
of train/serve logprob gap each precision knob costs (bf16 or fp16, an fp32 ``lm_head``, the
temperature applied in bf16, the attention kernel), and whether a mixture-of-experts router
must compute its gate logits in float32. Both are answered on this build's CPU (live): a tiny
language model built in code, whose trainer side and serving side differ only in precision,
and a router of 128 experts choosing 8 for 4,096 tokens. The answers: the bf16 gap is several
times the fp16 gap; the fp32 head removes only the head's share of it; bf16 router logits
change the expert set of a few percent of tokens, and only float32 logits from the matmul
itself (not a ``.float()`` after it) remove that.
"""

# %%
# Setup
# -----
import math

import torch
from torch.nn.attention import SDPBackend

from mpguide.core import device
from mpguide.core.table import Table
from mpguide.precision import router_topk
from mpguide.training import logprob_gap

cpu = torch.device("cpu")
device.describe(cpu)

# %%
# How many nats of train/serve logprob gap does each precision knob cost?
# -----------------------------------------------------------------------
# Asked in `OpenRLHF#1155 <https://github.com/OpenRLHF/OpenRLHF/issues/1155>`__ ("Don't Use
# bf16 for RL, but fp16"),
# `torchforge#513 <https://github.com/meta-pytorch/torchforge/issues/513>`__ ("Enable AMP for
# fp16 training - train/inference mismatch"),
# `prime-rl#2438 <https://github.com/PrimeIntellect-ai/prime-rl/pull/2438>`__ (an fp32
# ``lm_head`` in vLLM "for stable logprobs") and
# `Fast-LLM#525 <https://github.com/ServiceNow/Fast-LLM/pull/525>`__ (the gap across engines,
# per knob). A trainer recomputes the logprobs of tokens a serving engine sampled; the ratio
# of the trainer's probability of each token to the server's weighs its update. Here both
# sides run the same float32 weights of a tiny LM
# (:class:`mpguide.training.logprob_gap.TinyLM`, built in code): the trainer under autocast,
# the server with the weights cast, as engines load them. Each pair of the table differs in
# one knob; the logits go through ``.float()`` before the logprobs are taken on both sides,
# as vLLM's sampler and RL trainers do.
model = logprob_gap.TinyLM().eval()
gen = torch.Generator().manual_seed(0)
tokens = torch.randint(0, model.lm_head.out_features, (4, 128), generator=gen)
bf16, fp16 = torch.bfloat16, torch.float16
Path = logprob_gap.Path
T = 0.7
PAIRS = {
    "bf16 (the usual setup)": (Path("trainer: autocast bf16", autocast=bf16),
                               Path("server: bf16 weights", weights=bf16)),
    "bf16, fp32 lm_head on both sides": (
        Path("trainer: autocast bf16, fp32 head", autocast=bf16, fp32_head=True),
        Path("server: bf16 weights, fp32 head", weights=bf16, fp32_head=True)),
    "fp16 on both sides": (Path("trainer: autocast fp16", autocast=fp16),
                           Path("server: fp16 weights", weights=fp16)),
    f"bf16, temperature {T} in float32": (
        Path("trainer: autocast bf16", autocast=bf16, temperature=T),
        Path("server: bf16 weights", weights=bf16, temperature=T)),
    f"bf16, server applies temperature {T} in bf16": (
        Path("trainer: autocast bf16", autocast=bf16, temperature=T),
        Path("server: bf16 weights, logits / T in bf16", weights=bf16, temperature=T,
             temperature_dtype=bf16)),
    "server alone: math vs flash SDPA kernel": (
        Path("server: bf16, math SDPA", weights=bf16, sdpa=SDPBackend.MATH),
        Path("server: bf16, flash SDPA", weights=bf16, sdpa=SDPBackend.FLASH_ATTENTION)),
    "float32 on both sides (the floor)": (Path("trainer: float32"), Path("server: float32")),
}
targets = {1.0: logprob_gap.sample_targets(model, tokens, 1.0, gen),
           T: logprob_gap.sample_targets(model, tokens, T, gen)}
cache = {}


def run(path):
    key = (path, path.temperature)
    if key not in cache:
        cache[key] = logprob_gap.logprobs(model, tokens, targets[path.temperature], path)
    return cache[key]


gaps = {knob: logprob_gap.gap(run(a), run(b), (a.name, b.name)) for knob, (a, b) in PAIRS.items()}
band = next(iter(gaps.values())).band
knobs = Table(
    ("knob", "mean |gap| (nats)", "max |gap| (nats)", f"tokens with ratio off 1 by > {band:.0%}"),
    tuple((k, g.mean_abs, g.max_abs, f"{g.outside_band:.1%}") for k, g in gaps.items()),
    f"logprob gap over {tokens.numel()} sampled tokens of a {len(model.blocks)}-block LM, vocab "
    f"{model.lm_head.out_features}; torch {torch.__version__} on cpu ({device.LIVE})",
)
knobs

# %%
g = {k: v.mean_abs for k, v in gaps.items()}
base, head, half = (g["bf16 (the usual setup)"], g["bf16, fp32 lm_head on both sides"],
                    g["fp16 on both sides"])
t_f32, t_bf16 = g[f"bf16, temperature {T} in float32"], g[f"bf16, server applies temperature {T} in bf16"]
floor = g["float32 on both sides (the floor)"]
assert floor == 0.0  # same weights, same kernels: identical logprobs
assert half * 3 < base and head < base and t_bf16 > t_f32
assert g["server alone: math vs flash SDPA kernel"] > 0
default_is_flash = torch.equal(run(PAIRS["bf16 (the usual setup)"][1]),
                               run(PAIRS["server alone: math vs flash SDPA kernel"][1]))
print(f"mean gap: bf16 {base:.4f} nats, fp32 head {head:.4f} ({1 - head / base:.0%} less), "
      f"fp16 {half:.4f} ({base / half:.1f}x smaller than bf16); temperature in bf16 "
      f"{t_bf16:.4f} against {t_f32:.4f} in float32")
print(f"bf16 on the CPU picks the flash SDPA kernel by default: {default_is_flash}")
bits = {d: 1 - round(math.log2(torch.finfo(d).eps)) for d in (bf16, fp16)}
print(f"significant bits (torch.finfo): bf16 {bits[bf16]}, fp16 {bits[fp16]}; a bf16 rounding is "
      f"{2 ** (bits[fp16] - bits[bf16])} times coarser")

# %%
# What the table says, and why. bf16 keeps 8 significant bits and fp16 11, so each rounding
# of a bf16 activation is 8 times coarser; the two sides round at different places (autocast
# rounds matmul inputs and outputs but keeps float32 weights, norms and residual adds; the
# engine keeps everything in bf16), so the bf16 gap is the rounding of a whole forward pass,
# and fp16 on both sides shrinks it by the factor printed above, as OpenRLHF#1155's paper
# reports. An fp32 ``lm_head`` on both sides removes the rounding of the logits
# themselves (a bf16 logit near 10 is off by up to 1/32) but not the body's, so the gap
# falls only by the share printed above. A temperature divided in bf16 rounds the logits a
# second time. The attention kernel alone moves logprobs too: the math and flash kernels
# round and accumulate differently, and on this CPU the default bf16 choice is the one printed
# above. Fast-LLM#525 measures the same per-token quantity between real engines on a real
# model.
#
# A compiled server is a further knob: its fused kernels round where eager rounds
# differently (:ref:`sphx_glr_docs_auto_examples_questions_plot_01_compile_numerics.py`); it
# is not run here, where compiling would exceed this page's time. On a GPU the kernels differ
# again (cuBLAS's split reductions, FlashAttention 2), and with them the gaps: this page runs
# on the CPU only, and the GPU figures are not recorded yet.

# %%
# Should a MoE router compute its gate logits in float32?
# -------------------------------------------------------
# Asked in `vllm#58076 <https://github.com/vllm-project/vllm/pull/58076>`__ ("gpt-oss
# computes router logits in bf16, while the HF reference forces the router to use fp32 ...
# the precision gap ... can flip which experts get selected"),
# `sglang#38695 <https://github.com/sgl-project/sglang/issues/38695>`__ (one gate layer with
# a bf16 matmul that writes float32),
# `Megatron-LM#2741 <https://github.com/NVIDIA/Megatron-LM/issues/2741>`__ and
# `maxtext#5293 <https://github.com/AI-Hypercomputer/maxtext/pull/5293>`__. A router of 128
# experts choosing 8, with bf16 hidden states and weights as a served model has them; each way
# of computing the logits against the float64 logits of the same bf16 inputs:
x = torch.randn(4096, 1024, generator=gen).bfloat16()
w_gate = (torch.randn(128, 1024, generator=gen) / 1024**0.5).bfloat16()
TOPK = 8
no_out_dtype = router_topk.out_dtype_support(cpu)
gates = [g for g in router_topk.GATES if not (no_out_dtype and "out_dtype" in g)]
routes = [router_topk.routing(x, w_gate, TOPK, gate) for gate in gates]
router = Table(
    ("gate", "logits", "tokens with another expert set", "routing weight moved",
     "max |logit error|"),
    tuple((r.gate, r.logits_dtype, f"{r.changed:.2%}", f"{r.weight_moved:.3%}", r.max_logit_error)
          for r in routes),
    f"top-{TOPK} of {w_gate.shape[0]} experts for {x.shape[0]} tokens, against float64; cpu "
    f"({device.LIVE})",
)
router

# %%
by = {r.gate: r for r in routes}
bf16_gate = by["bf16 gate (bf16 logits)"]
after = by["bf16 gate, logits .float() after"]
f32_gate = by["float32 gate (x.float(), w.float())"]
assert bf16_gate.changed > 0.005 and after.changed == bf16_gate.changed
assert f32_gate.changed < bf16_gate.changed / 10
print(f"bf16 logits: {bf16_gate.changed:.2%} of tokens get another expert set; .float() after "
      f"the matmul: the same {after.changed:.2%}; a float32 gate: {f32_gate.changed:.2%}")
if no_out_dtype:
    print(f"torch.mm(bf16, bf16, out_dtype=torch.float32) on the cpu, torch {torch.__version__}: "
          f"{no_out_dtype}")
with device.simulate("cuda") as fake:
    a = torch.empty(4096, 1024, dtype=bf16, device=fake)
    b = torch.empty(1024, 128, dtype=bf16, device=fake)
    simulated_dtype = torch.mm(a, b, out_dtype=torch.float32).dtype
assert simulated_dtype == torch.float32
print(f"on cuda (simulated: {device.SIMULATED}) the same call returns {simulated_dtype}")

# %%
# A bf16 logit of magnitude 1 to 2 is a multiple of 1/128, so two experts whose exact logits
# are closer than that tie or swap, and a token at the top-k boundary changes its expert set;
# ``.float()`` after the matmul cannot bring back the bits the bf16 output already dropped
# (the same share of tokens changes). A float32 result of the same bf16 products is exact to
# float32's rounding: a bf16 x bf16 product fits a float32 exactly, so a bf16 matmul that
# writes float32 (``torch.mm(..., out_dtype=torch.float32)``, what sglang#38695 asks for)
# gives the float32 gate's logits without casting the activations; on this torch that call
# has no CPU kernel (the message above), and on CUDA it returns float32 (simulated here).
# What the float32 gate costs: a float32 copy of the hidden states, read once more per layer
# (the first figure below); the ``out_dtype`` matmul writes only the ``tokens x experts``
# logits in float32. Their times on a GPU are not recorded yet: the CPU has no ``out_dtype``
# kernel to compare.
print(f"float32 gate: casts {x.numel() * 4 / 2**20:.0f} MiB of float32 activations per layer; "
      f"out_dtype: writes {x.shape[0] * w_gate.shape[0] * 4 / 2**20:.1f} MiB of float32 logits "
      f"instead of {x.shape[0] * w_gate.shape[0] * 2 / 2**20:.1f} MiB of bf16")

# %%
# What we saw
# -----------
# - On this CPU, with one tiny LM and one seed: the train/serve logprob gap in bf16 is several
#   times the gap in fp16 (the factor is printed above); an fp32 ``lm_head`` on both sides
#   removes only the head's share; a temperature divided in bf16 widens it; the SDPA kernel
#   alone moves logprobs; float32 on both sides gives identical logprobs.
# - bf16 router logits change the top-8 expert set of the share of tokens printed above;
#   ``.float()`` after the matmul changes nothing, a float32 gate removes nearly all of it,
#   and ``torch.mm(..., out_dtype=torch.float32)`` gives float32 logits without a float32
#   copy of the activations where the device has a kernel for it: CUDA (simulated here), not
#   the CPU (live) on this torch.
#
# .. admonition:: References
#
#    :torchapi:`torch.nn.functional.scaled_dot_product_attention`,
#    :torchapi:`torch.nn.attention.sdpa_kernel`, :torchapi:`torch.autocast`,
#    :torchapi:`torch.mm`, :torchapi:`torch.topk`

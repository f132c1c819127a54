"""
Serving dtype: readers' questions
=================================

Two recurring questions about inference: why a model trained in bf16 returns NaN (or the
``probability tensor contains either inf, nan or element < 0`` error) when loaded in fp16, and
whether logits should be upcast before a softmax, a sigmoid or sampling. Each is answered with
a small model whose activations have the outlier a bf16-trained network develops, served in
float32, bf16 and fp16 on this build's device. The answers: fp16's largest value, 65504, is
far below such activations, so fp16 turns them into ``inf`` and the next normalization into
NaN, while bf16 keeps float32's range; and bf16 probabilities and scores carry 8 significant
bits: upcasting the logits before a sigmoid keeps apart scores a bf16 sigmoid merges, but
candidates whose bf16 logits already tie stay tied (all of the softmax's ties here) unless the
logits themselves are float32.
"""

# %%
# Setup
# -----
import torch

from mpguide.core import device
from mpguide.core.table import Table

dev = device.pick()
device.describe(dev)
gen = torch.Generator(device=dev).manual_seed(0)

# %%
# Why does my bf16-trained model give NaN in fp16?
# ------------------------------------------------
# Asked in `finetrainers#182 <https://github.com/huggingface/finetrainers/issues/182>`__ ("Many
# of the models were trained primarily in bf16, which makes them susceptible to going out of
# range in fp16"), `DeepSeek-V2#93 <https://github.com/deepseek-ai/DeepSeek-V2/issues/93>`__,
# `Pyramid-Flow#25 <https://github.com/jy0205/Pyramid-Flow/issues/25>`__,
# `Qwen3#868 <https://github.com/QwenLM/Qwen3/issues/868>`__,
# `G.O.D#1231 <https://github.com/gradients-ai/G.O.D/pull/1231>`__,
# `efficientvit#110 <https://github.com/mit-han-lab/efficientvit/issues/110>`__,
# `ml-engineering#41 <https://github.com/stas00/ml-engineering/issues/41>`__ and
# `InternEvo#278 <https://github.com/InternLM/InternEvo/issues/278>`__, which ended in
# ``RuntimeError: probability tensor contains either `inf`, `nan` or element < 0`` from
# ``generate``. A block with one outlier feature (large activations in a few channels are
# common in bf16-trained transformers): a projection, an RMS normalization, the logits, and
# sampling.
WIDTH, HIDDEN, VOCAB = 64, 256, 1000
x = torch.randn(4, WIDTH, generator=gen, device=dev)
x[:, 0] = 40.0  # the outlier channel
w_in = torch.randn(WIDTH, HIDDEN, generator=gen, device=dev) / WIDTH**0.5
w_in[0] = 2500.0  # reads the outlier: activations near 40 * 2500 = 1e5
w_out = torch.randn(HIDDEN, VOCAB, generator=gen, device=dev) / HIDDEN**0.5


def block(x, w_in, w_out):
    h = x @ w_in
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMSNorm, no weight
    return h @ w_out


served = []
for dt in (torch.float32, torch.bfloat16, torch.float16):
    h = x.to(dt) @ w_in.to(dt)
    logits = block(x.to(dt), w_in.to(dt), w_out.to(dt))
    probs = torch.softmax(logits.float(), -1)
    if dev.type == "cuda" and not torch.isfinite(probs).all():
        sampled = "not sampled here: on CUDA the check is a device-side assert"
    else:
        try:
            torch.multinomial(probs, 1, generator=gen)
            sampled = "sampled"
        except RuntimeError as err:
            sampled = f"RuntimeError: {err}"
    served.append((str(dt).removeprefix("torch."), h.float().abs().max().item(),
                   int(torch.isinf(h).sum()), int(torch.isnan(logits).sum()), sampled))
fp16_nan = Table(("dtype", "max |activation|", "inf activations", "NaN logits", "sampling"),
                 tuple(served), f"One outlier block served in three dtypes on {dev.type} "
                                f"({device.LIVE}); fp16 max is {torch.finfo(torch.float16).max:g}")
fp16_nan

# %%
f32_row, bf16_row, fp16_row = fp16_nan.records()
assert f32_row["max |activation|"] > torch.finfo(torch.float16).max
assert f32_row["NaN logits"] == bf16_row["NaN logits"] == 0 and bf16_row["inf activations"] == 0
assert fp16_row["inf activations"] > 0 and fp16_row["NaN logits"] > 0
if dev.type == "cpu":
    assert "probability tensor contains either `inf`, `nan` or element < 0" in fp16_row["sampling"]
print(f"on torch {torch.__version__} ({dev.type}): fp16 overflows to inf, the RMSNorm turns "
      f"inf into NaN, and sampling {fp16_row['sampling'] if dev.type == 'cuda' else 'raises the reader error'}; "
      "bf16 serves it")

# %%
# The activation is about ``40 * 2500 = 1e5``, above fp16's largest value (65504) but
# nowhere near bf16's (3.4e38), whose exponent range is float32's. In fp16 it becomes
# ``inf``; the normalization divides ``inf`` by ``sqrt(mean(inf**2)) = inf`` and produces NaN,
# which reaches every logit of the row and the sampler, which refuses NaN probabilities (live
# on the CPU, asserted above). On a GPU the sampler checks them in a kernel, where a failed
# check is a device-side assertion that leaves the CUDA context unusable, so on CUDA the page
# does not sample NaN. The CPU build does not show that path; the GPU gallery run will (once
# recorded, the site shows the GPU output beside each block).
# bf16 -> fp16 is the risky direction (a bf16-trained model never had to keep its
# activations below 65504); fp16 -> bf16 only costs precision (ml-engineering#41). Fixes:
# serve in bf16; or keep the overflowing modules in float32 (find them with the per-module
# report of :ref:`sphx_glr_docs_auto_examples_model_plot_02_finding_an_overflow.py`); or
# scale before the matmul as attention does
# (:ref:`sphx_glr_docs_auto_examples_inference_plot_02_fp16_overflow.py`).

# %%
# Should I upcast logits to float before softmax and sampling?
# ------------------------------------------------------------
# Asked in `transformers#27341 <https://github.com/huggingface/transformers/issues/27341>`__
# ("Generate: should ``softmax`` be upcasted to ``.float()``?"),
# `optimum-habana#1835 <https://github.com/huggingface/optimum-habana/pull/1835>`__ ("Keep logits
# in bf16") and `sentence-transformers#3893
# <https://github.com/huggingface/sentence-transformers/pull/3893>`__ (bf16 reranker scores
# "collapse into spurious ties"). Logits of 32,000 tokens and 1,000 reranker scores, each
# activated in bf16 and after ``.float()``:
logits = 4 * torch.randn(32_000, generator=gen, device=dev)
scores = 3 + torch.rand(1000, generator=gen, device=dev)  # relevance logits between 3 and 4
exact_p = torch.softmax(logits.double(), -1)
rows = []
for how, lg, sc in (("bf16 logits, activated in bf16", logits.bfloat16(), scores.bfloat16()),
                    ("bf16 logits, .float() first", logits.bfloat16().float(),
                     scores.bfloat16().float()),
                    ("float32 logits", logits, scores)):
    p = torch.softmax(lg, -1)
    top = torch.topk(p.double(), 50).values
    s = torch.sigmoid(sc)
    rows.append((how, ((p.double() - exact_p).abs() / exact_p).max().item(),
                 int(torch.unique(torch.topk(lg, 50).values).numel()),
                 int(torch.unique(top).numel()), int(torch.unique(sc).numel()),
                 int(torch.unique(s).numel())))
upcast = Table(("how", "max relative error of p", "distinct top-50 logits",
                "distinct values among top-50 p", "distinct scores of 1000",
                "distinct sigmoid scores of 1000"), tuple(rows),
               f"softmax over 32,000 logits and sigmoid of 1,000 scores on {dev.type}")
upcast

# %%
in_bf16, cast_first, f32 = upcast.records()
SIG, TOP, TOP_LOGITS = ("distinct sigmoid scores of 1000", "distinct values among top-50 p",
                        "distinct top-50 logits")
assert in_bf16[SIG] < cast_first[SIG] < f32[SIG]
assert cast_first[SIG] <= cast_first["distinct scores of 1000"] < f32["distinct scores of 1000"]
assert in_bf16["max relative error of p"] > cast_first["max relative error of p"]
assert in_bf16[TOP] == cast_first[TOP] == cast_first[TOP_LOGITS] < f32[TOP] == 50
print(f"sigmoid: {in_bf16[SIG]} distinct scores of 1000 in bf16, {cast_first[SIG]} after "
      f".float() (the bf16 logits hold {cast_first['distinct scores of 1000']} values), "
      f"{f32[SIG]} from float32 logits; softmax: the top 50 probabilities take {in_bf16[TOP]} "
      f"values in bf16 and {cast_first[TOP]} after .float(), as many as the bf16 logits "
      f"({cast_first[TOP_LOGITS]}); {f32[TOP]} from float32 logits")
sig = torch.sigmoid(scores)
print(f"the scores lie between {scores.min().item():.2f} and {scores.max().item():.2f}, their "
      f"sigmoid between {sig.min().item():.2f} and {sig.max().item():.2f}")

# %%
# Softmax and sigmoid kernels compute in float32 internally, but a bf16 output keeps 8
# significant bits. Ties come from two roundings, and upcasting before the activation undoes
# only the second. For the sigmoid, the output rounding is what collapses the scores most:
# values between 0.95 and 0.98 fall on a handful of bf16 numbers (the last column), and
# ``.float()`` first keeps the distinct bf16 logits apart; but the bf16 logits themselves,
# between 3 and 4, take only the values printed above, so candidates closer than that still
# tie. For the softmax, close candidates already tie in the bf16 logits: the top 50
# probabilities take exactly as many values as the top 50 bf16 logits, whether activated in
# bf16 or after ``.float()``. Upcasting the logits before the activation (one float32 vector
# per step) fixes the sigmoid's collapse and trims the softmax's error; separating candidates
# that tie in the logits needs the logits in float32 (the last row: a float32 output layer).
# Where each dtype loses precision:
# :ref:`sphx_glr_docs_auto_examples_inference_plot_01_serving_variants.py`.

# %%
# What we saw
# -----------
# - An outlier activation above 65504 is ``inf`` in fp16, NaN after the next normalization,
#   and the sampler's ``probability tensor contains either inf, nan or element < 0``; bf16
#   and float32 serve the same block.
# - A bf16 sigmoid collapses scores that ``.float()`` first keeps apart; the softmax's top
#   probabilities tie as often after ``.float()`` as in bf16, because their bf16 logits tie.
#   Only float32 logits separate all 50 top probabilities here.
#
# .. admonition:: References
#
#    :torchdoc:`type_info.html` (torch.finfo), :torchapi:`torch.multinomial`,
#    :torchapi:`torch.softmax`, :torchapi:`torch.sigmoid`

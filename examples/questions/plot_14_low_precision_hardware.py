"""
fp16 decoders, bf16 CPUs, fp4 activations: readers' questions
=============================================================

Three questions where the answer depends on the format's range or on the processor: why a
diffusion model's decoder gives black (NaN) images in fp16 and what fixes it, why bf16
autocast on a CPU can be slower than float32, and why 4-bit post-training quantization of
activations (W4A4) hurts far more than of weights alone (W4A16). The first is run on a small
convolutional decoder shaped like a VAE's, stage by stage, in each dtype; the second is timed
on this machine, with its kernels as they are and capped at AVX2 in a child process; the
third is emulated on a transformers model. The answers on this torch: the decoder's residual
stream passes float16's 65504 in its last block, the GroupNorm after it turns the infinities
into NaN, and float32 norms do not help while bf16 or a rescaled stream do; on this machine
bf16 matmuls and convolutions are fast with AMX and many times slower than float32 once the
kernels are capped at AVX2; and with outlier channels, quantizing the activations too
raised the logits error more than the weights did, most with MXFP4.
"""

# %%
# Setup
# -----
import torch

from mpguide.core import device
from mpguide.models import conv_decoder

device.describe("cpu")
f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32

# %%
# Why does my diffusion model's VAE give black images in fp16?
# ------------------------------------------------------------
# Asked in `Z-Image#14 <https://github.com/Tongyi-MAI/Z-Image/issues/14>`__ ("Running the model
# in the torch.float16 either in comfyui or diffusers results in pure black image. float32
# works as intended"; its latents contain "only nan values") and `Step1X-Edit#53
# <https://github.com/stepfun-ai/Step1X-Edit/issues/53>`__. A decoder of four residual blocks
# read through GroupNorm, with a 2x upsampling, whose late blocks add large updates to the
# stream (as trained VAE decoders' do), decoding one seeded latent in float32, float16,
# bf16, float16 with its GroupNorms in float32, and float16 with the stream scaled down by
# 8 (:func:`mpguide.models.conv_decoder.rescaled`); the largest ``|value|`` after each stage:
decoder = conv_decoder.build()
latent = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(1))
runs = [
    conv_decoder.decode(decoder, latent, f32),
    conv_decoder.decode(decoder, latent, f16),
    conv_decoder.decode(decoder, latent, bf16),
    conv_decoder.decode(decoder, latent, f16, "float16, norms float32", conv_decoder.with_float_norms),
    conv_decoder.decode(conv_decoder.rescaled(decoder, 8), latent, f16, "float16, stream / 8"),
]
conv_decoder.stage_table(runs, f"largest |output| per stage, live on cpu, torch {torch.__version__}")

# %%
by = {r.label: r for r in runs}
reference = by["float32"].image
peak = max(p for _, p, _ in by["float32"].stages)
fp16_max = torch.finfo(f16).max


def error(run):
    return ((run.image - reference).abs().max() / reference.abs().max()).item()


assert peak > fp16_max and by["float32"].first_nonfinite is None
assert by["float16"].first_nonfinite == by["float16, norms float32"].first_nonfinite == "block 3"
assert by["float16"].nan_share == by["float16, norms float32"].nan_share == 1.0
assert by["bfloat16"].first_nonfinite is None and by["float16, stream / 8"].first_nonfinite is None
assert error(by["float16, stream / 8"]) < error(by["bfloat16"]) < 0.05
print(f"the float32 stream peaks at {peak:.4g} > float16's {fp16_max:g}: float16 overflows in "
      f"{by['float16'].first_nonfinite}, and {by['float16'].nan_share:.0%} of the image is NaN, "
      "norms in float32 or not")
print(f"finite runs, max |image error| / max |image| vs float32: bf16 {error(by['bfloat16']):.3g}, "
      f"float16 with the stream / 8 {error(by['float16, stream / 8']):.3g}")

# %%
# The overflow happens in the last block, where the float32 stream passes 65504; the
# GroupNorm after it computes the mean and variance of a group holding ``inf``,
# gets ``inf - inf`` and NaN, and every pixel downstream of the group is NaN (the share of
# the image printed above): a black image.
# Running the norms in float32 does not help: the ``inf`` is already in the stream they
# read. bf16 has float32's range and decodes (at bf16's precision); so does float32
# (diffusers' ``force_upcast`` of the VAE). The fp16-fixed VAE checkpoints
# (``madebyollin/sdxl-vae-fp16-fix``) scale the stream down: because every read of it goes
# through a GroupNorm, dividing the input convolution and each block's last convolution by 8
# gives the same image in exact arithmetic, and here a float16 image closer to float32's than
# bf16's. More on fp16 overflow in inference:
# :ref:`sphx_glr_docs_auto_examples_questions_plot_08_inference_dtype.py`.

# %%
# Why is bf16 autocast slower than float32 on my CPU?
# ---------------------------------------------------
# Asked in `pytorch#86270 <https://github.com/pytorch/pytorch/issues/86270>`__ ("Autocast with
# BF16 on CPU slows down model more than 2X"), `pytorch#118499
# <https://github.com/pytorch/pytorch/issues/118499>`__ ("the code with ``torch.autocast`` is
# 2 orders of magnitude slower") and `TabPFN#1122 <https://github.com/PriorLabs/TabPFN/pull/1122>`__
# (bf16 autocast turned on only "on CPUs with native bf16 acceleration"). This machine's bf16
# instruction sets, as the kernel reports them:
from mpguide.core import cpu_bf16

flags = cpu_bf16.cpu_flags()
print(f"{device.describe('cpu').caption()}: {flags}; "
      f"ATen kernels: {torch.backends.cpu.get_cpu_capability()}")

# %%
# Each op family timed in float32, on bf16 tensors and under ``autocast('cpu', bfloat16)``
# with float32 inputs, on one thread, in interleaved rounds; then the same in a child
# process whose oneDNN and ATen kernels are capped at AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``,
# ``ATEN_CPU_CAPABILITY=avx2``): the kernels a CPU without AVX512-BF16 or AMX runs, on this
# machine's cores. Medians of this machine, at the time the page was built (the spread is in
# :func:`mpguide.core.cpu_bf16.measure`'s table; another machine gives other numbers):
times = cpu_bf16.timings(repeat=9, scale=1)
times

# %%
matmul_like = ("linear (matmul)", "conv2d 3x3")
capped_slower = {f: times.ratio("capped", f) for f in matmul_like}
assert all(r > 1.5 for r in capped_slower.values()), capped_slower
if flags and flags["amx_bf16"]:
    assert times.ratio("native", "linear (matmul)") < 1
print("capped at AVX2, bf16 over float32: " + ", ".join(
    f"{f} {r:.1f}x" for f, r in capped_slower.items()))
print("with this CPU's own kernels: " + ", ".join(
    f"{f} {times.ratio('native', f):.2f}x" for f in matmul_like))

# %%
# With AMX (``amx_bf16``) or AVX512-BF16 (``avx512_bf16``) oneDNN multiplies bf16 in
# hardware, and bf16 matmuls and convolutions ran faster than float32 here (the native
# columns; the flags above say which of these this machine has). With the kernels capped at
# AVX2, which has no bf16 arithmetic, the same bf16 matmul and convolution took several times
# float32's time (the capped columns): what #86270 and #118499 measured on CPUs without
# those instructions. Autocast adds a cast of each float32 input to bf16 per call on top.
# The elementwise and norm families changed far less between the two (their rows). TabPFN's
# rule follows: enable CPU bf16 autocast only where ``avx512_bf16`` or ``amx_bf16`` is in
# ``/proc/cpuinfo`` (:func:`mpguide.core.cpu_bf16.cpu_flags` reads them).

# %%
# W4A16 or W4A4: how much do NVFP4 and MXFP4 activations cost?
# ------------------------------------------------------------
# Asked in `llm-compressor#2936 <https://github.com/vllm-project/llm-compressor/issues/2936>`__
# ("when we test our new model using NVFP4, the quantized model drop from 61% to 30% on math.
# For GPTQ int4, our model drop from 61% to 54%"), `llama.cpp#24364
# <https://github.com/ggml-org/llama.cpp/pull/24364>`__ (running NVFP4 W4A16 layers as W4A8
# instead of the native W4A4 on Blackwell, judged by the KL divergence against bf16) and
# `vllm#49060 <https://github.com/vllm-project/vllm/pull/49060>`__ (online NVFP4 as W4A16
# or W4A4). How much of the loss comes from quantizing the activations? A Qwen2 model built
# from its configuration (two layers of width 256, random weights, nothing downloaded) with
# the outlier channels trained models have (two channels of every RMSNorm weight 50 times
# larger, as in :ref:`sphx_glr_docs_auto_examples_lowbit_plot_03_model_layers.py`), every
# linear layer but ``lm_head`` quantized by each recipe, its weight only (W4A16) or its
# weight and input (W4A4), the GEMMs in float32 (emulated,
# :mod:`mpguide.models.fake_quant`); each layer's output error and the logits' against the
# unquantized model:
from mpguide.models import fake_quant, zoo

qwen = zoo.qwen2(hidden=256, intermediate=512)
with torch.no_grad():
    for block in qwen.model.layers:
        block.input_layernorm.weight[[5, 77]] *= 50
        block.post_attention_layernorm.weight[[5, 77]] *= 50
torch.manual_seed(0)
ptq = fake_quant.compare(qwen, zoo.token_inputs(qwen, 2, 64))
fake_quant.table(ptq, f"emulated on cpu, torch {torch.__version__}; errors ||q - x|| / ||x||")

# %%
ptq_by = {o.label: o for o in ptq}
for recipe in ("nvfp4", "mxfp4"):
    w4a16, w4a4 = ptq_by[f"W4A16 {recipe}"], ptq_by[f"W4A4 {recipe}"]
    assert w4a4.median_layer_error > w4a16.median_layer_error
    assert w4a4.logits_error > w4a16.logits_error and w4a4.kl > w4a16.kl
assert ptq_by["W4A4 mxfp4"].logits_error > ptq_by["W4A4 nvfp4"].logits_error
print("logits error, W4A16 -> W4A4: " + ", ".join(
    f"{r} {ptq_by[f'W4A16 {r}'].logits_error:.3f} -> {ptq_by[f'W4A4 {r}'].logits_error:.3f}"
    for r in ("nvfp4", "mxfp4")))

# %%
# A weight matrix has no outlier channels; the input of the projections after each RMSNorm
# has two, 50 times the rest, and a 4-bit block sharing one scale with an outlier rounds its
# other values to a few levels or to zero. NVFP4's blocks of 16, each with a scale not
# limited to powers of two, confine the damage better than MXFP4's blocks of 32 with a
# power-of-two scale, so MXFP4 W4A4 is the worst row. The model's weights are random, so its
# predictions are near uniform: read the logits error and KL, not top-1 agreement, as the
# measure here. Keep the activations in higher precision (W4A16 here; W4A8, as
# llama.cpp#24364 runs them, is not run here), or the outlier layers in higher precision;
# which layers lose most, per recipe:
# :ref:`sphx_glr_docs_auto_examples_lowbit_plot_03_model_layers.py`.

# %%
# What we saw
# -----------
# - The decoder's float32 stream passed float16's maximum in its last block; float16 turned
#   it into ``inf`` there and the GroupNorm after it made the whole image NaN, with norms in
#   float32 or not; bf16 and the stream scaled by 1/8 decoded.
# - On this machine bf16 matmuls and convolutions were faster than float32 with its AMX
#   kernels (when it has them) and slower than float32 (by the factors printed) when capped
#   at AVX2.
# - With outlier channels, W4A4 raised the median layer error, the logits error and the KL
#   over W4A16 for NVFP4 and MXFP4, and MXFP4 W4A4 was worst.
#
# .. admonition:: References
#
#    :torchdoc:`amp.html#cpu-op-specific-behavior`, :torchapi:`torch.nn.GroupNorm`,
#    :torchapi:`torch.finfo`

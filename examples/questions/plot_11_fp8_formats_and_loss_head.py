"""
fp8 variants and the loss head: readers' questions
==================================================

Two questions about the two ends of a model in low precision: why fp8 weights of one E4M3
variant go wrong on hardware that uses the other, and what a fused or chunked linear +
cross-entropy loss head does to the loss, its gradient and memory. Both run on this build's
CPU (live): the 256 fp8 byte codes read both ways, and a loss head of an 8,192-token
vocabulary computed six ways against float64. The answers on this torch: the same byte is
worth half as much in ``float8_e4m3fnuz``, and fn's ``-0`` is fnuz's NaN, so conversion is a
byte reinterpretation with the scale doubled; a bf16 loss from bf16 logits is off by more
than one bf16 rounding on the CPU, whose mean over tokens rounds in bf16 too; recomputed
chunks keep the float32 loss in a fraction of the memory; and torch's own
chunked ``F.linear_cross_entropy`` returns its loss in bf16 for bf16 inputs, off by more
than a bf16 step with its default chunk size on the CPU.
"""

# %%
# Setup
# -----
import torch

from mpguide.core import device
from mpguide.core.table import Table
from mpguide.precision import fp8_variants
from mpguide.training import loss_head

device.describe("cpu")
FN, FNUZ = fp8_variants.FN, fp8_variants.FNUZ

# %%
# Why do my fp8 weights read half as large, or NaN, on MI300?
# -----------------------------------------------------------
# Asked in `uccl#804 <https://github.com/uccl-project/uccl/pull/804>`__ and
# `FBGEMM#4280 <https://github.com/pytorch/FBGEMM/pull/4280>`__, and got the other way round
# in `vllm#33179 <https://github.com/vllm-project/vllm/pull/33179>`__ (a closed pull request
# that gave MI350 fnuz). As FBGEMM#4280 says, MI300 computes in ``float8_e4m3fnuz``, NVIDIA
# GPUs and MI350 in ``float8_e4m3fn``, and checkpoints are mostly fn. Both variants as torch defines them, and every one of the 256 byte codes read both ways:
Table(("", "float8_e4m3fn", "float8_e4m3fnuz"),
      (("largest value", torch.finfo(FN).max, torch.finfo(FNUZ).max),
       ("smallest normal", torch.finfo(FN).tiny, torch.finfo(FNUZ).tiny)),
      f"torch.finfo on torch {torch.__version__}")

# %%
codes = fp8_variants.compare_codes()
Table(("the 256 byte codes", "count"),
      (("fnuz value = fn value / 2", codes.halved),
       ("any other ratio (both finite, non-zero)", codes.other_ratio),
       ("zero in both", codes.zeros),
       (f"NaN in fn: {', '.join(hex(c) for c in codes.nan_fn)}", len(codes.nan_fn)),
       (f"NaN in fnuz: {', '.join(hex(c) for c in codes.nan_fnuz)}", len(codes.nan_fnuz)),
       (f"-0 in fn: {', '.join(hex(c) for c in codes.fn_negative_zero)}",
        len(codes.fn_negative_zero))),
      f"the same bytes read as each variant, cpu ({device.LIVE})")

# %%
assert torch.finfo(FN).max == 448 and torch.finfo(FNUZ).max == 240
assert codes.other_ratio == 0 and codes.halved == 256 - 4
assert codes.nan_fn == (0x7F, 0xFF) and codes.nan_fnuz == (0x80,) == codes.fn_negative_zero
fnuz_values = fp8_variants.every_code()[1]
assert fnuz_values[0x7F] == torch.finfo(FNUZ).max == -fnuz_values[0xFF]
print(f"{codes.halved} of 256 codes read as exactly half in fnuz; fn's -0 (0x80) is fnuz's only "
      "NaN; fn's NaN codes 0x7F and 0xFF are fnuz's largest magnitudes, "
      f"{fnuz_values[0x7F].item():g} and {fnuz_values[0xFF].item():g}")

# %%
# The variants share the bit layout and differ in the exponent bias (fn 7, fnuz 8), so the
# codes finite in both (252 of the 256 above) are worth half as much in fnuz. A loader that
# hands fn bytes to fnuz kernels halves every weight (the first row below), and turns each
# ``-0`` (common: small negative weights round to it, as the 8 planted below do) into NaN,
# which spreads through the next matmul. Three ways to move an fn weight with its
# per-tensor scale to fnuz, on weights with values up to 448:
gen = torch.Generator().manual_seed(0)
w = (torch.randn(512, 512, generator=gen) * 100).clamp(-448, 448)
w[0, :8] = -1e-4  # small negative weights: fn -0
w_fn, scale = w.to(FN), torch.tensor(0.01)
exact = w_fn.float() * scale
norm_w, norm_scale = fp8_variants.normalize_to_fnuz(w_fn, scale)
ways = {
    "bytes read as fnuz, scale kept": (fp8_variants.read_as_fnuz(w_fn), scale),
    "values cast to fnuz (.to()), scale kept": (fp8_variants.cast_values_to_fnuz(w_fn), scale),
    "bytes read as fnuz, -0 to 0, scale x 2": (norm_w, norm_scale),
}
rows = []
for name, (wz, s) in ways.items():
    got = wz.float() * s
    ok = ~got.isnan()
    rows.append((name, int(got.isnan().sum()),
                 (got[ok] / exact[ok]).nanmedian().item() if ok.any() else float("nan"),
                 bool(torch.equal(got, exact))))
convert = Table(("conversion", "NaN weights", "median ratio to fn value", "exact"), tuple(rows),
                f"a {tuple(w.shape)} fn weight moved to fnuz, cpu ({device.LIVE})")
convert

# %%
naive, cast, normalized = convert.records()
assert naive["NaN weights"] > 0 and naive["median ratio to fn value"] == 0.5
assert cast["NaN weights"] > 0 and not cast["exact"]
assert normalized["NaN weights"] == 0 and normalized["exact"]
print(f"reading the bytes: every weight halved and {naive['NaN weights']} NaN; casting values: "
      f"{cast['NaN weights']} NaN (|w| > 240 has no fnuz value, and torch {torch.__version__}'s "
      "cast gives NaN); bytes + scale x 2 + -0 fixed: exact")

# %%
# The last row is the rule vLLM's ``normalize_e4m3fn_to_e4m3fnuz`` applies: reinterpret the
# bytes, replace ``0x80`` by ``0x00``, double the scale; every value of the weight above is
# kept exactly, because
# a byte's fnuz value times twice the scale is its fn value times the scale. Casting values
# instead fails above fnuz's 240: on this torch the fnuz cast of an out-of-range value gives
# NaN. The same direction matters for a new scale: amax / 448 on MI300 overflows fnuz, so
# fnuz scales use 240 (``torch.finfo(torch.float8_e4m3fnuz).max``). The fnuz GEMM itself runs
# only on MI300; this page shows the numbers a CPU can check.

# %%
# Fused or chunked linear and cross-entropy: which dtype, what error, how much memory?
# ------------------------------------------------------------------------------------
# Asked in `Liger-Kernel#830 <https://github.com/linkedin/Liger-Kernel/pull/830>`__,
# `marin#8217 <https://github.com/marin-community/marin/pull/8217>`__ ("a bfloat16
# activation times a bfloat16 head emitted bfloat16 logits, while the backward already
# requested float32"), `Automodel#3907 <https://github.com/NVIDIA-NeMo/Automodel/issues/3907>`__
# and `pytorch#187053 <https://github.com/pytorch/pytorch/pull/187053>`__ (torch's chunked
# ``F.linear_cross_entropy``). bf16 hidden states of 512 tokens and a bf16 head of an
# 8,192-token vocabulary, the loss and its gradient computed each way, forward and backward,
# against float64; peak bytes are those the call allocates, counted at the dispatcher
# (:class:`mpguide.training.peak_bytes.PeakBytes`):
TOKENS, HIDDEN, VOCAB = 512, 128, 8192
h = torch.randn(TOKENS, HIDDEN, generator=gen).bfloat16()
head_w = (torch.randn(VOCAB, HIDDEN, generator=gen) * 3 / HIDDEN**0.5).bfloat16()
target = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
heads = {
    "bf16 logits, cross_entropy in bf16": loss_head.bf16_logits,
    "bf16 logits, .float() first": loss_head.float_logits,
    "float32 matmul (h.float(), w.float())": loss_head.float32_matmul,
    "8 chunks, float32 logits, recomputed": loss_head.chunked(8),
}
has_lce = loss_head.torch_linear_cross_entropy() is not None
if has_lce:
    heads["F.linear_cross_entropy, options=None"] = loss_head.torch_linear_cross_entropy()
    heads["F.linear_cross_entropy, chunked (default options)"] = (
        loss_head.torch_linear_cross_entropy(acc_policy="auto"))
results = [loss_head.measure(n, f, h, head_w, target) for n, f in heads.items()]
logits_mib = TOKENS * VOCAB * 2 / 2**20
lce = Table(("loss head", "loss dtype", "|loss error| (nats)", "grad error (relative)",
             "peak MiB"),
            tuple((r.name, r.loss_dtype, r.loss_error, r.grad_error, r.peak_bytes / 2**20)
                  for r in results),
            f"{TOKENS} tokens, vocab {VOCAB}, hidden {HIDDEN}; bf16 logits are "
            f"{logits_mib:.0f} MiB; torch {torch.__version__} on cpu ({device.LIVE})")
lce

# %%
r = {x.name: x for x in results}
bf16_ce, upcast, f32 = (r["bf16 logits, cross_entropy in bf16"], r["bf16 logits, .float() first"],
                        r["float32 matmul (h.float(), w.float())"])
chunks = r["8 chunks, float32 logits, recomputed"]
loss64 = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h.double(), head_w.double()),
                                           target).item()
bf16_step = 2.0 ** (torch.tensor(loss64).log2().floor().item() - 7)
per_token = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, head_w), target,
                                              reduction="none")
per_token_error = abs(per_token.double().mean().item() - loss64)
assert bf16_ce.loss_dtype == per_token.dtype == torch.bfloat16
assert bf16_ce.loss_error > bf16_step / 2 and bf16_ce.loss_error > 10 * per_token_error
assert upcast.loss_error < bf16_ce.loss_error and f32.loss_error < upcast.loss_error
assert abs(chunks.loss_error - upcast.loss_error) < 1e-5
assert abs(chunks.grad_error - upcast.grad_error) < 0.1 * upcast.grad_error
assert chunks.peak_bytes * 3 < upcast.peak_bytes
print(f"loss {loss64:.3f} nats (bf16 step there: {bf16_step:g}); bf16 loss off by "
      f"{bf16_ce.loss_error:.4f}, though the mean of its bf16 per-token losses, taken in "
      f"float64, is off by {per_token_error:.4f}; .float() logits {upcast.loss_error:.2g}, float32 matmul "
      f"{f32.loss_error:.2g}; 8 recomputed chunks: the .float() loss to 1e-5, peak "
      f"{chunks.peak_bytes / 2**20:.0f} MiB against {upcast.peak_bytes / 2**20:.0f} MiB")

# %%
# ``cross_entropy`` of bf16 logits returns a bf16 loss. Each token's loss is a bf16 number
# (at this loss a bf16 step is the figure printed above), and their mean, taken in float64,
# is close to float64's; the loss the CPU kernel returns is further off, because its mean
# over the tokens is rounded in bf16 along the way (the first figure printed above against
# the second). ``.float()`` on the logits keeps the loss in float32 and costs a float32
# copy of the logits; the float32 matmul also keeps the logits' own bits, as marin#8217 asks
# for. Chunking with recomputation gives the loss of the unchunked ``.float()`` row (to the
# summation order) and a gradient as close to float64, and holds one chunk of logits at a
# time.
#
# torch's own ``F.linear_cross_entropy``, where the installed torch has it:
if has_lce:
    ref, chunked_default = (r["F.linear_cross_entropy, options=None"],
                            r["F.linear_cross_entropy, chunked (default options)"])
    sweep = []
    for size in (4, 64, TOKENS):
        fn = loss_head.torch_linear_cross_entropy(batch_chunk_size=size, chunking_method=None)
        m = loss_head.measure(f"batch_chunk_size={size}", fn, h, head_w, target)
        sweep.append((size, TOKENS // size, m.loss_dtype, m.loss_error, m.peak_bytes / 2**20))
    chunk_sizes = Table(("batch_chunk_size", "chunks", "loss dtype", "|loss error| (nats)",
                         "peak MiB"), tuple(sweep),
                        f"F.linear_cross_entropy chunked, bf16 inputs, torch {torch.__version__} "
                        f"on cpu ({device.LIVE})")
    chunk_sizes
else:
    print(f"torch {torch.__version__} has no F.linear_cross_entropy")

# %%
if has_lce:
    chosen = torch.nn.LinearCrossEntropyOptions()._adjust(  # what "auto" resolves to here
        num_batches=TOKENS, in_features=HIDDEN, num_classes=VOCAB, dtype=torch.bfloat16,
        device=torch.device("cpu"))
    default_size = chosen.batch_chunk_size
    errs = chunk_sizes.column("|loss error| (nats)")
    assert ref.loss_error == bf16_ce.loss_error  # options=None is linear + cross_entropy
    assert chunked_default.loss_dtype == torch.bfloat16
    assert chunked_default.loss_error > bf16_step and errs[0] > max(errs[1:])
    assert chunked_default.peak_bytes * 3 < bf16_ce.peak_bytes
    assert chunked_default.grad_error < bf16_ce.grad_error
    print(f"F.linear_cross_entropy, default options on cpu: chunks of {default_size} tokens, a "
          f"bf16 loss off by {chunked_default.loss_error:.3f} nats (more than a bf16 step, "
          f"{bf16_step:g}); {errs[-1]:.3f} in one chunk; peak "
          f"{chunked_default.peak_bytes / 2**20:.1f} MiB; gradient error "
          f"{chunked_default.grad_error:.2g} against {bf16_ce.grad_error:.2g} from bf16 logits "
          f"(acc_policy {chosen.acc_policy!r}, acc_dtype {chosen.acc_dtype})")

# %%
# ``options=None`` is the plain ``linear`` + ``cross_entropy`` (the same row as the first).
# With options, torch chunks the tokens and never holds the whole logits, as the peak printed
# above shows; but for bf16 inputs it keeps the loss in a bf16 scalar, to which it adds each
# chunk's target logits and from which it subtracts each chunk's log-sum-exp (torch's
# ``nn/modules/linear_cross_entropy.py``: ``output_dtype`` and the in-place additions to and
# subtractions from ``output``): the more chunks, the more bf16 roundings of a running
# total, and in the sweep the smallest chunks give the largest error. On the CPU the default options choose the small chunks
# printed above. The gradient is another matter: it is accumulated in the ``acc_dtype``
# printed above, and is closer to float64 than the gradient through bf16 logits. Where the
# loss is logged or compared across runs, pass float32 inputs or compute the loss from
# float32 logits in recomputed chunks (the fourth row). On CUDA torch picks other chunk sizes
# and kernels (``out_dtype`` matmuls); the CUDA error and
# ``torch.cuda.max_memory_allocated`` are not recorded yet.

# %%
# What we saw
# -----------
# - fn and fnuz read 252 of the 256 codes as values a factor of 2 apart, fn's ``-0`` is
#   fnuz's NaN, and the exact conversion is the bytes with ``0x80`` cleared and the scale
#   doubled; a value cast to fnuz gives NaN above 240 on this torch.
# - On this CPU a bf16 loss from bf16 logits is off by more than half a bf16 step, since the
#   mean over tokens rounds in bf16 too; ``.float()`` logits or a
#   float32 matmul remove that at the cost of float32 logits, and recomputed chunks keep the
#   float32 loss with a fraction of the memory.
# - On torch 2.13 (this build), ``F.linear_cross_entropy`` with options keeps the loss of
#   bf16 inputs in bf16 across chunks, off by more than a bf16 step at the CPU's default chunk
#   size.
#
# .. admonition:: References
#
#    :torchdoc:`tensor_attributes.html` (the float8 dtypes), :torchdoc:`type_info.html` (torch.finfo),
#    :torchapi:`torch.nn.functional.cross_entropy`,
#    :torchapi:`torch.nn.functional.linear_cross_entropy`,
#    :torchdoc:`checkpoint.html` (torch.utils.checkpoint)

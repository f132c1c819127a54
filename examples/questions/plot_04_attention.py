"""
Attention in low precision: readers' questions
==============================================

Six questions about attention: NaN rows under masks, the fast and slow paths of
``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``, which mask value survives fp16
and bf16, which SDPA backend runs and how far it is from float64, and how to keep one block in
float32 under autocast. Each is the reader's repro, reduced and run on this build's device.
The answers on this torch: SDPA returns zeros for a fully masked row where a hand-written
softmax and ``MultiheadAttention(need_weights=True)`` return NaN; the encoder's fast path
still turns a float attention bias into NaN; ``finfo.min`` overflows to ``-inf`` when what is
added reaches half an ulp (two masks summed in either dtype, a score of -16 or below in fp16),
and stays finite below that; and an inner ``autocast(enabled=False)`` with ``.float()`` keeps
a block in float32.
"""

# %%
# Setup
# -----
import torch
import torch.nn.functional as F
from torch import nn

from mpguide.core import device
from mpguide.core.table import Table

dev = device.pick()
device.describe(dev)
torch.manual_seed(0)

# %%
# Why is my fully masked row NaN?
# -------------------------------
# Asked in `pytorch#160064 <https://github.com/pytorch/pytorch/issues/160064>`__
# ("MultiheadAttention returns all NaN when using attn_mask to fully mask some heads, and
# using ``need_weights=True``"), `#189045 <https://github.com/pytorch/pytorch/pull/189045>`__,
# `#152028 <https://github.com/pytorch/pytorch/issues/152028>`__ (with dropout) and
# `transformers#35647 <https://github.com/huggingface/transformers/pull/35647>`__ (an ``-inf``
# mask making SDPA NaN on XPU). The reader's repro (a boolean mask that masks the third head
# everywhere), and the same row through SDPA and a hand-written softmax:
x = torch.randn(1, 5, 3, device=dev)
head_mask = torch.tensor([False, False, True], device=dev).view(-1, 1, 1).expand(-1, 5, 5)
mha = nn.MultiheadAttention(3, 3, batch_first=True, device=dev)
without, _ = mha(x, x, x, attn_mask=head_mask, need_weights=False)
with_w, weights = mha(x, x, x, attn_mask=head_mask, need_weights=True, average_attn_weights=False)

q = k = v = torch.randn(1, 1, 3, 4, device=dev)
row_mask = torch.ones(3, 3, dtype=torch.bool, device=dev)
row_mask[2] = False  # the third query may attend to nothing
sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=row_mask)
scores = (q @ k.transpose(-1, -2)).masked_fill(~row_mask, float("-inf"))
by_hand = torch.softmax(scores, -1) @ v
masked = Table(
    ("computation", "NaN in output", "fully masked row"),
    (("MultiheadAttention, need_weights=False", bool(without.isnan().any()), "finite"),
     ("MultiheadAttention, need_weights=True", bool(with_w.isnan().any()), "NaN"),
     ("scaled_dot_product_attention", bool(sdpa.isnan().any()), str(sdpa[0, 0, 2].tolist())),
     ("softmax(scores masked with -inf) @ v", bool(by_hand.isnan().any()), "NaN")),
    f"torch {torch.__version__} on {dev.type}",
)
masked

# %%
assert not without.isnan().any() and with_w.isnan().any() and weights.isnan().any()
assert torch.equal(sdpa[0, 0, 2], torch.zeros(4, device=dev)) and by_hand[0, 0, 2].isnan().all()
print(f"on torch {torch.__version__} ({dev.type}): SDPA and need_weights=False give zeros for "
      "a fully masked row; need_weights=True and a hand-written softmax give NaN")

# %%
# A row whose scores are all ``-inf`` has no softmax: ``exp`` gives zeros and ``0 / 0`` is
# NaN. Since 2.5 SDPA uses a "safe" softmax that returns zeros for such rows, and
# ``MultiheadAttention`` with ``need_weights=False`` goes through SDPA; with
# ``need_weights=True`` it computes the weights with the plain softmax to return them, so the
# NaN comes back (#189045 proposes the safe softmax there too). Fixes: pass
# ``need_weights=False``; or make sure every row keeps one key (padding queries can attend to
# themselves) and drop their outputs; or fill with a finite value (next answer). Masks and
# norms in training: :ref:`sphx_glr_docs_auto_examples_training_plot_03_norms_and_masks.py`.

# %%
# Does MultiheadAttention return NaN with a sliding-window mask on long sequences?
# --------------------------------------------------------------------------------
# Asked in `pytorch#127055 <https://github.com/pytorch/pytorch/issues/127055>`__ on torch 2.3
# (CPU): ``need_weights=False`` gave NaN rows for a 600-token sequence whose float mask hides
# the future and tokens older than 10, ``need_weights=True`` did not. The reader's repro:
n = 600
window = nn.MultiheadAttention(embed_dim=2, num_heads=1, device=dev)
sequence = torch.ones(n, 2, device=dev)
full = torch.full((n, n), float("-inf"), device=dev)
sliding = torch.triu(full, diagonal=1) + torch.tril(full, diagonal=-10)
with torch.no_grad():
    fast = window(sequence, sequence, sequence, attn_mask=sliding, need_weights=False)[0]
    slow = window(sequence, sequence, sequence, attn_mask=sliding, need_weights=True)[0]
long_seq = {"NaN, need_weights=False": bool(fast.isnan().any()),
            "NaN, need_weights=True": bool(slow.isnan().any()),
            "largest difference": (fast - slow).abs().max().item()}
long_seq

# %%
assert not long_seq["NaN, need_weights=False"] and not long_seq["NaN, need_weights=True"]
assert long_seq["largest difference"] < 1e-5
print(f"on torch {torch.__version__} ({dev.type}): no NaN on either path; reported with NaN "
      "on 2.3")

# %%
# Every row of this mask keeps its own token, so no row is fully masked and no NaN is due.
# ``need_weights=False`` goes through SDPA's fused CPU kernel, which walks the keys in blocks;
# with a window of 10 tokens most blocks are fully masked for late queries, the case a
# blockwise softmax must handle without ``0 / 0``. On this torch both paths agree (asserted),
# and the thread is closed.

# %%
# Does the TransformerEncoderLayer fast path return NaN with an attention mask?
# -----------------------------------------------------------------------------
# Asked in `pytorch#118628 <https://github.com/pytorch/pytorch/issues/118628>`__:
# ``nn.TransformerEncoderLayer`` "predicts NaN in its fast path when provided with an
# attention mask" (an additive float bias, no dropout). The reader's repro, in ``eval()``
# under ``no_grad`` (the fast path's conditions), then with the fast path switched off:
layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, device=dev).eval()
src = torch.randn(3, 5, 8, device=dev)
attention_bias = torch.randn(5, 5, device=dev)
with torch.no_grad():
    fast_out = layer(src, src_mask=attention_bias)
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        slow_out = layer(src, src_mask=attention_bias)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    bool_out = layer(src, src_mask=torch.triu(torch.ones(5, 5, dtype=torch.bool, device=dev), 1))
encoder = {"fast path, float bias: NaN": bool(fast_out.isnan().any()),
           "fast path off, float bias: NaN": bool(slow_out.isnan().any()),
           "fast path, boolean causal mask: NaN": bool(bool_out.isnan().any())}
encoder

# %%
assert encoder == {"fast path, float bias: NaN": True, "fast path off, float bias: NaN": False,
                   "fast path, boolean causal mask: NaN": False}
print(f"on torch {torch.__version__} ({dev.type}): the fast path still turns a float bias "
      "into NaN; with the fast path off it is finite")

# %%
# The fast path's native attention treats a float mask as a boolean one, "masked where not
# 0" (the mechanism traced in #107084): a random bias has no zeros, so every position is
# masked, every row is ``-inf`` and the softmax returns NaN. The slow path adds the bias to
# the scores as documented. Fix: ``torch.backends.mha.set_fastpath_enabled(False)`` for a
# float bias, or pass a boolean mask. Both paths and autocast:
# :ref:`sphx_glr_docs_auto_examples_inference_plot_04_inference_mode_and_fast_path.py`.

# %%
# Which mask fill value is safe in fp16 and bf16?
# -----------------------------------------------
# Asked in `transformers#31303 <https://github.com/huggingface/transformers/pull/31303>`__
# (overflow of the bf16 mask) and
# `NeMo Automodel#2658 <https://github.com/NVIDIA-NeMo/Automodel/pull/2658>`__ ("summing two
# ``torch.finfo(dtype).min`` planes ... overflows bf16 to ``-inf``"). What each fill value
# becomes in each dtype when a second mask or a negative score is added to it:
fills, half_ulps = [], {}
for dt in (torch.float16, torch.bfloat16):
    lo = torch.finfo(dt).min
    one = torch.tensor(lo, dtype=dt, device=dev)
    half_ulps[dt] = (torch.nextafter(one, torch.zeros_like(one)) - one).item() / 2

    def plus(x, one=one, dt=dt):
        return (one + torch.tensor(x, dtype=dt, device=dev)).item()

    fills.append((str(dt).removeprefix("torch."), f"{lo:.4g}", (one + one).item(), plus(-100.0),
                  plus(-1.0), f"{half_ulps[dt]:.4g}", plus(-half_ulps[dt]),
                  plus(-torch.nextafter(torch.tensor(half_ulps[dt], dtype=dt),
                                        torch.tensor(0.0, dtype=dt)).item())))
fill = Table(("dtype", "finfo.min", "min + min", "min + (-100)", "min + (-1)", "half ulp h",
              "min - h", "min - (h less one step)"), tuple(fills),
             f"Additive mask values, torch {torch.__version__} on {dev.type}")
fill

# %%
fp16_row, bf16_row = fill.records()
inf = float("-inf")
assert fp16_row["min + min"] == bf16_row["min + min"] == inf
assert fp16_row["min + (-100)"] == inf and fp16_row["min + (-1)"] == torch.finfo(torch.float16).min
assert bf16_row["min + (-100)"] == bf16_row["min + (-1)"] == torch.finfo(torch.bfloat16).min
for row, dt in ((fp16_row, torch.float16), (bf16_row, torch.bfloat16)):
    assert row["min - h"] == inf and row["min - (h less one step)"] == torch.finfo(dt).min
assert half_ulps[torch.float16] == 16  # the prose's -16
print(
    f"on torch {torch.__version__} ({dev.type}): finfo.min + x overflows to -inf from x = "
    f"-{half_ulps[torch.float16]:g} in float16 and from x = -{half_ulps[torch.bfloat16]:.3g} in "
    "bfloat16 (half an ulp; a tie rounds to even, which is -inf); anything smaller stays finite, "
    "and finfo.min + finfo.min is -inf in both"
)

# %%
# ``finfo.min`` is the most negative finite value, so a sum that is more negative by half an
# ulp or more rounds to ``-inf``, and a smaller addition rounds back to ``finfo.min``: two masks
# added together overflow in either dtype, and in fp16 also a masked score of ``-16`` or below
# (``-100`` overflows, ``-1`` does not); bf16's half ulp there is the figure printed above, so a
# score cannot push it over. A row of ``-inf`` is NaN after softmax, a row of finite minima is a
# uniform average. Fixes: combine masks with ``torch.where`` or a boolean ``&`` before
# converting once to an additive mask, or pass a boolean mask to SDPA, which never adds to it.
# The formats' limits: :ref:`sphx_glr_docs_auto_examples_numerics_plot_01_formats.py`.

# %%
# Which SDPA backend runs, and how far is each from float64?
# ----------------------------------------------------------
# Asked in `transformers#47042 <https://github.com/huggingface/transformers/pull/47042>`__:
# "SDPA selects its backend on certain criteria and in this case we switched the backend from
# math to the memory-efficient one which always introduces slightly different outputs". Which
# backend SDPA picks for these inputs on this build, and each available backend's error:
from torch.nn.attention import SDPBackend, sdpa_kernel

gen = torch.Generator(device=dev).manual_seed(1)
qkv = [torch.randn(2, 8, 128, 64, generator=gen, device=dev) for _ in range(3)]
exact = F.scaled_dot_product_attention(*(t.double() for t in qkv))
picked = {str(dt).removeprefix("torch."): SDPBackend(torch._fused_sdp_choice(
    *(t.to(dt) for t in qkv))).name for dt in (torch.float32, torch.bfloat16, torch.float16)}
rows = []
for be in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
           SDPBackend.CUDNN_ATTENTION):
    for dt in (torch.bfloat16, torch.float16):
        try:
            with sdpa_kernel(be):
                out = F.scaled_dot_product_attention(*(t.to(dt) for t in qkv))
            err = (out.double() - exact).abs().max().item()
        except RuntimeError:
            err = None
        rows.append((be.name, str(dt).removeprefix("torch."), err, device.LIVE if err else ""))
backends_table = Table(("backend", "dtype", "max |error| vs float64", "how"), tuple(rows),
                       f"SDPA backends on {dev.type}, torch {torch.__version__}; default pick: "
                       + ", ".join(f"{d} -> {b}" for d, b in picked.items()))
backends_table

# %%
ran = [r for r in backends_table.records() if r["max |error| vs float64"] is not None]
assert {r["backend"] for r in ran} >= {"MATH"}
if dev.type == "cpu":
    assert set(picked.values()) == {"FLASH_ATTENTION"}
    assert {r["backend"] for r in ran} == {"MATH", "FLASH_ATTENTION"}
print(f"on torch {torch.__version__} ({dev.type}): {len(ran)} backend/dtype pairs ran; "
      f"errors from {min(r['max |error| vs float64'] for r in ran):.3g} to "
      f"{max(r['max |error| vs float64'] for r in ran):.3g}")

# %%
# SDPA picks the first backend whose constraints the inputs meet (dtype, head size, mask,
# device), so a change of mask, shape or dtype can move a model to another kernel. All keep
# float32 accumulators, and they differ in the order of their sums and in where they round, which
# is an error of the same order as the format's (the table). On a CPU the fused kernel is a
# flash-style one; on CUDA hardware the memory-efficient and cuDNN kernels run too (not on a CPU
# build of this page). Pin one with ``torch.nn.attention.sdpa_kernel`` when comparing runs. The
# math backend's float32 upcast:
# :ref:`sphx_glr_docs_auto_examples_questions_plot_03_precision_switches.py`.

# %%
# How do I run one attention block in float32 under autocast?
# -----------------------------------------------------------
# Asked in `efficientvit#110 <https://github.com/mit-han-lab/efficientvit/issues/110>`__
# (``qkv = qkv.float()`` removed, fp16 training NaN since) and
# `DeepSpeed#7883 <https://github.com/deepspeedai/DeepSpeed/pull/7883>`__ (nesting autocast).
# Nest ``autocast(enabled=False)`` and cast the inputs yourself:
block = nn.Linear(16, 48, device=dev)


def attention_fp32(x):
    q, k, v = block(x).chunk(3, dim=-1)  # projection under the outer autocast
    with torch.autocast(dev.type, enabled=False):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    return q, out, block(out)  # back under autocast


with torch.autocast(dev.type, dtype=torch.bfloat16):
    proj, inner, after = attention_fp32(torch.randn(2, 8, 16, device=dev))
nested = {"projection": proj.dtype, "attention inside enabled=False": inner.dtype,
          "next Linear, autocast again": after.dtype}
nested

# %%
assert nested == {"projection": torch.bfloat16, "attention inside enabled=False": torch.float32,
                  "next Linear, autocast again": torch.bfloat16}

# %%
# ``autocast(enabled=False)`` switches autocasting off for the block without touching the
# tensors: bf16 inputs stay bf16 (and a bf16 @ float32 matmul would fail), so cast them with
# ``.float()`` inside. On leaving, the outer autocast applies again. The same pattern keeps a
# softmax or a norm in float32. Mixing dtypes inside and outside autocast:
# :ref:`sphx_glr_docs_auto_examples_autocast_plot_01_mixing_dtypes.py`.

# %%
# What we saw
# -----------
# - A fully masked row is zeros through SDPA and NaN through a plain softmax, which
#   ``MultiheadAttention(need_weights=True)`` still uses.
# - The 2.3 sliding-window NaN is gone; the encoder fast path's NaN with a float bias is not.
# - ``finfo.min`` overflows to ``-inf`` when what is added reaches half an ulp: a second
#   ``finfo.min`` in fp16 and bf16, and in fp16 a score of ``-16`` or below; ``-1`` in fp16 and
#   ``-100`` in bf16 leave it finite.
# - This CPU build runs SDPA's math and flash backends and picks flash; their bf16 and fp16
#   errors against float64 are in the table.
# - Nested ``autocast(enabled=False)`` plus ``.float()`` keeps one block in float32.
#
# .. admonition:: References
#
#    :torchapi:`torch.nn.functional.scaled_dot_product_attention`,
#    :torchapi:`torch.nn.MultiheadAttention`, :torchapi:`torch.nn.TransformerEncoderLayer`,
#    :torchapi:`torch.nn.attention.sdpa_kernel`, :torchdoc:`amp.html`

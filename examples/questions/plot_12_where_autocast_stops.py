"""
Where autocast stops: FSDP2 policies, custom ops, SDPA
======================================================

Four questions of 2025-2026 about code that autocast does not reach, or reaches in a way the
reader did not expect: a model sharded by FSDP2 with a bf16 ``MixedPrecisionPolicy`` and no
autocast, a custom op (the wrapper of a Triton kernel) called under autocast, attention in a
model loaded in float32, and a float32 LoRA adapter on a bf16 base. Each is run here: FSDP2 for real (one process, gloo, the CPU),
the ops' dtypes read from a dispatch log, CUDA's autocast simulated on fake tensors where
this machine has no GPU. The answers on this torch: the policy casts parameters and inputs,
nothing per op, so softmax, norms and the loss run in bf16 until autocast or a ``.float()``
is added; a custom op gets whatever dtypes its callers hand it until
``torch.library.register_autocast`` casts them, eager and compiled alike; and a model loaded
in float32 hands float32 to SDPA unless autocast casts it; and a float32 LoRA adapter computes
in bf16 under autocast but keeps the small optimizer updates a bf16 adapter rounds away.
"""

# %%
# Setup
# -----
import copy

import torch
import torch.nn.functional as F
from torch import nn

from mpguide.core import device, dtypes
from mpguide.core.table import Table
from mpguide.training import distributed
from mpguide.training.op_dtypes import compute_dtypes

device.describe("cpu")
bf16, f32 = torch.bfloat16, torch.float32
cuda = device.target("cuda")  # live where this machine has a GPU, else simulated
print(f"CUDA rows: {device.label('cuda', cuda.how)}")

# %%
# Does FSDP2's MixedPrecisionPolicy run softmax and the loss in float32?
# ----------------------------------------------------------------------
# Asked in `torchtitan#700 <https://github.com/pytorch/torchtitan/issues/700>`__ ("Is
# ``autocast`` needed with FSDP2? ... my softmaxes (say) will be in ``float32``. This behavior
# requires the autocast wrapper"), `torchtitan#600 <https://github.com/pytorch/torchtitan/issues/600>`__
# ("How would this affect specific operations in the layer, such as the SoftMax, which
# typically run in FP32?"), with awgu's answer in `pytorch#105348
# <https://github.com/pytorch/pytorch/issues/105348>`__ for FSDP1.
# A small language model (embedding, two attention blocks with LayerNorm and softmax, a head)
# sharded with ``MixedPrecisionPolicy(param_dtype=bfloat16)``, one forward and the
# cross-entropy, without and with autocast; the dtype each op family computed into, from a
# dispatch log:
VOCAB, WIDTH = 512, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        q, k, v = self.qkv(self.norm(h)).chunk(3, -1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / WIDTH**0.5, -1)
        return h + self.out(weights @ v)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(Block(), Block())
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        return self.head(self.norm(self.blocks(self.emb(tokens))).flatten(0, 1))


gen = torch.Generator().manual_seed(0)
tokens = torch.randint(0, VOCAB, (4, 64), generator=gen)
targets = torch.randint(0, VOCAB, (4 * 64,), generator=gen)
torch.manual_seed(0)
reference = TinyLM()


def loss_of(model, autocast_on=False, upcast=False):
    """Forward and cross-entropy on this machine; the loss and the op families' dtypes."""
    with dtypes.Log() as log, torch.autocast("cpu", dtype=bf16, enabled=autocast_on):
        logits = model(tokens)
        loss = F.cross_entropy(logits.float() if upcast else logits, targets)
    return loss, compute_dtypes(log)


from torch.distributed.fsdp import MixedPrecisionPolicy

runs = {}
with distributed.process_group():
    for name, on, up in (("FSDP2 bf16, no autocast", False, False),
                         ("FSDP2 bf16 + autocast (cpu)", True, False),
                         ("FSDP2 bf16, logits.float()", False, True)):
        model = distributed.shard(copy.deepcopy(reference), MixedPrecisionPolicy(param_dtype=bf16))
        runs[name] = loss_of(model, on, up)
runs["float32, unsharded"] = loss_of(reference)

# %%
# The same model with its parameters in bf16 (what FSDP2 all-gathers), under CUDA's autocast
# (live on a GPU, else simulated on fake CUDA tensors; the table's header says which):
with torch.no_grad():
    on_cuda = copy.deepcopy(reference).to(bf16)
    with device.tensors(cuda, [on_cuda]), device.autocast(cuda, bf16), dtypes.Log() as log:
        logits = on_cuda(device.move(tokens, cuda))
        cuda_loss_dtype = F.cross_entropy(logits, device.move(targets, cuda)).dtype
cuda_dtypes = compute_dtypes(log)
families = ("matmul", "softmax", "layer norm", "log_softmax (cross-entropy)", "nll loss")
policy_ops = Table(
    ("run", *families, "loss dtype"),
    (
        *((name, *(d.get(f, "") for f in families), dtypes.name(loss.dtype))
          for name, (loss, d) in runs.items()),
        (f"bf16 parameters + autocast ({device.label('cuda', cuda.how)})",
         *(cuda_dtypes.get(f, "") for f in families), dtypes.name(cuda_loss_dtype)),
    ),
    f"output dtype of each op family; FSDP2 live on cpu, world size 1, torch {torch.__version__}",
)
policy_ops

# %%
plain, autocast_cpu = runs["FSDP2 bf16, no autocast"][1], runs["FSDP2 bf16 + autocast (cpu)"][1]
assert all(plain[f] == "bfloat16" for f in families), plain
assert autocast_cpu["log_softmax (cross-entropy)"] == autocast_cpu["nll loss"] == "float32"
assert autocast_cpu["softmax"] == autocast_cpu["layer norm"] == "bfloat16"
assert cuda_dtypes["softmax"] == cuda_dtypes["layer norm"] == cuda_dtypes["nll loss"] == "float32"
assert cuda_dtypes["log_softmax (cross-entropy)"] == cuda_dtypes["matmul"] == "bfloat16"
print(f"on torch {torch.__version__}: with the policy alone every family runs in bf16; CPU "
      "autocast lifts only the cross-entropy to float32; CUDA autocast lifts softmax, "
      "LayerNorm and nll_loss, but the cross-entropy's log_softmax stays bf16")

# %%
# The policy casts the all-gathered parameters to ``param_dtype`` and the block inputs with
# them; it registers nothing per op, so every op family in the table runs in the dtype its
# inputs arrive in, bf16 (the first row), as awgu answered in #600. Autocast is a
# dispatcher mode that runs on top: under it the ops on its float32 list get float32 inputs.
# Which ops are on that list depends on the device: the CPU's list has the whole
# cross-entropy but not softmax or the layer norm (live row); CUDA's has softmax, the layer
# norm, ``log_softmax`` and ``nll_loss`` (last row). Yet on CUDA the cross-entropy's
# ``log_softmax`` still ran in bf16:
# ``cross_entropy`` calls it with ``dtype=`` its input's dtype, and autocast leaves an op
# called with an explicit ``dtype`` alone, so only the ``nll_loss`` after it gets float32.
# So a loop without autocast computes the attention softmax and the loss from bf16 logits,
# and a loop with CUDA autocast still takes the log-softmax of bf16 logits in bf16, unless
# the model casts them itself.
#
# What a bf16 loss costs: the loss is one bf16 number, rounded to 8 significant bits.
fp32_loss = runs["float32, unsharded"][0].item()
bf16_loss = runs["FSDP2 bf16, no autocast"][0]
spacing = (torch.nextafter(bf16_loss, torch.tensor(100.0, dtype=bf16)) - bf16_loss).item()
quantised = Table(
    ("run", "loss", "loss dtype", "|loss - float32 loss|"),
    tuple((name, loss.item(), dtypes.name(loss.dtype), abs(loss.item() - fp32_loss))
          for name, (loss, _) in runs.items()),
    f"bf16 values near this loss are {spacing:g} apart",
)
quantised

# %%
upcast_gap = abs(runs["FSDP2 bf16, logits.float()"][0].item() - fp32_loss)
plain_gap = abs(bf16_loss.item() - fp32_loss)
assert bf16_loss.dtype == bf16 and runs["FSDP2 bf16, logits.float()"][0].dtype == f32
assert upcast_gap < plain_gap and spacing >= 2 ** -6
print(f"the bf16 loss can only move in steps of {spacing:g}; it is {plain_gap:.4f} from the "
      f"float32 loss, the loss from logits.float() {upcast_gap:.4f}")

# %%
# A bf16 loss near 6 moves in steps of 1/32: loss curves look stepped, and a logged loss is
# off by up to half a step. ``logits.float()`` before the cross-entropy (or
# ``MixedPrecisionPolicy(output_dtype=torch.float32)`` on the root, which casts the model's
# output) makes the log-softmax and the loss float32; the remaining gap is the bf16 model's
# own error. For softmax and norms inside the blocks, wrap the forward in autocast too, or
# write the ``.float()`` into the model: the two compose (#105348: "autocast operates at the
# dispatcher level, its behavior will take precedence"). More on the policy's dtypes:
# :ref:`sphx_glr_docs_auto_examples_questions_plot_07_fsdp2_policy.py`.

# %%
# Does autocast cast the inputs of my custom op?
# ----------------------------------------------
# Asked in `pytorch#137033 <https://github.com/pytorch/pytorch/issues/137033>`__
# ("amp.custom_fwd has incomplete support for library.custom_op"), answered by
# ``torch.library.register_autocast`` in `pytorch#145588 <https://github.com/pytorch/pytorch/pull/145588>`__,
# and `pytorch#181127 <https://github.com/pytorch/pytorch/pull/181127>`__ (its input casting
# merged with autocast's own). A custom op standing for a Triton kernel that wants float32,
# called on a bf16 activation (a linear under autocast) and a float32 tensor, before and
# after the registration, eager and compiled (``aot_eager``: the graph inductor would get):
received = []


@torch.library.custom_op("mpguide_questions::scale_add", mutates_args=())
def scale_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    received.append((dtypes.name(x.dtype), dtypes.name(y.dtype)))
    return x * 2 + y


@scale_add.register_fake
def _(x, y):
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, y.dtype), device=x.device)


scale_add.register_autograd(lambda ctx, grad: (grad * 2, grad))
linear = nn.Linear(8, 8)
act, other = torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)


def layer(a, b):
    return scale_add(linear(a), b)


def dtypes_received(compiled):
    fn = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=bf16):
        out = fn(act, other)
    return (" + ".join(received[-1]), dtypes.name(out.dtype))


custom = {("not registered", c): dtypes_received(c) for c in (False, True)}
torch.library.register_autocast("mpguide_questions::scale_add", "cpu", f32)
custom |= {("register_autocast(cpu, float32)", c): dtypes_received(c) for c in (False, True)}
custom_ops = Table(
    ("registration", "compiled", "inputs the op received", "output"),
    tuple((reg, c, *got) for (reg, c), got in custom.items()),
    f"under autocast('cpu', bfloat16), live on cpu, torch {torch.__version__}",
)
custom_ops

# %%
assert custom[("not registered", False)] == custom[("not registered", True)] == (
    "bfloat16 + float32", "float32")
assert all(custom[("register_autocast(cpu, float32)", c)][0] == "float32 + float32"
           for c in (False, True))
print(f"on torch {torch.__version__}: unregistered, the op gets bf16 + float32 as its callers "
      "made them; registered, float32 + float32, eager and compiled alike")

# %%
# Autocast has a kernel for each op on its lists and falls through for every other op,
# custom ops included: the op receives what its callers produced, here a bf16 activation
# beside a float32 tensor, which a Triton kernel expecting one dtype misreads. Type
# promotion rescued this op in PyTorch (``x * 2 + y`` gave float32); a kernel that loads raw
# pointers gets no such rescue. ``torch.library.register_autocast(op, device_type, dtype)``
# registers a kernel that casts the floating inputs to ``dtype`` and runs the op with
# autocast off, and dynamo traces through it, so the compiled graph casts too (the
# ``compiled`` rows). Register it once per device type the op runs on (``"cuda"`` for a
# Triton kernel).

# %%
# Is Flash Attention used when my model is loaded in float32?
# -----------------------------------------------------------
# Asked in `EasyR1#571 <https://github.com/hiyouga/EasyR1/issues/571>`__ (transformers warns
# "Flash Attention 2 only supports torch.float16 and torch.bfloat16 dtypes, but the current dtype
# in Qwen2_5_VLModel is torch.float32") and
# `verl#1498 <https://github.com/verl-project/verl/issues/1498>`__ (the same warning for
# Qwen3ForCausalLM), when the actor is loaded in float32 (FSDP then casts it
# with its policy, or autocast wraps the step). A small Llama built from a config, with
# ``attn_implementation="sdpa"``, loaded in float32, run without and with autocast, and
# loaded in bf16; the dtype ``scaled_dot_product_attention`` ran in (its result's dtype, after
# autocast) and the backend SDPA picks for it:
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from torch.nn.attention import SDPBackend
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=4, attn_implementation="sdpa")
llama = LlamaForCausalLM(config).eval()
ids = torch.randint(0, 256, (1, 16), generator=gen)


class AttentionDtypes(torch.overrides.TorchFunctionMode):
    """The dtype of every ``scaled_dot_product_attention`` result: after autocast, so the
    dtype the attention ran in."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.scaled_dot_product_attention:
            self.seen.append(dtypes.name(out.dtype))
        return out


def attention_dtype(model, dev, autocast_dtype):
    """The dtype the first attention ran in, on ``dev`` (live or simulated)."""
    with torch.no_grad(), device.tensors(dev, [model]), device.autocast(dev, autocast_dtype), \
            AttentionDtypes() as mode:
        model(device.move(ids, dev))
    return mode.seen[0]


cpu = device.target("cpu")
loaded = {"loaded float32": (llama, None), "loaded float32 + autocast bf16": (llama, bf16),
          "loaded bf16": (copy.deepcopy(llama).to(bf16), None)}
attention = {}
for name, (model, ac) in loaded.items():
    got_cpu = attention_dtype(model, cpu, ac)
    q = torch.randn(1, 4, 16, 16).to(dtypes.parse(got_cpu))
    backend = SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name
    attention[name] = (got_cpu, backend, attention_dtype(model, cuda, ac))
sdpa_rows = Table(
    ("model", "attention dtype (cpu)", "backend chosen (cpu)",
     f"attention dtype ({device.label('cuda', cuda.how)})"),
    tuple((name, *got) for name, got in attention.items()),
    f"transformers LlamaForCausalLM (1 layer), attn_implementation='sdpa', torch {torch.__version__}",
)
sdpa_rows

# %%
assert attention["loaded float32"][0] == attention["loaded float32"][2] == "float32"
assert attention["loaded float32 + autocast bf16"][0] == "bfloat16"
assert attention["loaded float32 + autocast bf16"][2] == "bfloat16"
assert attention["loaded bf16"][0] == "bfloat16"
assert {got[1] for got in attention.values()} == {"FLASH_ATTENTION"}
print(f"on torch {torch.__version__}: a float32 model hands float32 to SDPA; autocast hands "
      "bf16 on cpu and cuda; the CPU's flash kernel takes every one of these dtypes")

# %%
# The warning is transformers checking the model's dtype at load time; what attention gets
# is decided per call. Under autocast SDPA is on the lower-precision list of both devices, so
# a float32 model's attention ran in bf16 (second row; the CUDA column's header says whether it ran live or was simulated); the query, key and value come out of
# linear layers, which autocast also runs in bf16, so a ``flash_attention_2`` implementation
# is handed bf16 as well. That is hiyouga's answer in EasyR1#571 ("You can safely ignore this
# warning") for a step run under autocast. Without autocast a float32 model runs float32
# attention: the CPU's flash kernel takes float32 (the backend column), but the CUDA
# flash-attention kernels do not (tridao in `flash-attention#622
# <https://github.com/Dao-AILab/flash-attention/issues/622>`__: "fp32 is not supported"), so
# on a GPU SDPA must pick another backend for float32. Which one each dtype gets depends on
# the GPU and is checked when this page runs on one:
if cuda.how == device.LIVE:
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    gpu_rows = []
    for dt in (f32, torch.float16, bf16):
        q = torch.randn(1, 4, 128, 64, device="cuda", dtype=dt)
        params = SDPAParams(q, q, q, None, 0.0, True, False)
        gpu_rows.append((dtypes.name(dt), can_use_flash_attention(params, False),
                         can_use_efficient_attention(params, False),
                         SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name))
    gpu_backends = Table(("dtype", "flash usable", "efficient usable", "chosen"), tuple(gpu_rows),
                         f"live on {device.describe('cuda').caption()}")
    assert gpu_rows[0][1] is False and gpu_rows[2][3] != "MATH"
    print(gpu_backends)
else:
    print("CUDA backend per dtype: not recorded yet (this page checks it when built on a GPU)")

# %%
# Should my LoRA adapter be float32 on a bf16 base, and what runs in float32 then?
# --------------------------------------------------------------------------------
# Asked in `peft#2421 <https://github.com/huggingface/peft/issues/2421>`__ ("Adapters saved in
# float16 are loaded in float32"; BenjaminBossan: "When LoRA is loaded, by default, it is
# always cast to float32"), the change that made it so, `peft#1706
# <https://github.com/huggingface/peft/pull/1706>`__, and `AgileRL#623
# <https://github.com/AgileRL/AgileRL/pull/623>`__ ("Under bf16 autocast ``F.linear``
# autocasts both operands to bf16 regardless"). A bf16 ``Linear(64, 64)`` with a rank-8
# adapter computed as PEFT's LoRA layer computes it
# (:class:`mpguide.training.lora_precision.LoRALinear`: the input cast to the adapter's
# dtype, the sum cast back to the base's), one forward and backward on a bf16 input, with a
# float32 or a bf16 adapter, without and with autocast:
from mpguide.training import lora_precision

lora_runs = {}
for adapter_dtype in (f32, bf16):
    for on in (False, True):
        lora = lora_precision.adapter(adapter_dtype)
        with dtypes.Log() as log, torch.autocast("cpu", dtype=bf16, enabled=on):
            lora(torch.randn(4, 64, generator=gen).to(bf16)).float().sum().backward()
        matmuls = [c for c in log.calls if c.op in ("aten.mm.default", "aten.addmm.default")]
        lora_runs[(dtypes.name(adapter_dtype), on)] = (
            dtypes.name(matmuls[0].out),
            " + ".join(dict.fromkeys(dtypes.name(c.out) for c in matmuls[1:])),
            dtypes.name(lora.lora_A.weight.grad.dtype),
        )
Table(("adapter", "autocast", "base matmul", "adapter matmuls (fwd + bwd)", "adapter grad"),
      tuple((a, on, *got) for (a, on), got in lora_runs.items()),
      f"live on cpu, torch {torch.__version__}")

# %%
assert lora_runs[("float32", False)] == ("bfloat16", "float32", "float32")
assert lora_runs[("float32", True)] == ("bfloat16", "bfloat16", "float32")
assert lora_runs[("bfloat16", False)] == lora_runs[("bfloat16", True)] == (
    "bfloat16", "bfloat16", "bfloat16")
print(f"on torch {torch.__version__}: a float32 adapter computes in float32 without autocast "
      "and in bf16 under it; its gradients are float32 either way")

# %%
# Under autocast the adapter's matmuls run in bf16 whatever its weights' dtype, so the
# float32 copy of the input that the layer makes is cast straight back (AgileRL#623 drops
# it to save memory). What float32 adapter weights buy is the optimizer's update. The same
# adapter trained towards a fixed target with AdamW at ``lr=1e-4``, its weights in float32
# and in bf16:
kept = lora_precision.kept_update(steps=20, lr=1e-4)
typical = lora_precision.adapter(f32).lora_A.weight.detach().abs().median()
spacing_a = (torch.nextafter(typical.to(bf16), torch.tensor(1.0, dtype=bf16)) - typical.to(bf16)).item()
print(f"median |A| {typical.item():.3f}, bf16 spacing there {spacing_a:.2e}, lr {kept.lr:g}")
print(f"elements of A the first step that reaches A left unchanged: {kept.unchanged_first_step}")
print(f"after {kept.steps} steps, |change of A|: {kept.update_norm}; the bf16 change differs "
      f"from the float32 one by {kept.lost:.0%} of it")

# %%
assert kept.unchanged_first_step["float32"] == 0.0
assert kept.unchanged_first_step["bfloat16"] > 0.5 and kept.lost > 0.5
assert kept.update_norm["bfloat16"] < 0.8 * kept.update_norm["float32"]
assert spacing_a > kept.lr
print(f"the bf16 adapter moved {kept.update_norm['bfloat16'] / kept.update_norm['float32']:.2f} "
      "as far as the float32 one")

# %%
# AdamW moves each weight by about ``lr`` per step; at ``A``'s typical magnitude bf16's
# spacing is larger than ``lr`` (printed above), so most of a step rounds away and the bf16
# adapter moved a fraction of the float32 one's distance in 20 steps (printed). Keep the adapter (the trained weights) in float32, PEFT's default
# since #1706, and run the forward under autocast: the matmuls are bf16 and the updates
# kept. ``autocast_adapter_dtype=False`` (bf16 adapter weights) saves a few megabytes and
# loses most small updates. Where else float32 master weights matter:
# :ref:`sphx_glr_docs_auto_examples_questions_plot_06_training_precision.py`.

# %%
# What we saw
# -----------
# - FSDP2's ``MixedPrecisionPolicy`` left every op family in bf16 here; CPU autocast lifted
#   the cross-entropy to float32; CUDA autocast (simulated or live, as labelled) lifted
#   softmax, LayerNorm and ``nll_loss`` but left the cross-entropy's ``log_softmax`` on bf16
#   logits in bf16; a bf16 loss moves in steps of 1/32 near 6, and ``logits.float()``
#   removes that step.
# - A custom op received bf16 + float32 under autocast until
#   ``torch.library.register_autocast`` cast its inputs, eager and under ``aot_eager``.
# - A float32 Llama handed float32 to SDPA; autocast made it bf16; the CPU's flash kernel
#   took float32, bf16 and the autocast case alike.
# - A float32 LoRA adapter on a bf16 base computed in float32 without autocast and in bf16
#   under it, with float32 gradients; with bf16 weights most of a small AdamW step rounded
#   away.
#
# .. admonition:: References
#
#    :torchdoc:`distributed.fsdp.fully_shard.html`, :torchdoc:`amp.html`,
#    :torchapi:`torch.library.register_autocast`,
#    :torchapi:`torch.nn.functional.scaled_dot_product_attention`

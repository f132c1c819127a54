"""
Dtypes under torch.compile: readers' questions
==============================================

Seven questions about the dtypes compiled code creates, accepts, rejects and differentiates
in, each reduced from the reader's thread and run here eagerly and compiled (``aot_eager``,
which traces the same ATen graph inductor gets, and inductor where the question is about its
kernels). The answers on this torch: a factory given ``dtype=`` creates that dtype compiled as
eagerly, while under a bf16 default dtype without ``dtype=`` inductor's ``randn`` differs from
eager and ``aot_eager`` (the dtypes are printed below); a float16 @ float32 matmul fails
compiled as it fails eagerly; autocast casts a float mask of SDPA with the key and value; a bf16
``Linear`` plus a float32 tensor gives float32 in both; the compiled backward runs under the
forward's autocast unless told otherwise, which is why an inner ``autocast(enabled=False)``
changes the gradients; and activation checkpointing recomputes under the forward's autocast.
"""

# %%
# Setup
# -----
import logging
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from mpguide import error_line
from mpguide.core import device, dtypes, versions

dev = device.pick()
device.describe(dev)
torch.manual_seed(0)


@contextmanager
def quiet_fake_tensor_log():
    """Dynamo logs the traceback of a fake-tensor error before it raises; the page prints
    the raised error itself."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def outcome(fn, *args):
    """The output dtype, or the error as one line: the error raised, and for an error that
    wraps another (Dynamo's), the one it wraps."""
    try:
        with quiet_fake_tensor_log():
            return str(fn(*args).dtype)
    except Exception as err:  # noqa: BLE001 -- an error is the finding
        root = err
        while (root.__cause__ or root.__context__) is not None:
            root = root.__cause__ or root.__context__
        return error_line(err) if root is err else f"{type(err).__name__} from {error_line(root)}"


# %%
# Why is a tensor created inside a compiled function float32?
# -----------------------------------------------------------
# Asked in `pytorch#138015 <https://github.com/pytorch/pytorch/issues/138015>`__ (on an
# older release, named in the thread): with ``torch.set_default_dtype(torch.bfloat16)``, a
# compiled ``torch.randn(1, dtype=torch.bfloat16)`` came back float32. The reader's repro:
def make():
    return torch.randn(1, dtype=torch.bfloat16, device=dev)


def make_default():
    return torch.randn(1, device=dev)


def zeros_default():
    return torch.zeros(2, device=dev)


FACTORIES = {
    "randn, dtype=bfloat16": make,
    "randn, default dtype": make_default,
    "zeros, default dtype": zeros_default,
}
previous = torch.get_default_dtype()
torch.set_default_dtype(torch.bfloat16)
try:
    created = {}
    for what, fn in FACTORIES.items():
        created[what, "eager"] = fn().dtype
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            created[what, backend] = torch.compile(fn, backend=backend)().dtype
finally:
    torch.set_default_dtype(previous)
    torch._dynamo.reset()
created

# %%
bf16 = torch.bfloat16
assert all(created["randn, dtype=bfloat16", b] == bf16 for b in ("eager", "aot_eager", "inductor"))
assert all(created[w, b] == bf16 for w in FACTORIES for b in ("eager", "aot_eager"))
inductor_randn = created["randn, default dtype", "inductor"]
inductor_zeros = created["zeros, default dtype", "inductor"]
assert inductor_zeros == bf16
if dev.type == "cpu":
    assert inductor_randn == torch.float32
print(
    f"on torch {torch.__version__} ({dev.type}): with dtype= every backend gives bfloat16; "
    f"under a bfloat16 default without dtype=, eager and aot_eager give bfloat16, inductor's "
    f"randn gives {dtypes.name(inductor_randn)} and its zeros {dtypes.name(inductor_zeros)}"
)

# %%
# With ``dtype=`` the graph creates the dtype asked for under both backends: the thread's float32
# for an explicit ``dtype=torch.bfloat16`` is gone on this torch. Without ``dtype=`` the two
# backends part: Dynamo reads the default dtype when it traces, so ``aot_eager``'s graph (the ATen
# graph inductor is handed) creates bfloat16, but inductor's lowering of ``randn`` emits its random
# numbers in float32 on the CPU (the dtype printed above, asserted on the CPU) while its ``zeros``
# keeps the default. So inside code that ``torch.compile`` (inductor, the default backend) compiles,
# pass ``dtype=`` to every factory rather than rely on ``set_default_dtype``. A function compiled
# under one default dtype and called under another recompiles only if Dynamo guarded on it, so set
# the default dtype before the first call.

# %%
# Does compile accept an fp16 @ fp32 matmul that eager rejects?
# -------------------------------------------------------------
# Asked in `pytorch#172183 <https://github.com/pytorch/pytorch/issues/172183>`__ ("torch.compile
# silently bypasses dtype mismatch checks" in an attention whose weights were cast to float16
# while the values stayed float32) and
# `#171994 <https://github.com/pytorch/pytorch/issues/171994>`__ (float16 input, float32
# parameters). The reader's attention step, reduced:
def attention_fp16_weights(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / 4, dim=-1).to(torch.float16)
    return weights @ v


q, k, v = (torch.randn(2, 4, 8, 16, device=dev) for _ in range(3))
mixed = {
    "eager": outcome(attention_fp16_weights, q, k, v),
    "aot_eager": outcome(torch.compile(attention_fp16_weights, backend="aot_eager"), q, k, v),
    "inductor": outcome(torch.compile(attention_fp16_weights), q, k, v),
}
mixed

# %%
rejects = versions.change("compile_rejects_mixed_matmul")
assert "RuntimeError: expected scalar type" in mixed["eager"]
if rejects.holds:
    assert all("RuntimeError: expected scalar type" in r for r in mixed.values())
elif dev.type == "cpu":  # what the release note says, measured on the CPU
    assert mixed["inductor"] == "torch.float32"
print(f"on torch {torch.__version__} ({dev.type}): {rejects.describe()}"
      + ("" if rejects.holds or dev.type == "cpu" else f"; inductor here: {mixed['inductor']}"))

# %%
# ``matmul`` does not promote: both operands must have one dtype (the eager message here is
# ``expected scalar type Float but found Half``; ``F.linear`` says
# ``expected m1 and m2 to have the same dtype``). Compiling runs the same checks on fake tensors
# while tracing, so from 2.12 on the error comes before any kernel runs; on 2.11 inductor
# compiled the mixed matmul on the CPU and returned float32, the thread's silent pass (which it
# saw on CUDA hardware, where an inductor pattern replaced the whole attention; not reproduced
# here). The fix in either case: cast ``weights`` and ``v`` to one dtype, or run the block under
# autocast (see :ref:`sphx_glr_docs_auto_examples_autocast_plot_01_mixing_dtypes.py`).

# %%
# Does compile fuse a bf16 Linear and an fp32 add into one addmm?
# ---------------------------------------------------------------
# Asked in `pytorch#159492 <https://github.com/pytorch/pytorch/issues/159492>`__: a bf16
# ``Linear`` followed by ``+ w`` with a float32 ``w`` works eagerly, and crashed compiled on
# CUDA hardware because inductor fused both into one ``addmm`` that needs equal widths. The
# repro, live on this build's device:
lin = nn.Linear(64, 64, bias=False, device=dev).bfloat16()
w = torch.randn(64, 64, device=dev)


def linear_then_add(x):
    return lin(x) + w


x = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
fused = {"eager": outcome(linear_then_add, x),
         "inductor": outcome(torch.compile(linear_then_add), x)}
fused

# %%
assert fused["eager"] == "torch.float32"
if dev.type == "cpu":  # a CPU build does not run the CUDA pattern of the thread
    assert fused["inductor"] == "torch.float32"
if fused["inductor"] == "torch.float32":
    print(f"on torch {torch.__version__} ({dev.type}): both give float32 (the add promotes); the "
          "CUDA addmm crash of the thread is not reproduced on this device")
else:
    print(f"on torch {torch.__version__} ({dev.type}): eager gives float32 (the add promotes); "
          f"inductor: {fused['inductor']}")

# %%
# Eager runs the matmul in bf16 and lets the add promote to float32. An ``addmm`` computes
# ``bias + a @ b`` in one dtype, so fusing the add into it is only valid when ``w`` has the
# matmul's dtype; the CUDA pattern skipped that check (the thread's report from hardware; a CPU
# build does not run that pattern). Until a build has the fix, keep the add's operands in one
# dtype: ``lin(x).float() + w`` or ``lin(x) + w.bfloat16()``.

# %%
# Does vector_norm with a bf16 out= tensor compile?
# -------------------------------------------------
# Asked in `pytorch#154982 <https://github.com/pytorch/pytorch/issues/154982>`__ on a 2.8
# nightly: "the expected output tensor is of type float, but at runtime it is actually
# torch.bfloat16". The reader's repro:
def norm_into(x, out):
    return torch.linalg.vector_norm(x, ord=2, out=out)


data = torch.tensor([1.0], dtype=torch.bfloat16, device=dev)
norms = {
    "eager": outcome(norm_into, data, torch.empty((), dtype=torch.bfloat16, device=dev)),
    "aot_eager": outcome(torch.compile(norm_into, backend="aot_eager"), data,
                         torch.empty((), dtype=torch.bfloat16, device=dev)),
}
norms

# %%
assert norms == {"eager": "torch.bfloat16", "aot_eager": "torch.bfloat16"}
print(f"on torch {torch.__version__}: compiles and writes bf16 into out=")

# %%
# ``vector_norm`` of a bf16 input accumulates in float32; its reference decomposition used to
# return that float32 value for ``out=`` instead of casting it to ``out``'s dtype, so the
# meta function's check failed while tracing. On this torch the decomposition casts back.

# %%
# Does the compiled backward see my inner autocast(enabled=False)?
# ----------------------------------------------------------------
# Asked in `pytorch#179804 <https://github.com/pytorch/pytorch/issues/179804>`__ ("Eager and
# compiled paths should bitwise match"), with
# `#194329 <https://github.com/pytorch/pytorch/issues/194329>`__, and documented by
# `#175241 <https://github.com/pytorch/pytorch/pull/175241>`__ and
# `#156780 <https://github.com/pytorch/pytorch/pull/156780>`__. The reader's repro, on this
# build's device (the thread used CUDA; CPU autocast has the same structure):
import torch._functorch.config as functorch_config

lin = nn.Linear(64, 64, device=dev)
h = torch.randn(4, 64, dtype=torch.bfloat16, device=dev, requires_grad=True)


def inner_fp32(x):
    with torch.autocast(dev.type, enabled=False):
        return x.float() @ lin.weight.float().T


def weight_grad(fn):
    lin.weight.grad = None
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        out = fn(h)
    out.sum().backward()
    return lin.weight.grad.clone()


assert functorch_config.backward_pass_autocast == "same_as_forward"  # the default
eager_grad = weight_grad(inner_fp32)
torch._dynamo.reset()
default_grad = weight_grad(torch.compile(inner_fp32, backend="aot_eager"))
torch._dynamo.reset()
with functorch_config.patch(backward_pass_autocast="off"):
    off_grad = weight_grad(torch.compile(inner_fp32, backend="aot_eager"))
backward = {
    "compiled, default: equals eager": torch.equal(default_grad, eager_grad),
    "compiled, largest difference": (default_grad - eager_grad).abs().max().item(),
    'compiled, backward_pass_autocast="off": equals eager': torch.equal(off_grad, eager_grad),
}
backward

# %%
assert not backward["compiled, default: equals eager"]
assert backward['compiled, backward_pass_autocast="off": equals eager']
print(f"on torch {torch.__version__} ({dev.type}): the compiled weight gradient differs from "
      'eager by default and equals it with backward_pass_autocast="off"')

# %%
# Eager autograd runs the backward where ``backward()`` is called, outside any autocast here,
# so the backward matmuls of the float32 region run in float32. AOTAutograd traces the
# backward when it compiles the forward and, by default
# (``torch._functorch.config.backward_pass_autocast = "same_as_forward"``), under the
# forward's outer autocast: the inner ``enabled=False`` no longer covers the backward's
# matmuls, which run in bf16. Setting the switch to ``"off"`` (backward outside autocast, as
# the AMP docs recommend) restores eager's gradient. Backward casts in depth:
# :ref:`sphx_glr_docs_auto_examples_autograd_plot_03_backward_under_autocast.py`.

# %%
# Why do I get invalid dtype for bias with compile and autocast?
# --------------------------------------------------------------
# Asked in `pytorch#124901 <https://github.com/pytorch/pytorch/issues/124901>`__ and
# `#121631 <https://github.com/pytorch/pytorch/issues/121631>`__:
# ``RuntimeError: invalid dtype for bias - should match query's dtype`` from a Llama block
# compiled under fp16 autocast with a float attention mask. Reduced: a bf16 query (a projection
# under autocast), float32 key and value, and a float32 additive mask, under bf16 autocast, live
# on the CPU, and on CUDA live where this machine has a GPU, else simulated (this build's
# dispatch rules on fake tensors):
from mpguide.autocast import policy


def attention_with_mask(d):
    q = torch.randn(1, 2, 8, 16, device=d, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 8, 16, device=d) for _ in range(2))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(1, 1, 8, 8, device=d))


masked = {
    t.device.type: (t, policy.observe(attention_with_mask, t, torch.bfloat16))
    for t in (device.target("cpu"), device.target("cuda"))
}
bias = {
    device.label(where, t.how): (
        f"output {dtypes.name(run.out)}; casts before the op: "
        + ", ".join(f"{dtypes.short(a)}->{dtypes.short(b)}" for a, b in run.casts[:3])
    )
    for where, (t, run) in masked.items()
}
bias

# %%
f32_to_bf16 = (torch.float32, torch.bfloat16)
for where, (_, run) in masked.items():
    assert run.out == torch.bfloat16 and run.casts[:3] == (f32_to_bf16,) * 3, where
cpu_kernel = next(c for c in masked["cpu"][1].calls if "attention" in c.op)
assert cpu_kernel.ins == (torch.bfloat16,) * 4
print(
    f"on torch {torch.__version__}: autocast casts key, value and mask to bf16 "
    f"({len(masked['cpu'][1].casts)} casts on the CPU); the CPU kernel "
    f"{cpu_kernel.op.removesuffix('.default')} gets "
    f"{' + '.join(dtypes.name(d) for d in cpu_kernel.ins)}"
)

# %%
# Under autocast, ``scaled_dot_product_attention`` is a lower-precision op on both devices: every
# floating input is cast to the autocast dtype, the float mask included (the three float32 to
# bf16 casts asserted above; key, value and mask), so on this torch the kernel never sees a
# float32 mask beside a bf16 query and the thread's error does not arise from this call under
# autocast. It arises where the mask reaches the kernel uncast: SDPA called outside autocast
# with a bf16 query and a float32 mask. The CPU kernel accepts that pair
# (:ref:`sphx_glr_docs_auto_examples_training_plot_03_norms_and_masks.py` shows it); the CUDA
# efficient-attention kernel requires the bias dtype to equal the query's and raises (the
# thread's report from hardware, not reproduced here). The fix on every device: build the mask
# in the query's dtype (``mask.to(q.dtype)``).

# %%
# Does activation checkpointing recompute under the same autocast?
# ----------------------------------------------------------------
# Asked in `pytorch#141896 <https://github.com/pytorch/pytorch/issues/141896>`__,
# `#159359 <https://github.com/pytorch/pytorch/issues/159359>`__ and
# `#148831 <https://github.com/pytorch/pytorch/issues/148831>`__
# (``CheckpointError: torch.utils.checkpoint: Recomputed values for the following tensors have
# different metadata than during the forward pass``, saved bfloat16 against recomputed
# float32), and `fairscale#1199 <https://github.com/facebookresearch/fairscale/issues/1199>`__.
# We record the dtype inside a checkpointed function in the forward and in the recompute:
from torch.utils.checkpoint import checkpoint

block = nn.Linear(32, 32, device=dev)
seen = []


def checkpointed(x):
    y = block(x)
    seen.append((torch.is_autocast_enabled(dev.type), y.dtype))
    return torch.relu(y)


xin = torch.randn(4, 32, device=dev, requires_grad=True)
with torch.autocast(dev.type, dtype=torch.bfloat16):
    out = checkpoint(checkpointed, xin, use_reentrant=False)
out.float().sum().backward()  # outside autocast, as recommended
recompute = {"forward": seen[0], "recompute in backward": seen[1]}
recompute

# %%
assert seen[0] == seen[1] == (True, torch.bfloat16)
print(f"on torch {torch.__version__}: the recompute runs under the forward's autocast and "
      "produces the saved dtype")

# %%
# ``torch.utils.checkpoint`` records the autocast state of each device type when the forward
# runs and re-enters it for the recompute, so a backward outside autocast recomputes bf16.
# The errors of the threads come from code that changes dtypes outside that state: FSDP2's
# pre-forward input cast being skipped in the recompute (#159359, #148831), or a wrapper that
# re-enters ``torch.cuda.amp.autocast()`` with its default float16 (fairscale). Not run here.
# Recompute in depth: :ref:`sphx_glr_docs_auto_examples_training_plot_04_recompute_and_no_grad.py`.

# %%
# What we saw
# -----------
# - Factories inside compiled code give the dtype their ``dtype=`` asks for under ``aot_eager``
#   and inductor. Under a bf16 default without ``dtype=``, ``aot_eager`` follows the default and
#   inductor's ``randn`` does not (its dtype printed above): pass ``dtype=``.
# - float16 @ float32 fails compiled as it fails eagerly from torch 2.12 on (2.11's inductor
#   returned float32); bf16 ``Linear`` + float32 gives float32 in both on this device.
# - ``vector_norm`` into a bf16 ``out=`` compiles.
# - The compiled backward runs under the forward's autocast by default, so an inner
#   ``autocast(enabled=False)`` changes the gradient; ``backward_pass_autocast="off"`` gives
#   eager's gradient.
# - Under bf16 autocast SDPA casts a float32 mask to bf16 with key and value, on the CPU (live)
#   and CUDA (simulated); outside autocast a float32 mask reaches the kernel, which CUDA's
#   efficient attention rejects: build the mask in the query's dtype.
# - Checkpointing recomputes under the forward's autocast.
#
# .. admonition:: References
#
#    :torchapi:`torch.compile`, :torchapi:`torch.utils.checkpoint.checkpoint`,
#    :torchapi:`torch.nn.functional.scaled_dot_product_attention`,
#    :torchapi:`torch.linalg.vector_norm`, :torchdoc:`amp.html`

"""
Backward inside or outside autocast
===================================

Which dtype do the backward matmuls use, and does it matter whether ``backward()`` is called
inside the :func:`torch.autocast` region? We run backward both ways under
:class:`mpguide.training.autograd.DtypeLog` for a small MLP, for an op autocast runs in float32, for
custom autograd functions with and without :func:`torch.amp.custom_fwd` /
:func:`torch.amp.custom_bwd`, and for compiled code under each setting of
``torch._functorch.config.backward_pass_autocast``. For ordinary layers nothing changes; for
ops whose backward autocast can reach, the answer depends on where backward runs, and
compiled code follows its own rule.
"""

# %%
# Setup
# -----
# Everything runs live on the device :func:`mpguide.core.device.pick` chooses: CUDA when
# present, else the CPU. Autocast uses bf16 on either.
import torch
import torch.nn.functional as F

from mpguide.core import device
from mpguide.core.table import Table
from mpguide.training.autograd import DtypeLog

dev = device.pick()
device.describe(dev)
BF16 = torch.bfloat16
gen = torch.Generator(device=dev).manual_seed(0)
bf16_mm, fp32_mm = "(bfloat16, bfloat16) -> (bfloat16)", "(float32, float32) -> (float32)"


def tally(signatures: list[str]) -> str:
    """``['a', 'b', 'b']`` -> ``'1 × a; 2 × b'``, in order of first appearance."""
    return "; ".join(f"{signatures.count(s)} × {s}" for s in dict.fromkeys(signatures))


def backward_log(forward, inside: bool, params=None) -> DtypeLog:
    """Run ``forward()`` under autocast, then backward inside or after the region, logged."""
    log = DtypeLog(params)
    with log:
        with torch.autocast(dev.type, dtype=BF16):
            loss = forward()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
    return log


# %%
# A small MLP: no difference
# --------------------------
# Linear, LayerNorm, GELU, Linear and an MSE loss. The backward ops see the bf16 activations
# autocast saved in forward, and autocast leaves their kernels alone, so the dtypes of every
# backward op are the same both ways.
mlp = torch.nn.Sequential(
    torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.GELU(), torch.nn.Linear(64, 8)
).to(dev)
x = torch.randn(16, 32, device=dev, generator=gen)
target = torch.randn(16, 8, device=dev, generator=gen)


def mlp_loss():
    return F.mse_loss(mlp(x), target)


runs = {}
for inside in (True, False):
    mlp.zero_grad(set_to_none=True)
    runs[inside] = backward_log(mlp_loss, inside, mlp)
signature = {k: [(r.op, r.signature()) for r in log.select("backward")] for k, log in runs.items()}
print(
    f"backward ops: {len(signature[True])}; the same ops and dtypes both ways: "
    f"{signature[True] == signature[False]}"
)
assert signature[True] == signature[False]
assert set(runs[False].signatures("aten.mm", "backward")) == {bf16_mm}
assert {p.grad.dtype for p in mlp.parameters()} == {torch.float32}
runs[False].casts("backward")

# %%
# The table lists the backward casts: the float32 loss gradient cast to bf16 where the output
# left the bf16 matmul, and one bf16 -> float32 cast per float32 parameter the matmuls used.
#
# An op autocast runs in float32
# ------------------------------
# Autocast does not lower ``torch.linalg.inv``: on float32 inputs it returns float32 inside
# the region. Its backward computes two matmuls. Called inside the region, backward runs under autocast
# too, and those matmuls are cast down to bf16; called after it, they stay in float32.
a = torch.randn(16, 16, device=dev, generator=gen) + 16 * torch.eye(16, device=dev)
w = torch.randn(16, 16, device=dev, generator=gen)
inv_out = {}


def inv_loss():
    leaf = a.clone().requires_grad_()
    inverse = torch.linalg.inv(leaf)
    inv_out["dtype"] = inverse.dtype
    return (inverse @ w).float().sum()


inv_runs = {inside: backward_log(inv_loss, inside) for inside in (True, False)}
inv_mm = {k: log.signatures("aten.mm", "backward") for k, log in inv_runs.items()}
assert inv_out["dtype"] == torch.float32
assert inv_mm[False] == [bf16_mm, fp32_mm, fp32_mm]
assert inv_mm[True] == [bf16_mm, bf16_mm, bf16_mm]
Table(
    ("backward called", "backward matmuls", "backward casts"),
    tuple(
        (
            "inside autocast" if k else "after autocast",
            tally(v),
            len(inv_runs[k].select("backward", casts=True)),
        )
        for k, v in inv_mm.items()
    ),
    f"backward of inv(a) @ w under autocast({dev.type!r}, bfloat16), torch {torch.__version__}",
)

# %%
# The first matmul (the backward of ``@ w``) is bf16 both ways; the two of ``inv``'s backward
# are bf16 with backward inside the region and float32 after it.
#
# Custom functions: ``custom_fwd`` and ``custom_bwd``
# ---------------------------------------------------
# A custom :class:`torch.autograd.Function` saves its float32 inputs and multiplies them.
# Under autocast its forward matmul runs in bf16; what its backward does depends on where it
# runs and on the decorators:
#
# - ``Plain``: no decorator;
# - ``Bwd``: ``custom_fwd`` on forward and ``custom_bwd`` on backward, so backward runs with
#   the autocast state forward had;
# - ``Fp32``: ``custom_fwd(cast_inputs=torch.float32)``, so forward (and then backward) runs
#   in float32 with autocast off.


class Plain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad @ b.T, a.T @ grad


class Bwd(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type=dev.type)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    @torch.amp.custom_bwd(device_type=dev.type)
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad @ b.T, a.T @ grad


class Fp32(Bwd):
    @staticmethod
    @torch.amp.custom_fwd(device_type=dev.type, cast_inputs=torch.float32)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b


def custom(fn, inside: bool):
    p = torch.randn(8, 8, device=dev, generator=gen, requires_grad=True)
    q = torch.randn(8, 8, device=dev, generator=gen, requires_grad=True)
    out = {}

    def forward():
        out["y"] = fn.apply(p, q)
        return out["y"].float().sum()

    where = "inside" if inside else "after"
    try:
        log = backward_log(forward, inside)
    except RuntimeError as err:
        errors.append(f"{fn.__name__}, backward {where}: {str(err).splitlines()[0]}")
        return fn.__name__, where, out["y"].dtype, "raised", "none"
    mm = tally(log.signatures("aten.mm", "backward"))
    return fn.__name__, where, out["y"].dtype, mm, p.grad.dtype


errors: list[str] = []
rows = tuple(custom(fn, inside) for fn in (Plain, Bwd, Fp32) for inside in (True, False))
customs = Table(
    ("function", "backward", "forward output", "backward matmuls", "p.grad"),
    rows,
    f"custom autograd functions under autocast({dev.type!r}, bfloat16), torch {torch.__version__}",
    tuple(errors),
)
outcome = {(r[0], r[1]): r for r in customs.rows}
assert outcome["Plain", "inside"][3] == f"2 × {bf16_mm}"
assert outcome["Plain", "after"][3] == "raised" and len(errors) == 1
assert outcome["Bwd", "inside"][3] == outcome["Bwd", "after"][3] == f"2 × {bf16_mm}"
assert outcome["Fp32", "inside"][3] == outcome["Fp32", "after"][3] == f"2 × {fp32_mm}"
assert outcome["Fp32", "after"][2] == torch.float32
customs

# %%
# The plain function's backward, run after the region, meets a bf16 gradient and its float32
# saved inputs without autocast, and the matmul raises (the error is under the table). ``custom_bwd`` makes it run as it did
# inside; ``cast_inputs=torch.float32`` keeps both passes in float32.
#
# Compiled code: ``backward_pass_autocast``
# -----------------------------------------
# AOTAutograd traces the backward when the forward is compiled, so it cannot see where
# ``backward()`` will be called. ``torch._functorch.config.backward_pass_autocast`` tells it:
# ``"same_as_forward"`` (the default) traces backward under the forward's autocast state,
# ``"off"`` without autocast, and a list of ``torch.autocast`` keyword dicts under those.
# We compile the ``inv`` function with the ``aot_eager`` backend under each setting, call
# backward after the region, and log the compiled backward's matmuls (the forward runs outside
# the logger: a compiled function called inside a dispatch mode runs eagerly).
import torch._functorch.config as functorch_config

print(f"default: backward_pass_autocast = {functorch_config.backward_pass_autocast!r}")
assert functorch_config.backward_pass_autocast == "same_as_forward"

settings = {
    "same_as_forward": "same_as_forward",
    "off": "off",
    "[autocast bf16]": [{"device_type": dev.type, "dtype": BF16}],
}
compiled_mm = {}
for name, setting in settings.items():
    torch._dynamo.reset()
    with functorch_config.patch(backward_pass_autocast=setting):
        compiled = torch.compile(inv_loss, backend="aot_eager")
        with torch.autocast(dev.type, dtype=BF16):
            loss = compiled()
        with DtypeLog() as log:
            loss.backward()
    assert {r.node for r in log.select("backward") if r.op.startswith("aten.mm")} == {
        "CompiledFunctionBackward"
    }
    compiled_mm[name] = log.signatures("aten.mm", "backward")
assert functorch_config.backward_pass_autocast == "same_as_forward"

assert fp32_mm not in compiled_mm["same_as_forward"]
assert compiled_mm["same_as_forward"] == compiled_mm["[autocast bf16]"]
assert compiled_mm["off"].count(fp32_mm) == 2
Table(
    ("backward_pass_autocast", "compiled backward matmuls (backward called after autocast)"),
    tuple((name, tally(mm)) for name, mm in compiled_mm.items()),
    f"torch.compile(backend='aot_eager') of inv(a) @ w, torch {torch.__version__}",
)

# %%
# With the default, the compiled backward of ``inv`` multiplies in bf16 although
# ``backward()`` ran after the autocast region, where eager code multiplied in float32: the
# compiled graph matches eager code that calls backward *inside* the region. ``"off"`` gives
# the float32 matmuls eager code gets after the region.
assert compiled_mm["same_as_forward"] == inv_mm[True]
assert compiled_mm["off"] == inv_mm[False]

# %%
# The backward matmuls of ``inv(a) @ w`` in one map, eager and compiled, one cell per matmul in
# the order they ran, coloured by the dtype each returned.
from mpguide import plots

mm_runs = {
    "eager, backward inside autocast": inv_mm[True],
    "eager, backward after autocast": inv_mm[False],
    **{f"compiled ({name}), backward after": mm for name, mm in compiled_mm.items()},
}
n_mm = max(map(len, mm_runs.values()))
_ = plots.dtype_grid(
    Table(
        ("backward of inv(a) @ w", *(f"matmul {i + 1}" for i in range(n_mm))),
        tuple((name, *(sig.rsplit("-> (", 1)[1].rstrip(")") for sig in mm))
              for name, mm in mm_runs.items()),
    ),
    title=f"output dtype of each backward matmul under autocast({dev.type!r}, bfloat16), "
    f"torch {torch.__version__}",
)

# %%
# What we saw
# -----------
# - For Linear, LayerNorm, GELU and MSE, calling backward inside or after autocast runs the
#   same backward ops in the same dtypes; the backward matmuls are bf16 because the saved
#   activations and the incoming gradients are.
# - For an op autocast runs in float32 (``linalg.inv``), backward inside the region casts its
#   backward matmuls to bf16; after the region they stay float32.
# - A plain custom Function whose backward mixes bf16 and float32 raises after the region;
#   ``custom_bwd`` replays forward's autocast state; ``custom_fwd(cast_inputs=float32)``
#   keeps both passes in float32.
# - Compiled with ``aot_eager``, the default ``backward_pass_autocast="same_as_forward"``
#   gives the bf16 backward matmuls even when backward runs after the region; ``"off"`` gives
#   float32.
#
# .. admonition:: References
#
#    :torchapi:`torch.autocast`, :torchdoc:`amp.html` (``custom_fwd``, ``custom_bwd``),
#    :torchdoc:`notes/amp_examples.html#autocast-and-custom-autograd-functions`,
#    :torchapi:`torch.linalg.inv`,
#    :torchapi:`torch.autograd.Function`, :torchapi:`torch.compile`

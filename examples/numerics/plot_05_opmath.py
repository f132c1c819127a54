"""
What a low-precision op computes in
===================================

When an elementwise op or a reduction gets bf16 tensors, does it compute in bf16? We run ops
on bf16 tensors on this build's device and compare them bit for bit with an emulation that
upcasts the bf16 values to float32, computes in float32 and rounds once to bf16; then with
chains of bf16 ops that round after every step. The answer: ATen computes in the op's "opmath"
type, float32 for bf16 and fp16 (``at::opmath_type<BFloat16>`` is ``float``). Every op below
matches the round-once emulation bit for bit, a Python scalar stays a float32 value inside the
op, a fused ``addcmul``, ``addcdiv`` or ``lerp`` rounds once where the same chain of bf16 ops
rounds at every step, and a bf16 ``sum`` accumulates in float32.
"""

# %%
# Setup
# -----
import torch
import torch.nn.functional as F

from mpguide.core import device
from mpguide.core.table import Table

dev = device.pick()
device.describe(dev)
bf16 = torch.bfloat16
N = 1 << 16
gen = torch.Generator(device=dev).manual_seed(0)
a, b, c = (torch.randn(N, generator=gen, device=dev).to(bf16) for _ in range(3))
print(f"three bf16 vectors of {N} standard-normal values on {dev.type}")


def differ(x, y):
    """How many elements of two bf16 tensors differ in their bits."""
    assert x.dtype == y.dtype == bf16
    return int((x.view(torch.int16) != y.view(torch.int16)).sum())


def round_once(fn, *tensors, **kwargs):
    """The emulation: the bf16 values upcast to float32, ``fn`` in float32, one rounding."""
    return fn(*(t.float() for t in tensors), **kwargs).to(bf16)


# %%
# Elementwise ops: float32 inside, one rounding
# ---------------------------------------------
# Each op runs on the bf16 tensors and on the emulation. "differing" counts the elements whose
# 16 bits differ (the results viewed as ``int16``). SiLU is also written as a chain of two bf16
# ops, ``x * sigmoid(x)``, which rounds the sigmoid to bf16 before multiplying.
elementwise = {
    "a * b": lambda x, y: x * y,
    "a / b": lambda x, y: x / y,
    "exp(a)": lambda x, y: torch.exp(x),
    "tanh(a)": lambda x, y: torch.tanh(x),
    "silu(a)": lambda x, y: F.silu(x),
    "gelu(a)": lambda x, y: F.gelu(x),
}
vs_emulation = {name: differ(fn(a, b), round_once(fn, a, b)) for name, fn in elementwise.items()}
silu_chain = differ(a * torch.sigmoid(a), F.silu(a))
Table(
    ("bf16 op", "elements differing from the round-once emulation", "checked on"),
    tuple((name, count, dev.type) for name, count in vs_emulation.items()),
    f"{N} bf16 elements; SiLU as the bf16 chain a * sigmoid(a) differs from F.silu in {silu_chain}",
)

# %%
assert all(count == 0 for count in vs_emulation.values()), vs_emulation
assert silu_chain > N // 10, silu_chain
print(
    f"{len(vs_emulation)} ops equal the round-once emulation bit for bit on {dev.type}; "
    f"the two-rounding SiLU chain differs in {silu_chain} of {N} elements "
    f"({silu_chain / N:.0%})"
)

# %%
# A Python scalar stays float32
# -----------------------------
# ``a * 0.1`` does not round 0.1 to bf16 (0.10009765625) first: the scalar enters the kernel
# as an opmath value, a float32. Multiplying by a bf16 tensor holding 0.1 gives another result
# in many elements.
scalar = 0.1
by_python_scalar = a * scalar
by_bf16_scalar = a * torch.tensor(scalar, dtype=bf16, device=dev)
emulated = (a.float() * torch.tensor(scalar, dtype=torch.float32, device=dev)).to(bf16)
scalar_vs_emulation = differ(by_python_scalar, emulated)
scalar_vs_bf16 = differ(by_python_scalar, by_bf16_scalar)
bf16_of_scalar = torch.tensor(scalar, dtype=bf16).item()
print(f"0.1 as bf16 is {bf16_of_scalar!r}; as float32 {torch.tensor(scalar).item()!r}")
print(
    f"a * 0.1 against float32(0.1) emulated: {scalar_vs_emulation} differ; against "
    f"a * bf16(0.1): {scalar_vs_bf16} of {N} differ ({dev.type})"
)
assert bf16_of_scalar == 0.10009765625
assert scalar_vs_emulation == 0
assert scalar_vs_bf16 > N // 10, scalar_vs_bf16

# %%
# Float32, not float64: the scalar ``s = 1 + 2**-8 + 2**-30`` lies just above the midpoint
# between the bf16 neighbours 1 and ``1 + 2**-7``, so the exact product ``1 * s`` rounds to
# ``1 + 2**-7``. As a float32, ``s`` loses its ``2**-30`` and becomes the midpoint itself,
# ``1 + 2**-8``, and a tie rounds to the even neighbour, 1. The kernel gives 1: it used the
# float32 scalar.
s = 1 + 2**-8 + 2**-30
ones = torch.ones(4, dtype=bf16, device=dev)
exact_rounding = 1 + 2**-7 if s > 1 + 2**-8 else 1.0
s_as_float32 = torch.tensor(s, dtype=torch.float32).item()
kernel = set((ones * s).tolist())
print(
    f"s as float32: {s_as_float32!r}; 1 * s correctly rounded to bf16: {exact_rounding!r}; "
    f"bf16 ones * s on {dev.type}: {sorted(kernel)}"
)
assert s_as_float32 == 1 + 2**-8
assert exact_rounding == 1.0078125
assert kernel == {1.0}

# %%
# The same double rounding hides in a cast: ``.to(bfloat16)`` of a float64 tensor goes
# through float32 too, so a float64 emulation of the product would not show the difference.
via_cast = torch.tensor([s], dtype=torch.float64, device=dev).to(bf16).item()
print(f"float64 {s!r} .to(bfloat16) -> {via_cast!r} (correctly rounded: {exact_rounding!r})")
assert via_cast == 1.0

# %%
# Fused ops round once
# --------------------
# ``addcmul(x, y, z, value=v)`` is ``x + v * y * z``; ``addcdiv`` is ``x + v * y / z``;
# ``lerp(x, y, w)`` is ``x + w * (y - x)``. The fused op computes all of it in float32 and
# rounds once; the same formula written as bf16 ops rounds after every op. The divisor of
# ``addcdiv`` is kept away from zero (``|c| + 0.5``).
c_pos = (c.abs() + 0.5).to(bf16)
fused = {
    "addcmul(a, b, c, value=0.5)": (
        torch.addcmul(a, b, c, value=0.5),
        a + 0.5 * (b * c),
        round_once(torch.addcmul, a, b, c, value=0.5),
    ),
    "addcdiv(a, b, |c| + 0.5, value=0.5)": (
        torch.addcdiv(a, b, c_pos, value=0.5),
        a + 0.5 * (b / c_pos),
        round_once(torch.addcdiv, a, b, c_pos, value=0.5),
    ),
    "lerp(a, b, 0.3)": (
        torch.lerp(a, b, 0.3),
        a + 0.3 * (b - a),
        round_once(torch.lerp, a, b, weight=0.3),
    ),
}
counts = {name: (differ(f, chain), differ(f, emu)) for name, (f, chain, emu) in fused.items()}
Table(
    ("fused bf16 op", "differing from the bf16 chain", "differing from round-once", "checked on"),
    tuple((name, chain, emu, dev.type) for name, (chain, emu) in counts.items()),
    f"{N} bf16 elements; the chain is the same formula as separate bf16 ops",
)

# %%
for name, (chain, emu) in counts.items():
    assert emu == 0, (name, emu)
    assert chain > N // 20, (name, chain)
print(
    f"on {dev.type} every fused op equals the round-once emulation; the bf16 chains differ in "
    + ", ".join(f"{chain}" for chain, _ in counts.values())
    + f" of {N} elements"
)

# %%
# How many elements each way of computing changes
# -----------------------------------------------
# Every op above, as the share of the elements that differ from the op itself: the
# round-once emulation (float32 inside, one rounding) never differs; the same formula as a
# chain of bf16 ops, each rounding its result, differs in the share shown.
from mpguide import plots

shares = {name: {"round-once emulation": 100 * count / N} for name, count in vs_emulation.items()}
shares["silu(a)"]["chain of bf16 ops"] = 100 * silu_chain / N
for name, (chain, emu) in counts.items():
    shares[name] = {"round-once emulation": 100 * emu / N, "chain of bf16 ops": 100 * chain / N}
fig = plots.bars(shares, xlabel=f"elements differing from the bf16 op (% of {N})", fmt="{:.1f}%")
zero = [p for p in fig.axes[0].patches if p.get_width() == 0]
assert len(zero) == len(vs_emulation) + len(counts)

# %%
# The float32 addcmul in the emulation is written out by hand here too, as
# ``a + 0.5 * (b * c)`` in float32: with ``value=0.5`` (a power of two) the order of the
# products cannot matter, and it matches as well.
by_hand = (a.float() + 0.5 * (b.float() * c.float())).to(bf16)
assert differ(torch.addcmul(a, b, c, value=0.5), by_hand) == 0

# %%
# Reductions accumulate in float32
# --------------------------------
# 4096 values drawn uniformly from ``[0, 1)`` and rounded to bf16 sum to about 2048, where
# bf16's spacing is 8 (16 above 2048). A running sum kept in bf16 stops growing at 256: there
# the spacing is 2, and adding a value below 1 rounds back to the same number. ``sum`` of the
# bf16 tensor returns the float32 sum rounded once to bf16.
x = torch.rand(4096, generator=gen, device=dev).to(bf16)
low_sum = x.sum()
float32_sum = x.float().sum()
exact_sum = x.double().sum().item()
running = torch.zeros((), dtype=bf16, device=dev)
for value in x:
    running = running + value
Table(
    ("sum of 4096 bf16 values", "value", "dtype"),
    (
        ("x.sum()", low_sum.item(), low_sum.dtype),
        ("x.float().sum()", float32_sum.item(), float32_sum.dtype),
        ("x.float().sum() rounded to bf16", float32_sum.to(bf16).item(), bf16),
        ("running sum in bf16, one value at a time", running.item(), running.dtype),
        ("exact (float64)", exact_sum, torch.float64),
    ),
    f"uniform [0, 1) values rounded to bf16, on {dev.type}",
)

# %%
assert low_sum.dtype == bf16
assert torch.equal(low_sum, float32_sum.to(bf16))
assert abs(float32_sum.item() - exact_sum) < 0.01
assert running.item() == 256.0
assert abs(low_sum.item() - exact_sum) <= 8, (low_sum.item(), exact_sum)
mean_matches = torch.equal(x.mean(), x.float().mean().to(bf16))
assert mean_matches
print(
    f"bf16 sum {low_sum.item()} = float32 sum {float32_sum.item():.4f} rounded once; "
    f"a bf16 running sum stops at {running.item()}; mean likewise ({dev.type})"
)

# %%
# The mechanism: opmath
# ---------------------
# ATen's kernels load each bf16 or fp16 element, convert it to ``at::opmath_type<T>``
# (``float`` for ``BFloat16`` and ``Half``, ``T`` itself for float32 and float64), compute and
# convert the result back once when they store it. Scalars arrive as opmath values, and
# reductions keep their accumulator in the accumulate type, float32 for bf16. The
# consequences are what the cells above measured; the type itself is C++ and cannot be read
# from Python.

# %%
# What we saw
# -----------
# All checked on the device named in the setup cell, on the bf16 vectors above:
#
# - ``a * b``, ``a / b``, ``exp``, ``tanh``, ``silu`` and ``gelu`` of bf16 tensors equal, bit
#   for bit, the float32 computation on the upcast values rounded once to bf16; SiLU written
#   as the bf16 chain ``a * sigmoid(a)`` differs in more than a tenth of the elements.
# - ``a * 0.1`` uses 0.1 as a float32 (0 elements differ from that emulation) and differs from
#   ``a * bf16(0.1)`` in more than a tenth; a scalar just above a bf16 midpoint shows it is a
#   float32, not a float64, and a float64 tensor's ``.to(bfloat16)`` also rounds via float32.
# - ``addcmul``, ``addcdiv`` and ``lerp`` equal the round-once emulation; the same formulas as
#   bf16 op chains differ in more than a twentieth of the elements.
# - ``sum`` and ``mean`` of 4096 bf16 values equal the float32 result rounded once; a bf16
#   running sum stalls at 256 instead of about 2000.
#
# .. admonition:: References
#
#    :torchdoc:`notes/numerical_accuracy.html`, :torchapi:`torch.addcmul`,
#    :torchapi:`torch.addcdiv`, :torchapi:`torch.lerp`, :torchapi:`torch.sum`,
#    :torchapi:`torch.nn.functional.silu`, :torchapi:`torch.nn.functional.gelu`,
#    `at::opmath_type (ATen/OpMathType.h)
#    <https://github.com/pytorch/pytorch/blob/main/aten/src/ATen/OpMathType.h>`_

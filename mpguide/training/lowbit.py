"""Training with fake-quantized GEMMs: every linear layer's forward GEMM and both backward GEMMs
(input gradient, weight gradient) run on operands quantized by a recipe of
:mod:`mpguide.precision.recipes` and multiplied in float32; weights, optimizer states and
everything else stay float32.

Each operand is quantized along the GEMM's inner dimension: the forward ``x @ W.T`` along the
features, the input gradient ``g @ W`` along the outputs, the weight gradient ``g.T @ x`` along
the batch. A dimension that a block does not divide is padded with zeros (which change no
block's amax). Options: stochastic rounding of the output gradients (``sr``), a random Hadamard
transform of both weight-gradient operands along the batch in blocks of 16 (``rht``; it cancels
in the product and spreads outliers), and layers kept in bf16 (``keep``). The ``bf16`` recipe
rounds every operand to bfloat16, as autocast's matmuls do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from mpguide import MPGuideError
from mpguide.precision import recipes
from mpguide.training import loop

KINDS = ("bf16", "fp8 tensorwise", "fp8 rowwise", "fp8 blockwise", "mxfp8", "mxfp4", "nvfp4")
_PAD = 128
_HADAMARD = 16


@dataclass(frozen=True)
class Recipe:
    """How the GEMMs are quantized: a kind of :data:`KINDS`, stochastic rounding of gradients,
    a random Hadamard transform of the weight-gradient operands, layers kept in bf16."""

    kind: str
    sr: bool = False
    rht: bool = False
    keep: tuple[str, ...] = ()
    label: str = ""

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        extras = [e for e, on in (("sr", self.sr), ("rht", self.rht)) if on]
        extras += [f"bf16 {', '.join(self.keep)}"] if self.keep else []
        return f"{self.kind} ({', '.join(extras)})" if extras else self.kind


def recipe(kind: str, **options) -> Recipe:
    """A :class:`Recipe`, its kind checked."""
    if kind not in KINDS:
        raise MPGuideError(f"unknown training recipe {kind!r}; choose one of {', '.join(KINDS)}")
    return Recipe(kind, **options)


def _padded(t: torch.Tensor, rows: int, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``fn`` of ``t`` (2-D) padded with zeros to a multiple of ``rows`` rows and of
    :data:`_PAD` columns, cut back to ``t``'s shape."""
    r, c = t.shape
    pr, pc = -r % rows, -c % _PAD
    if pr or pc:
        return fn(nn.functional.pad(t, (0, pc, 0, pr)))[:r, :c]
    return fn(t)


def quantizer(
    rec: Recipe, generator: torch.Generator
) -> Callable[[torch.Tensor, str], torch.Tensor]:
    """The function that quantizes one 2-D GEMM operand (role ``x``, ``w`` or ``g``) along its
    last dimension under ``rec``, returning its dequantized float32 values."""

    def q(t: torch.Tensor, role: str) -> torch.Tensor:
        if rec.kind == "bf16":
            return t.to(torch.bfloat16).float()
        how = {"rounding": "stochastic" if rec.sr and role == "g" else "nearest"}
        how["generator"] = generator
        if rec.kind.startswith("fp8 "):
            layout = rec.kind[4:]
            rows = 1
            if layout == "blockwise":
                layout = "blockwise_128x128" if role == "w" else "blockwise_1x128"
                rows = 128 if role == "w" else 1
            return _padded(t, rows, lambda p: recipes.fp8(p, layout, **how).values)
        return _padded(t, 1, lambda p: recipes.quantize(p, rec.kind, **how).values)

    return q


def hadamard(n: int = _HADAMARD) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of order ``n`` (a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(n)


def _rotate(t: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``t`` (rows × batch) times a block-diagonal random Hadamard along the batch."""
    r, c = t.shape
    pad = -c % _HADAMARD
    t = nn.functional.pad(t, (0, pad)) * nn.functional.pad(signs, (0, pad), value=1.0)
    return (t.reshape(r, -1, _HADAMARD) @ hadamard()).reshape(r, -1)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, q, rht):
        flat = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(flat, weight)
        ctx.q, ctx.rht, ctx.has_bias, ctx.shape = q, rht, bias is not None, x.shape
        y = q(flat, "x") @ q(weight, "w").T
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        flat, weight = ctx.saved_tensors
        q, g = ctx.q, grad.reshape(-1, grad.shape[-1]).contiguous()
        dx = q(g, "g") @ q(weight.T.contiguous(), "w").T
        gt, xt = g.T.contiguous(), flat.T.contiguous()
        if ctx.rht is not None:
            signs = torch.randint(0, 2, (gt.shape[1],), generator=ctx.rht).float() * 2 - 1
            gt, xt = _rotate(gt, signs), _rotate(xt, signs)
        dw = q(gt, "g") @ q(xt, "x").T
        db = g.sum(0) if ctx.has_bias else None
        return dx.reshape(ctx.shape), dw, db, None, None


class QuantLinear(nn.Linear):
    """A linear layer whose three GEMMs run on quantized operands (:class:`_Linear`)."""

    def __init__(self, linear: nn.Linear, q, rht: torch.Generator | None):
        super().__init__(linear.in_features, linear.out_features, linear.bias is not None)
        self.weight, self.bias = linear.weight, linear.bias
        self.q, self.rht = q, rht

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Linear.apply(x, self.weight, self.bias, self.q, self.rht)


def quantize_linears(model: nn.Module, rec: Recipe, seed: int = 0) -> nn.Module:
    """``model`` with every :class:`torch.nn.Linear` not named in ``rec.keep`` replaced by a
    :class:`QuantLinear` (in place); those kept run their GEMMs in bf16."""
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = set(rec.keep) - names
    if missing:
        raise MPGuideError(f"no linear layer named {', '.join(sorted(missing))}")
    gen = torch.Generator().manual_seed(seed + 1)
    q, bf16 = quantizer(rec, gen), quantizer(replace(rec, kind="bf16"), gen)
    rht = torch.Generator().manual_seed(seed + 2) if rec.rht else None
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        keep = name in rec.keep
        setattr(
            parent,
            child,
            QuantLinear(getattr(parent, child), bf16 if keep else q, None if keep else rht),
        )
    return model


@dataclass(frozen=True)
class Run:
    """One recipe's training: the loss of every step and the held-out loss at the end."""

    recipe: Recipe
    losses: tuple[float, ...] = field(repr=False)
    held_out: float

    @property
    def name(self) -> str:
        return self.recipe.name

    def final(self, last: int = 20) -> float:
        """The mean training loss of the last ``last`` steps."""
        return sum(self.losses[-last:]) / len(self.losses[-last:])


def train(
    recs: Sequence[Recipe],
    task: loop.CharTask | None = None,
    *,
    steps: int = 150,
    batch: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
) -> tuple[Run, ...]:
    """Train ``task``'s model (default: :func:`mpguide.training.loop.char_task`) under each
    recipe from the same weights on the same batches, AdamW with a cosine learning rate from
    ``lr`` to zero; the held-out loss is taken in float32 on 512 windows."""
    if steps < 1 or batch < 1:
        raise MPGuideError(f"steps and batch must be at least 1, got {steps} and {batch}")
    task = loop.char_task() if task is None else task
    held_x, held_y = task.batch(512, torch.Generator().manual_seed(seed + 2), True)
    runs = []
    for rec in recs:
        model = quantize_linears(task.model(seed), rec, seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(seed)
        losses = []
        for step in range(steps):
            x, y = task.batch(batch, gen)
            for group in opt.param_groups:
                group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        plain = task.model(seed)
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            held = nn.functional.cross_entropy(plain(held_x), held_y).item()
        runs.append(Run(rec, tuple(losses), held))
    return tuple(runs)

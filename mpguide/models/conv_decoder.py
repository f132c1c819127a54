"""A small convolutional decoder shaped like a diffusion VAE's (a residual stream read only
through GroupNorm, upsampled between blocks), built so its residual stream outgrows float16,
and what each module's output holds in a given dtype: where fp16 overflows first.

Every read of the residual stream goes through a GroupNorm, so dividing the stream by ``s``
(the input convolution and every block's last convolution scaled by ``1/s``: :func:`rescaled`)
changes no output in exact arithmetic: the trick of fp16-fixed VAE checkpoints, done exactly.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mpguide import MPGuideError
from mpguide.core import dtypes
from mpguide.core.table import Table


class ResBlock(nn.Module):
    """``h + conv(silu(norm(conv(silu(norm(h))))))``."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        inner = self.conv1(nn.functional.silu(self.norm1(h)))
        return h + self.conv2(nn.functional.silu(self.norm2(inner)))


class Decoder(nn.Module):
    """Latent (``latent`` channels) to an RGB image twice as large per upsampling."""

    def __init__(
        self,
        latent: int = 4,
        channels: int = 32,
        blocks: int = 4,
        groups: int = 8,
        upsample_after: tuple[int, ...] = (1,),
    ):
        super().__init__()
        self.conv_in = nn.Conv2d(latent, channels, 3, padding=1)
        self.blocks = nn.ModuleList(ResBlock(channels, groups) for _ in range(blocks))
        self.upsample_after = frozenset(upsample_after)
        self.norm_out = nn.GroupNorm(groups, channels)
        self.conv_out = nn.Conv2d(channels, 3, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i in self.upsample_after:
                h = nn.functional.interpolate(h, scale_factor=2.0, mode="nearest")
        return self.conv_out(nn.functional.silu(self.norm_out(h)))


def build(gain: float = 100.0, growth: float = 8.0, seed: int = 0, **kwargs) -> Decoder:
    """A seeded :class:`Decoder` whose block ``i``'s last convolution is ``gain * growth**i``
    times its default initialisation: each block adds a larger update to the stream, as the
    late blocks of trained VAE decoders do."""
    torch.manual_seed(seed)
    dec = Decoder(**kwargs)
    with torch.no_grad():
        for i, block in enumerate(dec.blocks):
            block.conv2.weight.mul_(gain * growth**i)
            block.conv2.bias.mul_(gain * growth**i)
    return dec


def rescaled(dec: Decoder, s: float) -> Decoder:
    """A copy of ``dec`` whose residual stream is ``1/s`` of ``dec``'s: the same image in exact
    arithmetic (GroupNorm divides the scale out; its ``eps`` aside)."""
    if s <= 0:
        raise MPGuideError(f"the scale must be positive, got {s}")
    out = copy.deepcopy(dec)
    with torch.no_grad():
        for conv in [out.conv_in, *(b.conv2 for b in out.blocks)]:
            conv.weight.div_(s)
            conv.bias.div_(s)
    return out


class FloatNorms(nn.Module):
    """A GroupNorm run in float32 and cast back to its input's dtype: "norms in fp32"."""

    def __init__(self, norm: nn.GroupNorm):
        super().__init__()
        self.norm = norm.float()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h.float()).to(h.dtype)


def with_float_norms(dec: Decoder) -> Decoder:
    """A copy of ``dec`` whose GroupNorms run in float32 (:class:`FloatNorms`); cast the copy
    to the low dtype first, then call this."""
    out = copy.deepcopy(dec)
    for block in out.blocks:
        block.norm1, block.norm2 = FloatNorms(block.norm1), FloatNorms(block.norm2)
    out.norm_out = FloatNorms(out.norm_out)
    return out


@dataclass(frozen=True)
class Run:
    """One decode: the largest finite ``|output|`` of each top-level stage, where the first
    non-finite value appeared, the image, and its share of NaN."""

    label: str
    stages: tuple[tuple[str, float, bool], ...]
    image: torch.Tensor

    @property
    def first_nonfinite(self) -> str | None:
        return next((name for name, _, finite in self.stages if not finite), None)

    @property
    def nan_share(self) -> float:
        return self.image.isnan().float().mean().item()


def decode(
    dec: Decoder,
    z: torch.Tensor,
    dtype: torch.dtype,
    label: str = "",
    prepare: Callable[[Decoder], Decoder] | None = None,
) -> Run:
    """Decode ``z`` with a copy of ``dec`` cast to ``dtype`` (then passed through ``prepare``),
    recording each stage's output: the input convolution, each block (after its upsampling),
    the output norm and convolution."""
    model = copy.deepcopy(dec).to(dtype)
    model = prepare(model) if prepare else model
    stages: list[tuple[str, float, bool]] = []

    def keep(name: str, h: torch.Tensor) -> None:
        finite = h[h.isfinite()]
        stages.append(
            (
                name,
                finite.abs().max().item() if finite.numel() else float("nan"),
                bool(h.isfinite().all()),
            )
        )

    with torch.no_grad():
        h = model.conv_in(z.to(dtype))
        keep("conv_in", h)
        for i, block in enumerate(model.blocks):
            h = block(h)
            if i in model.upsample_after:
                h = nn.functional.interpolate(h, scale_factor=2.0, mode="nearest")
            keep(f"block {i}", h)
        h = model.norm_out(h)
        keep("norm_out", h)
        image = model.conv_out(nn.functional.silu(h))
        keep("conv_out", image)
    return Run(label or dtypes.name(dtype), tuple(stages), image.float())


def stage_table(runs: list[Run], caption: str = "") -> Table:
    """A row per stage, a column per run: the largest finite ``|output|``, marked ``inf/NaN``
    where the stage's output was not all finite."""
    names = [name for name, _, _ in runs[0].stages]
    rows = []
    for i, name in enumerate(names):
        cells = []
        for run in runs:
            _, peak, finite = run.stages[i]
            if finite:
                cells.append(f"{peak:.4g}")
            elif not math.isnan(peak):  # some values finite
                cells.append(f"inf/NaN (finite max {peak:.4g})")
            else:
                cells.append("all inf/NaN")
        rows.append((name, *cells))
    return Table(("stage", *(r.label for r in runs)), tuple(rows), caption)

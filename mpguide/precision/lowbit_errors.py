"""Error of the low-bit recipes against float64: per tensor, against block size, and on GEMMs.

Every statistic is computed in float64 against the unquantized values: ``rel error`` is
``||q - x|| / ||x||`` (Frobenius norms), ``SNR`` is ``-20 log10`` of it in dB, ``to zero`` the
share of nonzero values that quantize to zero, ``saturated`` the share clamped to the element
format's max. A target is a recipe of :data:`mpguide.precision.recipes.RECIPES` or a low-bit
format cast without a scale (``float8_e4m3fn``, ``fp4_e2m1``, ...), whose values past the max
count as ``overflow`` (a cast gives inf or NaN there; the error is taken after saturation).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from mpguide import MPGuideError
from mpguide.core.table import Table
from mpguide.precision import lowbit, recipes

TARGETS = (*recipes.RECIPES, *(n for n in lowbit.ELEMENTS if n != "float8_e8m0fnu"))
"""Every target: the recipes, then the element formats cast without a scale."""


@dataclass(frozen=True)
class Quantization:
    """What quantizing one tensor to one target did."""

    target: str
    values: torch.Tensor
    bits_per_value: float
    rel_error: float
    to_zero: float
    saturated: float
    overflow: float

    @property
    def snr_db(self) -> float:
        return -20 * math.log10(self.rel_error) if self.rel_error > 0 else math.inf


def check_target(target: str) -> str:
    """``target`` if it names a recipe or a format, else one line naming the choices."""
    if target not in TARGETS:
        raise MPGuideError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    return target


def rel_error(approx: torch.Tensor, ref: torch.Tensor) -> float:
    """``||approx - ref|| / ||ref||`` in float64 (0 for an exact zero reference)."""
    ref = ref.double()
    norm = ref.norm().item()
    diff = (approx.double() - ref).norm().item()
    return diff / norm if norm else 0.0 if diff == 0 else math.inf


def quantize(x: torch.Tensor, target: str, *, block: int | None = None) -> Quantization:
    """``x`` (any floating dtype, quantized from float32) under ``target``."""
    check_target(target)
    x32 = x.detach().float()
    nonzero = max(int((x32 != 0).sum()), 1)
    if target in recipes.RECIPES:
        q = recipes.quantize(x32, target, block=block)
        values, bits = q.values, q.bits_per_value
        saturated, overflow = q.saturated.float().mean().item(), 0.0
    else:
        if block is not None:
            raise MPGuideError(f"{target} is cast without a scale; it has no block size")
        fmt = lowbit.get(target)
        values, bits = lowbit.round_to(x32, fmt), float(fmt.bits)
        saturated, overflow = 0.0, (x32.abs() > fmt.max).float().mean().item()
    return Quantization(
        target=target,
        values=values,
        bits_per_value=bits,
        rel_error=rel_error(values, x),
        to_zero=((values == 0) & (x32 != 0)).sum().item() / nonzero,
        saturated=saturated,
        overflow=overflow,
    )


def tensor_errors(
    tensors: Mapping[str, torch.Tensor], targets: Sequence[str] = recipes.RECIPES
) -> Table:
    """One row per tensor and target."""
    rows = []
    for name, x in tensors.items():
        for target in targets:
            q = quantize(x, target)
            rows.append(
                (
                    name,
                    target,
                    q.bits_per_value,
                    q.rel_error,
                    round(q.snr_db, 1),
                    100 * q.to_zero,
                    100 * q.saturated,
                )
            )
    columns = ("tensor", "recipe", "bits/value", "rel error", "SNR dB", "to zero %", "sat %")
    return Table(columns, tuple(rows), "quantization error against float64 (live, on the CPU)")


def block_sweep(
    x: torch.Tensor,
    kinds: Sequence[str] = ("mxfp8", "mxfp4", "nvfp4"),
    blocks: Sequence[int] = (8, 16, 32, 64, 128),
) -> Table:
    """Error of ``x`` for each kind at each block size along the last dimension; NVFP4 at a
    block other than 16 is its arithmetic (e2m1 elements, e4m3 block scales), not the format."""
    rows = []
    for kind in kinds:
        for block in blocks:
            q = recipes.quantize(x.float(), kind, block=block)
            rows.append((kind, block, q.bits_per_value, rel_error(q.values, x)))
    columns = ("recipe", "block", "bits/value", "rel error")
    return Table(columns, tuple(rows), "error against block size (live, on the CPU)")


def gemm_errors(
    shapes: Sequence[tuple[int, int, int]],
    targets: Sequence[str] = recipes.RECIPES,
    *,
    seed: int = 0,
    outliers: float = 0.0,
) -> Table:
    """Error of ``a @ b`` (``M x K`` times ``K x N``, seeded standard normal; ``outliers`` > 0
    multiplies one column of ``a`` in 64 by it) with both operands quantized along ``K`` and
    the product of their values taken in float32, against the float64 product of the
    unquantized operands."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=gen)
        b = torch.randn(k, n, generator=gen)
        if outliers:
            a[:, ::64] *= outliers
        ref = a.double() @ b.double()
        for target in targets:
            qa = quantize(a, target).values
            qb = quantize(b.T.contiguous(), target).values.T
            rows.append((f"{m}x{k}x{n}", target, rel_error(qa @ qb, ref)))
    caption = "GEMM error against float64, operands quantized along K (live, on the CPU)"
    return Table(("shape", "recipe", "rel error"), tuple(rows), caption)

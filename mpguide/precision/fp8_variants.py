"""The two fp8 E4M3 variants torch has, ``float8_e4m3fn`` (OCP: NVIDIA, MI350) and
``float8_e4m3fnuz`` (MI300), read from the same bytes, and an fn checkpoint moved to fnuz.

The variants share the bit layout but not the exponent bias (7 and 8), so one byte is worth
half as much in fnuz; fn spends two codes on NaN (``0x7F``, ``0xFF``) and keeps ``0x80`` for
``-0``, which fnuz reads as its only NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpguide import MPGuideError

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


def every_code() -> tuple[torch.Tensor, torch.Tensor]:
    """The 256 byte codes read as fn and as fnuz, in float32."""
    codes = torch.arange(256, dtype=torch.uint8)
    return codes.view(FN).float(), codes.view(FNUZ).float()


@dataclass(frozen=True)
class CodeComparison:
    """How the 256 codes read in the two variants."""

    halved: int
    """Codes finite and non-zero in both, whose fnuz value is half the fn value."""
    other_ratio: int
    """Codes finite and non-zero in both with any other ratio."""
    zeros: int
    """Codes that read as zero in both (``0x00``)."""
    nan_fn: tuple[int, ...]
    nan_fnuz: tuple[int, ...]
    fn_negative_zero: tuple[int, ...]
    """Codes fn reads as ``-0``."""


def compare_codes() -> CodeComparison:
    """Read every code both ways and sort the codes by what happens to their value."""
    fn, fnuz = every_code()
    both = ~(fn.isnan() | fnuz.isnan()) & (fn != 0) & (fnuz != 0)
    halved = both & (fnuz == fn / 2)
    negative_zero = (fn == 0) & torch.signbit(fn)

    def codes(mask: torch.Tensor) -> tuple[int, ...]:
        return tuple(mask.nonzero().flatten().tolist())

    return CodeComparison(
        halved=int(halved.sum()),
        other_ratio=int((both & ~halved).sum()),
        zeros=int(((fn == 0) & (fnuz == 0)).sum()),
        nan_fn=codes(fn.isnan()),
        nan_fnuz=codes(fnuz.isnan()),
        fn_negative_zero=codes(negative_zero),
    )


def read_as_fnuz(weight: torch.Tensor) -> torch.Tensor:
    """An fn tensor's bytes read as fnuz, as a loader that ignores the variant does."""
    if weight.dtype != FN:
        raise MPGuideError(f"expected a {FN} tensor, got {weight.dtype}")
    return weight.view(torch.uint8).view(FNUZ)


def normalize_to_fnuz(
    weight: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """An fn weight and its dequantization scale moved to fnuz without changing a value: the
    bytes read as fnuz (half the value), ``0x80`` (fn's ``-0``, fnuz's NaN) set to ``0x00``,
    and the scale doubled (the rule of vLLM's ``normalize_e4m3fn_to_e4m3fnuz``)."""
    if weight.dtype != FN:
        raise MPGuideError(f"expected a {FN} tensor, got {weight.dtype}")
    raw = weight.view(torch.uint8).clone()
    raw[raw == 0x80] = 0
    return raw.view(FNUZ), scale * 2


def cast_values_to_fnuz(weight: torch.Tensor) -> torch.Tensor:
    """An fn tensor converted value by value (through float32) with torch's cast to fnuz, the
    scale unchanged."""
    if weight.dtype != FN:
        raise MPGuideError(f"expected a {FN} tensor, got {weight.dtype}")
    return weight.float().to(FNUZ)

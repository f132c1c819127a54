"""Floating-point formats: their bit layout and limits, and rounding fp32 values to each.

The layout (sign, exponent and mantissa bits) comes from each format's definition; max and
smallest normal come from :class:`torch.finfo`; eps, the smallest subnormal and the decimal
digits follow from the layout. TF32 has no torch dtype: its row is computed from the same
definition (8-bit exponent, 10-bit mantissa) and its values come from :func:`round_mantissa`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from mpguide import MPGuideError
from mpguide.core import dtypes as _dtypes
from mpguide.core.table import Table

_FP32_MANTISSA = 23

# name -> (dtype or None, exponent bits, mantissa bits); fp8 layouts are read from the names.
_IEEE_LIKE = {
    "float64": (torch.float64, 11, 52),
    "float32": (torch.float32, 8, 23),
    "tf32": (None, 8, 10),
    "bfloat16": (torch.bfloat16, 8, 7),
    "float16": (torch.float16, 5, 10),
}


def _fp8_names() -> tuple[str, ...]:
    return tuple(
        n
        for n in dir(torch)
        if n.startswith("float8_") and isinstance(getattr(torch, n), torch.dtype)
    )


@dataclass(frozen=True)
class Format:
    """One floating-point format and its limits."""

    name: str
    dtype: torch.dtype | None
    sign_bits: int
    exponent_bits: int
    mantissa_bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float | None
    eps: float
    finfo_eps: float | None

    @property
    def bits(self) -> int:
        return self.sign_bits + self.exponent_bits + self.mantissa_bits

    @property
    def digits(self) -> float:
        """Decimal digits of precision, ``(mantissa bits + 1) * log10(2)``."""
        return (self.mantissa_bits + 1) * math.log10(2)

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (float32) rounded to this format, returned as float32."""
        if self.dtype is None:
            return round_mantissa(x, self.mantissa_bits)
        return x.to(self.dtype).to(x.dtype)


def _from_layout(name: str, dt: torch.dtype | None, exponent: int, mantissa: int) -> Format:
    if dt is None:
        bias = 2 ** (exponent - 1) - 1
        fmax = (2 - 2.0**-mantissa) * 2.0**bias
        normal = 2.0 ** (1 - bias)
        signed, finfo_eps = True, None
    else:
        fi = torch.finfo(dt)
        fmax, normal, signed, finfo_eps = fi.max, fi.smallest_normal, fi.min < 0, fi.eps
    return Format(
        name=name,
        dtype=dt,
        sign_bits=int(signed),
        exponent_bits=exponent,
        mantissa_bits=mantissa,
        max=fmax,
        smallest_normal=normal,
        smallest_subnormal=normal * 2.0**-mantissa if mantissa else None,
        eps=2.0**-mantissa,
        finfo_eps=finfo_eps,
    )


def formats() -> tuple[Format, ...]:
    """Every format: float64, float32, TF32, bfloat16, float16 and the fp8 dtypes torch has."""
    out = [_from_layout(n, dt, e, m) for n, (dt, e, m) in _IEEE_LIKE.items()]
    for name in _fp8_names():
        layout = re.search(r"e(\d+)m(\d+)", name)
        out.append(_from_layout(name, getattr(torch, name), int(layout[1]), int(layout[2])))
    return tuple(out)


def get(name: str) -> Format:
    """The format called ``name`` (``tf32``, ``bf16``, ``float8_e4m3fn``, ...)."""
    key = _dtypes.canonical(name)
    for fmt in formats():
        if fmt.name == key:
            return fmt
    names = ", ".join(f.name for f in formats())
    raise MPGuideError(f"unknown format {name!r}; choose one of {names}")


def _whole(value: float) -> float | int:
    return int(value) if value.is_integer() and value < 1e6 else value


def table() -> Table:
    """The formats as a :class:`~mpguide.core.table.Table`; a note names any ``finfo.eps`` that
    disagrees with the format's layout."""
    rows = tuple(
        (
            f.name,
            f.bits,
            f.sign_bits,
            f.exponent_bits,
            f.mantissa_bits,
            _whole(f.max),
            f.smallest_normal,
            f.smallest_subnormal,
            f.eps,
            round(f.digits, 2),
        )
        for f in formats()
    )
    notes = tuple(
        f"torch.finfo({f.name}).eps is {f.finfo_eps:g}, but {f.mantissa_bits} mantissa bits "
        f"give eps {f.eps:g}."
        for f in formats()
        if f.finfo_eps is not None and f.finfo_eps != f.eps
    )
    columns = (
        "format",
        "bits",
        "sign",
        "exponent",
        "mantissa",
        "max",
        "min normal",
        "min subnormal",
        "eps",
        "digits",
    )
    return Table(columns, rows, f"Floating-point formats in torch {torch.__version__}", notes)


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round float32 ``x`` to ``bits`` mantissa bits, to nearest with ties to even, keeping
    float32's exponent range: ``bits=10`` is TF32, ``bits=7`` is bfloat16. Infinities stay,
    NaNs stay NaN, values past the format's max overflow to infinity."""
    if x.dtype != torch.float32:
        raise MPGuideError(f"round_mantissa needs a float32 tensor, got {x.dtype}")
    if not 0 <= bits <= _FP32_MANTISSA:
        raise MPGuideError(f"mantissa bits must be between 0 and {_FP32_MANTISSA}, got {bits}")
    drop = _FP32_MANTISSA - bits
    if drop == 0:
        return x.clone()
    raw = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lowest_kept = (raw >> drop) & 1
    rounded = (raw + (1 << (drop - 1)) - 1 + lowest_kept) & (0xFFFFFFFF ^ ((1 << drop) - 1))
    rounded = torch.where(rounded >= 2**31, rounded - 2**32, rounded)
    out = rounded.to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(x), x, out)

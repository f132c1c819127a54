"""Low-bit element formats computed from their encodings: fp8 e4m3fn and e5m2, the e8m0 scale
format, fp6 e2m3 and e3m2 (OCP MX v1.0), and fp4 e2m1.

Every code of a format is decoded, and the facts (max, smallest normal and subnormal, spacing,
infinities, NaNs) are read off the decoded values, so they hold for formats that
:class:`torch.finfo` does not describe. :func:`round_to` rounds float32 values onto a format's
grid, to nearest with ties to even or stochastically, and saturates or overflows past its max.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from mpguide import MPGuideError
from mpguide.core.table import Table
from mpguide.precision import formats

ROUNDINGS = ("nearest", "stochastic")


@dataclass(frozen=True)
class Element:
    """One element (or scale) format: its bit layout and its special codes.

    ``specials`` is ``"ieee"`` (top exponent holds infinities and NaNs), ``"fn"`` (only the
    all-ones code is NaN, no infinities), ``"none"`` (every code is finite) or ``"e8m0"``
    (unsigned powers of two, 0xFF is NaN)."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    signed: bool
    specials: str
    dtype_name: str | None = None

    @property
    def bits(self) -> int:
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def dtype(self) -> torch.dtype | None:
        """The torch dtype of this format, where the running torch has one."""
        return getattr(torch, self.dtype_name, None) if self.dtype_name else None

    def decode(self, code: int) -> float:
        """The value of one code (an int below ``2**bits``)."""
        if not 0 <= code < 2**self.bits:
            raise MPGuideError(f"{self.name} has no code {code}")
        m_bits, e_bits = self.mantissa_bits, self.exponent_bits
        mantissa = code & (2**m_bits - 1)
        exponent = (code >> m_bits) & (2**e_bits - 1)
        sign = -1.0 if self.signed and code >> (m_bits + e_bits) else 1.0
        top = exponent == 2**e_bits - 1
        if self.specials == "e8m0":
            return math.nan if top else 2.0 ** (exponent - self.bias)
        if self.specials == "ieee" and top:
            return sign * math.inf if mantissa == 0 else math.nan
        if self.specials == "fn" and top and mantissa == 2**m_bits - 1:
            return math.nan
        if exponent == 0:
            return sign * 2.0 ** (1 - self.bias) * mantissa / 2**m_bits
        return sign * 2.0 ** (exponent - self.bias) * (1 + mantissa / 2**m_bits)

    @cached_property
    def values(self) -> tuple[float, ...]:
        """The value of every code, in code order."""
        return tuple(self.decode(c) for c in range(2**self.bits))

    @cached_property
    def finite(self) -> tuple[float, ...]:
        """The distinct finite values, ascending."""
        return tuple(sorted({v for v in self.values if math.isfinite(v)}))

    @property
    def max(self) -> float:
        return self.finite[-1]

    @property
    def min_positive(self) -> float:
        """The smallest positive value (a subnormal where the format has them)."""
        return min(v for v in self.finite if v > 0)

    @property
    def smallest_normal(self) -> float:
        """The smallest value whose exponent field is not zero (every e8m0 value)."""
        first = 1 << self.mantissa_bits if self.specials != "e8m0" else 0
        return self.values[first]

    @property
    def subnormals(self) -> int:
        """How many positive subnormal values the format has."""
        if self.specials == "e8m0":
            return 0
        return sum(1 for v in self.finite if 0 < v < self.smallest_normal)

    @property
    def infinities(self) -> bool:
        return any(math.isinf(v) for v in self.values)

    @property
    def nan_codes(self) -> int:
        return sum(1 for v in self.values if math.isnan(v))

    @property
    def spacing_at_one(self) -> float:
        """The gap between 1 and the next larger value."""
        return min(v for v in self.finite if v > 1) - 1

    @property
    def emax(self) -> int:
        """The exponent of the largest power of two not above :attr:`max`
        (OCP MX's ``emax_elem``)."""
        return math.floor(math.log2(self.max))

    @property
    def dynamic_range(self) -> float:
        """``log2(max / smallest positive value)``, in binades."""
        return math.log2(self.max / self.min_positive)


ELEMENTS: dict[str, Element] = {
    e.name: e
    for e in (
        Element("float8_e4m3fn", 4, 3, True, "fn", "float8_e4m3fn"),
        Element("float8_e5m2", 5, 2, True, "ieee", "float8_e5m2"),
        Element("float8_e8m0fnu", 8, 0, False, "e8m0", "float8_e8m0fnu"),
        Element("fp6_e2m3", 2, 3, True, "none"),
        Element("fp6_e3m2", 3, 2, True, "none"),
        Element("fp4_e2m1", 2, 1, True, "none", "float4_e2m1fn_x2"),
    )
}
"""The low-bit formats by name. torch's ``float4_e2m1fn_x2`` packs two fp4 codes per byte and
has no cast from float32: fp4 values are rounded here."""

_ALIASES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "e8m0": "float8_e8m0fnu"}
_ALIASES |= {"e2m3": "fp6_e2m3", "e3m2": "fp6_e3m2", "e2m1": "fp4_e2m1", "fp4": "fp4_e2m1"}


def get(name: str) -> Element:
    """The element format called ``name`` (``float8_e4m3fn``, ``e4m3``, ``fp4_e2m1``, ...)."""
    found = ELEMENTS.get(_ALIASES.get(name, name))
    if found is None:
        raise MPGuideError(f"unknown low-bit format {name!r}; choose one of {', '.join(ELEMENTS)}")
    return found


def round_to(
    x: torch.Tensor,
    fmt: Element | str,
    rounding: str = "nearest",
    *,
    saturate: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Float32 ``x`` rounded onto ``fmt``'s values, returned as float32.

    ``nearest`` rounds to nearest with ties to even; ``stochastic`` rounds up with probability
    equal to the distance from the value below over the gap (unbiased). Past the format's max a
    value saturates to ±max (``saturate=True``) or becomes ±inf where the format has
    infinities and NaN where it has not. NaNs stay NaN."""
    fmt = get(fmt) if isinstance(fmt, str) else fmt
    if fmt.specials == "e8m0":
        raise MPGuideError("e8m0 holds scales: round with torch.log2, not round_to")
    if rounding not in ROUNDINGS:
        raise MPGuideError(f"unknown rounding {rounding!r}; choose one of {', '.join(ROUNDINGS)}")
    if x.dtype != torch.float32:
        raise MPGuideError(f"round_to needs a float32 tensor, got {x.dtype}")
    if rounding == "nearest" and saturate and fmt.dtype is not None and fmt.bits == 8:
        # torch's cast of in-range values rounds to nearest even (the tests check it on every
        # midpoint), and is several times faster than the arithmetic below.
        return torch.where(torch.isnan(x), x, x.clamp(-fmt.max, fmt.max).to(fmt.dtype).float())
    a, m_bits, emin = x.abs(), fmt.mantissa_bits, 1 - fmt.bias
    if rounding == "nearest":
        # Normal values: float32's mantissa rounded to the format's; below the smallest
        # normal, multiples of the smallest subnormal (both exact, ties to even).
        # (v + 2**23) - 2**23 rounds a float32 v below 2**22 to an integer, ties to even
        # (torch.round is a scalar loop on some CPU builds).
        sub_scale = 2.0 ** (m_bits - emin)
        sub = ((a * sub_scale + 2.0**23) - 2.0**23) / sub_scale
        q = torch.where(a < 2.0**emin, sub, _round_mantissa(a, m_bits))
    else:
        exponent = (((a.view(torch.int32) >> 23) & 0xFF) - 127).clamp(min=emin)
        step = torch.ldexp(torch.ones_like(a), exponent - m_bits)
        noise = torch.rand(a.shape, generator=generator, dtype=torch.float64, device=a.device)
        # Below 2**(mantissa + 2) here (inf and NaN aside, restored below): the cast to int64
        # is the floor, and fast.
        scaled = (a.double() / step + noise).clamp(max=2.0**24)
        q = torch.where(torch.isinf(a), a, (scaled.to(torch.int64) * step).float())
    if saturate:
        over = torch.full_like(q, fmt.max)
    else:
        over = torch.full_like(q, math.inf if fmt.infinities else math.nan)
    q = torch.where(q > fmt.max, over, q)
    return torch.where(torch.isnan(x), x, torch.copysign(q, x))


def _round_mantissa(a: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative float32 ``a`` rounded to ``bits`` mantissa bits, ties to even, in int32
    arithmetic (no carry can pass infinity's bits; NaNs are restored by the caller)."""
    drop = 23 - bits
    raw = a.view(torch.int32)
    lowest_kept = (raw >> drop) & 1
    return ((raw + (1 << (drop - 1)) - 1 + lowest_kept) & ~((1 << drop) - 1)).view(torch.float32)


def overflow_on_cast(fmt: Element) -> str:
    """What the running torch's cast to ``fmt``'s dtype does with a finite value past its max:
    ``saturates``, ``inf`` or ``nan`` (live, on the CPU); ``no cast`` where torch has none."""
    if fmt.dtype is None or fmt.specials in ("e8m0", "none"):
        return "no cast"
    big = torch.tensor([fmt.max * 4], dtype=torch.float32).to(fmt.dtype).float().item()
    if math.isnan(big):
        return "nan"
    return "inf" if math.isinf(big) else "saturates" if big == fmt.max else f"{big:g}"


def table() -> Table:
    """The low-bit formats' facts, computed from every code; for the fp8 formats the note
    confirms them against :mod:`mpguide.precision.formats` (``torch.finfo``)."""
    rows = []
    for f in ELEMENTS.values():
        rows.append(
            (
                f.name,
                f.bits,
                f"e{f.exponent_bits}m{f.mantissa_bits}",
                f.bias,
                _number(f.max),
                f.smallest_normal,
                f.min_positive,
                f.subnormals,
                f.spacing_at_one if f.mantissa_bits else 1.0,
                round(f.dynamic_range, 1),
                "yes" if f.infinities else "no",
                f.nan_codes,
                overflow_on_cast(f),
            )
        )
    checked = [f.name for f in ELEMENTS.values() if _agrees_with_finfo(f)]
    notes = (f"max and smallest normal agree with torch.finfo for {', '.join(checked)}.",)
    columns = (
        "format",
        "bits",
        "layout",
        "bias",
        "max",
        "min normal",
        "min positive",
        "subnormals",
        "gap above 1",
        "binades",
        "inf",
        "NaN codes",
        "cast past max",
    )
    caption = f"Low-bit formats, computed from every code; casts by torch {torch.__version__}"
    return Table(columns, tuple(rows), caption, notes)


def _number(value: float) -> float | int | str:
    if value >= 2**20:
        return f"2^{math.log2(value):g}"
    return int(value) if value.is_integer() else value


def _agrees_with_finfo(fmt: Element) -> bool:
    if fmt.dtype is None or fmt.dtype_name not in {f.name for f in formats.formats()}:
        return False
    known = formats.get(fmt.dtype_name)
    return known.max == fmt.max and known.smallest_normal == fmt.smallest_normal

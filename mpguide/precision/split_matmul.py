"""float32 matmuls emulated with several low-precision products (bf16x3, bf16x6, bf16x9,
tf32x3), as cuBLAS, CUTLASS and Triton compute them on tensor cores, and their error.

Each float32 operand is split into terms of a narrower format, ``a = a0 + a1 + a2`` (each term
the rounding of what the earlier ones left), and the product is the sum of some of the
``ai @ bj`` products, each exact in float32 (two 8-bit significands make 16 bits) and
accumulated in float32. ``bf16x9`` keeps all nine products of three terms, ``bf16x6`` the six
with ``i + j <= 2``, ``bf16x3`` the three with ``i + j <= 1``; ``tf32x3`` splits in two tf32
terms and keeps three products. Here the products run on this machine in float32 (emulated),
so the error is that of the scheme, not of any kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mpguide import MPGuideError, error_line
from mpguide.core import state
from mpguide.core.table import Table
from mpguide.precision import formats

SCHEMES: dict[str, tuple[str, int, int]] = {
    "bf16": ("bfloat16", 1, 0),
    "bf16x3": ("bfloat16", 3, 1),
    "bf16x6": ("bfloat16", 3, 2),
    "bf16x9": ("bfloat16", 3, 4),
    "tf32": ("tf32", 1, 0),
    "tf32x3": ("tf32", 2, 1),
}
"""Each scheme: the term format, how many terms per operand, and the largest ``i + j`` of the
products ``ai @ bj`` kept."""


def split(x: torch.Tensor, fmt: str, terms: int) -> list[torch.Tensor]:
    """``x`` (float32) as ``terms`` float32 tensors holding values of ``fmt``, largest first,
    each the rounding of what the earlier ones left: their sum is ``x`` up to the last term's
    rounding."""
    if x.dtype != torch.float32:
        raise MPGuideError(f"split takes float32, got {x.dtype}")
    out, rest = [], x
    for _ in range(terms):
        term = formats.get(fmt).round(rest).float()
        out.append(term)
        rest = rest - term
    return out


def emulated(a: torch.Tensor, b: torch.Tensor, scheme: str) -> torch.Tensor:
    """``a @ b`` computed as ``scheme`` (a key of :data:`SCHEMES`) computes it, the products
    accumulated in IEEE float32 on this machine."""
    if scheme not in SCHEMES:
        raise MPGuideError(f"unknown scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    fmt, terms, most = SCHEMES[scheme]
    ta, tb = split(a, fmt, terms), split(b, fmt, terms)
    pairs = sorted(
        ((i, j) for i in range(terms) for j in range(terms) if i + j <= most), key=lambda p: -sum(p)
    )
    with state.preserved():
        torch.backends.fp32_precision = "ieee"
        out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
        for i, j in pairs:  # smallest products first, as the kernels add them
            out = out + ta[i] @ tb[j]
    return out


def products(scheme: str) -> int:
    """How many low-precision matmuls ``scheme`` costs."""
    _, terms, most = SCHEMES[scheme]
    return sum(1 for i in range(terms) for j in range(terms) if i + j <= most)


@dataclass(frozen=True)
class SchemeErrors:
    """Relative error against float64 of IEEE float32 and of each emulated scheme."""

    shape: tuple[int, int, int]
    errors: dict[str, float]

    def ratio(self, scheme: str) -> float:
        """The scheme's error over IEEE float32's."""
        return self.errors[scheme] / self.errors["fp32 (IEEE)"]

    def table(self) -> Table:
        rows = tuple(
            (
                name,
                1 if name == "fp32 (IEEE)" else products(name),
                err,
                err / self.errors["fp32 (IEEE)"],
            )
            for name, err in self.errors.items()
        )
        m, k, n = self.shape
        return Table(
            ("scheme", "matmuls", "max |error| / max |ref|", "x fp32's error"),
            rows,
            f"{m} x {k} @ {k} x {n}, standard normal, against float64; schemes emulated "
            "(products and float32 accumulation on this machine)",
        )

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def scheme_errors(
    shape: tuple[int, int, int] = (128, 1024, 128),
    schemes: Sequence[str] = tuple(SCHEMES),
    seed: int = 0,
) -> SchemeErrors:
    """Each scheme's largest error over the largest ``|a @ b|`` (float64), beside float32's."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    ref = a.double() @ b.double()
    scale = ref.abs().max().item()

    def err(out: torch.Tensor) -> float:
        return (out.double() - ref).abs().max().item() / scale

    with state.preserved():
        torch.backends.fp32_precision = "ieee"
        found = {"fp32 (IEEE)": err(a @ b)}
    found.update({s: err(emulated(a, b, s)) for s in schemes})
    return SchemeErrors(shape, found)


def accepted(path: str, values: Sequence[str]) -> dict[str, str]:
    """Which ``values`` torch accepts for ``torch.backends.<path>.fp32_precision``
    (``path`` such as ``cuda.matmul``): ``"accepted"`` or the error, one line; the switch is
    restored after each try."""
    node = torch.backends
    for part in path.split("."):
        node = getattr(node, part)
    out = {}
    for value in values:
        with state.preserved():
            try:
                node.fp32_precision = value
                out[value] = "accepted"
            except (RuntimeError, ValueError) as err:
                out[value] = error_line(err)
    return out

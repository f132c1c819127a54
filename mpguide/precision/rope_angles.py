"""Rotary position angles (``position * inv_freq``) computed the ways models compute them, and
how many distinct angles survive the dtype the active autocast gives each way.

A RoPE module multiplies positions by inverse frequencies: with a matmul (transformers,
diffusers), :func:`torch.outer`, :func:`torch.einsum` or a broadcast multiply. Under autocast
some of these ops are on the lower-precision list and return bf16 angles even from float32
operands; bf16 keeps 8 significant bits, so neighbouring positions far from 0 share an angle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mpguide import MPGuideError
from mpguide.core import device


def inv_freq(dim: int, base: float = 10_000.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``dim // 2`` float32 inverse frequencies ``base ** (-2i / dim)`` of a RoPE head."""
    if dim < 2 or dim % 2:
        raise MPGuideError(f"a RoPE head dimension is even and at least 2, got {dim}")
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (base**exponent)


def _matmul(pos: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    # transformers' and diffusers' form: inv_freq[None, :, None] @ positions[:, None, :]
    return (inv[None, :, None] @ pos[None, None, :]).squeeze(0).transpose(0, 1)


WAYS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "matmul (inv_freq @ positions)": _matmul,
    "torch.outer(positions, inv_freq)": torch.outer,
    'torch.einsum("i,j->ij")': lambda pos, inv: torch.einsum("i,j->ij", pos, inv),
    "positions[:, None] * inv_freq": lambda pos, inv: pos[:, None] * inv[None, :],
}
"""The ways RoPE modules compute the ``(positions, dim // 2)`` angle table, by name."""


def angles(positions: torch.Tensor, inv: torch.Tensor, way: str) -> torch.Tensor:
    """The angle table of float32 ``positions`` and ``inv`` computed with ``way`` (a key of
    :data:`WAYS`), under whatever autocast is active: its dtype is what autocast chose."""
    if way not in WAYS:
        raise MPGuideError(f"unknown way {way!r}; choose one of {', '.join(WAYS)}")
    return WAYS[way](positions.float(), inv.float())


@dataclass(frozen=True)
class Window:
    """The angles of ``positions`` consecutive positions from ``offset``, at the fastest
    frequency (``inv_freq = 1``), against float64."""

    offset: int
    positions: int
    dtype: torch.dtype
    distinct: int
    max_angle_error: float
    max_cos_error: float


def window(
    offset: int,
    positions: int,
    dim: int,
    base: float,
    way: str,
    autocast_dtype: torch.dtype | None,
    guarded: bool = False,
) -> Window:
    """Angles of positions ``offset .. offset + positions - 1`` on the CPU, computed with
    ``way`` under CPU autocast to ``autocast_dtype`` (``None``: autocast off), inside an inner
    ``autocast(enabled=False)`` if ``guarded`` (the fix transformers applies), compared at the
    fastest frequency with the same product in float64."""
    pos = torch.arange(offset, offset + positions, dtype=torch.float64)
    inv = inv_freq(dim, base)
    on, dt = autocast_dtype is not None, autocast_dtype or torch.bfloat16
    with (
        torch.autocast("cpu", dtype=dt, enabled=on),
        torch.autocast("cpu", dtype=dt, enabled=on and not guarded),
    ):
        table = angles(pos.float(), inv, way)
    fastest = table[:, 0].double()
    exact = pos * inv[0].double()
    return Window(
        offset=offset,
        positions=positions,
        dtype=table.dtype,
        distinct=int(torch.unique(fastest).numel()),
        max_angle_error=(fastest - exact).abs().max().item(),
        max_cos_error=(torch.cos(fastest) - torch.cos(exact)).abs().max().item(),
    )


def autocast_dtypes(dev_type: str, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype of the angle table each of :data:`WAYS` returns from float32 operands under
    ``dev_type``'s autocast to ``dtype``: live on the CPU, simulated (fake tensors, this build's
    dispatch rules) on another device type."""
    if dev_type == "cpu":
        pos, inv = torch.arange(8.0), inv_freq(8)
        with torch.autocast("cpu", dtype=dtype):
            return {way: angles(pos, inv, way).dtype for way in WAYS}
    with device.simulate(dev_type, dtype) as dev:
        pos, inv = torch.arange(8.0, device=dev), inv_freq(8, device=dev)
        return {way: angles(pos, inv, way).dtype for way in WAYS}

"""An fp8 KV cache emulated on any device: keys and values divided by a scale, saturated to the
format's largest value, cast to fp8 with torch's cast, multiplied back; and the attention
output from the cache against the one from the float32 keys and values.

The scale is what an engine has: 1.0 when the checkpoint ships none (vLLM's and SGLang's
default), one per tensor from its amax (calibrated, or computed on the first batch), or one per
KV head from that head's amax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mpguide import MPGuideError
from mpguide.precision.lowbit_errors import rel_error

SCALINGS = ("scale 1.0", "per-tensor amax", "per-head amax")


def scale_for(
    x: torch.Tensor, scaling: str, fmt: torch.dtype = torch.float8_e4m3fn
) -> torch.Tensor:
    """The dequantization scale of a ``(batch, heads, seq, dim)`` tensor under ``scaling``
    (one of :data:`SCALINGS`): stored value = ``x / scale``; broadcastable to ``x``."""
    fmax = torch.finfo(fmt).max
    if scaling == "scale 1.0":
        return torch.ones((), device=x.device)
    if scaling == "per-tensor amax":
        return (x.abs().amax().float() / fmax).clamp(min=1e-12)
    if scaling == "per-head amax":
        return (x.abs().amax(dim=(0, 2, 3), keepdim=True).float() / fmax).clamp(min=1e-12)
    raise MPGuideError(f"unknown scaling {scaling!r}; choose one of {', '.join(SCALINGS)}")


@dataclass(frozen=True)
class Cached:
    """A tensor as the fp8 cache gives it back."""

    values: torch.Tensor
    saturated: float
    """Share of elements above the format's largest value after scaling."""
    flushed: float
    """Share of non-zero elements stored as zero."""


def through_cache(x: torch.Tensor, scaling: str, fmt: torch.dtype = torch.float8_e4m3fn) -> Cached:
    """``x`` stored in an fp8 cache of ``fmt`` under ``scaling`` and read back in float32."""
    scale = scale_for(x, scaling, fmt)
    fmax = torch.finfo(fmt).max
    scaled = x.float() / scale
    stored = scaled.clamp(-fmax, fmax).to(fmt)
    nonzero = x != 0
    return Cached(
        values=stored.float() * scale,
        saturated=(scaled.abs() > fmax).float().mean().item(),
        flushed=((stored.float() == 0) & nonzero).float().sum().item() / max(int(nonzero.sum()), 1),
    )


def keys_values(
    batch: int = 2,
    heads: int = 4,
    seq: int = 256,
    dim: int = 64,
    *,
    key_outlier: float = 600.0,
    outlier_channels: int = 2,
    value_std: float = 0.02,
    loud_value_std: float = 20.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values shaped ``(batch, heads, seq, dim)`` like a served model's:
    keys of the first head have ``outlier_channels`` channels near ``key_outlier`` (large
    key channels, as from a k-projection bias); values are small (standard deviation
    ``value_std``) except in the last head (``loud_value_std``)."""
    q = torch.randn(batch, heads, seq, dim, generator=generator) / dim**0.5
    k = torch.randn(batch, heads, seq, dim, generator=generator)
    k[:, 0, :, :outlier_channels] += key_outlier
    v = value_std * torch.randn(batch, heads, seq, dim, generator=generator)
    v[:, -1] *= loud_value_std / value_std
    return q, k, v


def worst_head_error(approx: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest relative error of one head (dimension 1) of ``(batch, heads, seq, dim)``."""
    return max(rel_error(approx[:, h], ref[:, h]) for h in range(ref.shape[1]))


@dataclass(frozen=True)
class CacheError:
    """One scaling: the error of K, V and the attention output read from the cache."""

    scaling: str
    key_error: float
    value_error: float
    output_error: float
    keys_saturated: float
    values_flushed: float


def cache_errors(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: torch.dtype = torch.float8_e4m3fn
) -> tuple[CacheError, ...]:
    """Each of :data:`SCALINGS`: relative errors (``||approx - ref|| / ||ref||``, of the worst
    head) of the cached K and V and of causal attention over them, against float32 K and V."""
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = []
    for scaling in SCALINGS:
        kc, vc = through_cache(k, scaling, fmt), through_cache(v, scaling, fmt)
        approx = F.scaled_dot_product_attention(q, kc.values, vc.values, is_causal=True)
        out.append(
            CacheError(
                scaling=scaling,
                key_error=worst_head_error(kc.values, k),
                value_error=worst_head_error(vc.values, v),
                output_error=worst_head_error(approx, exact),
                keys_saturated=kc.saturated,
                values_flushed=vc.flushed,
            )
        )
    return tuple(out)

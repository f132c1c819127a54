"""Why bf16 weights need a float32 master copy: updates smaller than half a weight's spacing
are lost when added in bf16.

:func:`train` fits a tiny regression with float32, bfloat16, or bfloat16 weights updated
through a float32 master copy, and records the loss and the updates bf16 could not hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mpguide import MPGuideError
from mpguide.core import device as _device

WEIGHTS = ("float32", "bfloat16", "master")


def spacing(t: torch.Tensor) -> torch.Tensor:
    """The gap to the next representable value above each element, in ``t``'s dtype."""
    return torch.nextafter(t, torch.full_like(t, float("inf"))) - t


def lost(weight: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """Where a nonzero ``update`` leaves ``weight`` unchanged once added in ``weight``'s dtype."""
    return (weight + update.to(weight.dtype) == weight) & (update != 0)


@dataclass(frozen=True)
class Curve:
    """The loss of a training run per step, and the share of weight updates that were lost."""

    weights: str
    losses: tuple[float, ...] = field(repr=False)
    lost_share: tuple[float, ...] = field(repr=False)

    @property
    def final(self) -> float:
        return self.losses[-1]

    def __repr__(self) -> str:
        return (
            f"{self.weights}: {len(self.losses)} steps, loss {self.losses[0]:.4g} -> "
            f"{self.final:.4g}, {self.lost_share[-1]:.0%} of updates lost at the end"
        )


def train(
    weights: str,
    steps: int = 300,
    lr: float = 0.02,
    seed: int = 0,
    dev: torch.device | str | None = None,
) -> Curve:
    """Fit ``y = X w*`` by plain SGD with one of :data:`WEIGHTS`.

    ``float32`` and ``bfloat16`` keep the weights in that dtype and update them in place;
    ``master`` keeps bf16 weights for the forward and backward, and applies each update to a
    float32 copy that is cast back to the bf16 weights after every step. The weights start at
    one (so bf16's spacing there is ``2**-7``); the loss is computed in float32.
    """
    if weights not in WEIGHTS:
        raise MPGuideError(f"unknown weights {weights!r}; choose one of {', '.join(WEIGHTS)}")
    dev = _device.pick() if dev is None else _device.resolve(str(dev))
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same data on every device
    x = torch.randn(256, 16, generator=gen).to(dev)
    target = x @ (1 + 0.05 * torch.randn(16, 1, generator=gen)).to(dev)
    dtype = torch.float32 if weights == "float32" else torch.bfloat16
    w = torch.ones(16, 1, device=dev, dtype=dtype, requires_grad=True)
    master = w.detach().float() if weights == "master" else None
    inputs = x.to(dtype)
    losses, shares = [], []
    for _ in range(steps):
        loss = ((inputs @ w).float() - target).pow(2).mean()
        (grad,) = torch.autograd.grad(loss, w)
        with torch.no_grad():
            update = -lr * grad.float()
            held = w if master is None else master
            shares.append(lost(held, update).float().mean().item())
            held.add_(update.to(held.dtype))
            if master is not None:
                w.copy_(master)
        losses.append(loss.item())
    return Curve(weights, tuple(losses), tuple(shares))

"""LoRA adapters on a bf16 base: the dtypes the base and adapter matmuls run in, and how much
of an optimizer update a bf16 adapter keeps.

:class:`LoRALinear` computes as PEFT's LoRA ``Linear`` does: the frozen base layer on the
input as it comes, the input cast to the adapter's dtype for ``B(A(x))``, the sum cast back
to the base result's dtype. :func:`kept_update` trains the same adapter in float32 and in
bf16 and compares the change each made to its weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from mpguide import MPGuideError


class LoRALinear(nn.Module):
    """``base(x) + scaling * B(A(x))`` with ``base`` frozen and ``A``, ``B`` in ``dtype``."""

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0, dtype=torch.float32):
        super().__init__()
        self.base = base.requires_grad_(False)
        dev = base.weight.device
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=dev, dtype=dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=dev, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        result_dtype = result.dtype
        adapted = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))) * self.scaling
        return (result + adapted).to(result_dtype)


def adapter(dtype: torch.dtype, width: int = 64, rank: int = 8, seed: int = 0) -> LoRALinear:
    """A seeded bf16 base ``Linear(width, width)`` with a LoRA adapter in ``dtype``; the
    adapter's initial values are the same for every ``dtype`` (made in float32, then cast)."""
    torch.manual_seed(seed)
    base = nn.Linear(width, width).to(torch.bfloat16)
    layer = LoRALinear(base, rank)
    return layer.to(dtype) if dtype != torch.float32 else layer


def _retype(layer: LoRALinear, dtype: torch.dtype) -> LoRALinear:
    layer.lora_A.to(dtype)
    layer.lora_B.to(dtype)
    return layer


@dataclass(frozen=True)
class KeptUpdate:
    """The change ``steps`` AdamW steps made to ``A`` in float32 and in bf16, and the share of
    ``A``'s elements left unchanged by the first step that gives ``A`` a gradient (the second:
    ``B`` starts at zero), per dtype."""

    steps: int
    lr: float
    unchanged_first_step: dict[str, float]
    update_norm: dict[str, float]
    lost: float
    """``|ΔA_bf16 - ΔA_fp32| / |ΔA_fp32|``: the part of the float32 update bf16 did not make."""


def kept_update(steps: int = 20, lr: float = 1e-4, width: int = 64, seed: int = 0) -> KeptUpdate:
    """Train the adapter of :func:`adapter` (the base frozen, bf16) towards a fixed random
    target for ``steps`` AdamW steps, once with float32 adapter weights and once with bf16."""
    if steps < 1 or lr <= 0:
        raise MPGuideError(f"need steps >= 1 and lr > 0, got {steps} and {lr}")
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(32, width, generator=gen).bfloat16()
    target = torch.randn(32, width, generator=gen).bfloat16()
    unchanged, delta = {}, {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        layer = _retype(adapter(torch.float32, width, seed=seed), dtype)
        start = layer.lora_A.weight.detach().double().clone()
        opt = torch.optim.AdamW([layer.lora_A.weight, layer.lora_B.weight], lr=lr, weight_decay=0.0)
        for step in range(steps):
            before = layer.lora_A.weight.detach().clone()
            loss = (layer(x).float() - target.float()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 1:  # B starts at zero, so A's gradient is zero on the first step
                unchanged[name] = (layer.lora_A.weight == before).float().mean().item()
        delta[name] = layer.lora_A.weight.detach().double() - start
    if steps < 2:
        unchanged = {k: float("nan") for k in delta}
    lost = ((delta["bfloat16"] - delta["float32"]).norm() / delta["float32"].norm()).item()
    return KeptUpdate(steps, lr, unchanged, {k: v.norm().item() for k, v in delta.items()}, lost)

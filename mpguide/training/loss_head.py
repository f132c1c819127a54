"""The loss head of a language model (the lm_head linear layer and cross-entropy) computed
the ways trainers compute it: bf16 logits, logits cast to float32, a float32 matmul, chunks
of tokens recomputed in the backward pass, and torch's ``F.linear_cross_entropy`` where the
installed torch has it. Each is compared with float64 (the loss and the gradient of the
hidden states) and measured for the peak bytes its forward and backward allocate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mpguide.precision.lowbit_errors import rel_error
from mpguide.training.peak_bytes import PeakBytes

Head = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def bf16_logits(h: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w), target)


def float_logits(h: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), target)


def float32_matmul(h: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h.float(), w.float()), target)


def _chunk_loss(h: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), target, reduction="sum")


def chunked(chunks: int) -> Head:
    """Cross-entropy summed over ``chunks`` slices of the tokens, each slice's float32 logits
    recomputed in the backward pass (``torch.utils.checkpoint``), so one slice of logits is
    alive at a time."""

    def head(h: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        total = sum(
            checkpoint(_chunk_loss, hc, w, tc, use_reentrant=False)
            for hc, tc in zip(h.chunk(chunks), target.chunk(chunks), strict=True)
        )
        return total / target.numel()

    return head


def torch_linear_cross_entropy(**options) -> Head | None:
    """``F.linear_cross_entropy`` with ``LinearCrossEntropyOptions(**options)`` (the chunked
    path), or with ``options=None`` (the reference path) when none are given; ``None`` where
    the installed torch has no ``F.linear_cross_entropy``."""
    fn = getattr(F, "linear_cross_entropy", None)
    if fn is None:
        return None
    opts = torch.nn.LinearCrossEntropyOptions(**options) if options else None

    def head(h: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return fn(h, w, target, options=opts)

    return head


@dataclass(frozen=True)
class HeadResult:
    """One way of computing the loss head, against float64."""

    name: str
    loss_dtype: torch.dtype
    loss_error: float
    """``|loss - loss64|`` in nats."""
    grad_error: float
    """Relative error of the gradient of the hidden states."""
    peak_bytes: int
    """Peak bytes the forward and backward allocated (:class:`PeakBytes`)."""


def measure(
    name: str, head: Head, h: torch.Tensor, w: torch.Tensor, target: torch.Tensor
) -> HeadResult:
    """Run ``head`` forward and backward on bf16 ``h`` (tokens, hidden) and ``w`` (vocab,
    hidden) and compare loss and ``h.grad`` with the float64 computation."""
    h64 = h.detach().double().requires_grad_()
    loss64 = F.cross_entropy(F.linear(h64, w.detach().double()), target)
    loss64.backward()
    x = h.detach().requires_grad_()
    weight = w.detach().requires_grad_()
    with PeakBytes() as mem:
        loss = head(x, weight, target)
        loss.backward()
    return HeadResult(
        name=name,
        loss_dtype=loss.dtype,
        loss_error=abs(loss.double().item() - loss64.item()),
        grad_error=rel_error(x.grad, h64.grad),
        peak_bytes=mem.peak,
    )

"""A mixture-of-experts router's top-k choice from bf16 and from float32 gate logits.

The gate is a matmul of the hidden states (bf16 in a served model) with the router weight;
its logits are written in the output dtype. A bf16 output keeps 8 significant bits, so two
experts whose logits are closer than that swap or tie, and the token goes to another expert
set. Ways to get float32 logits: ``torch.mm(x, w.t(), out_dtype=torch.float32)`` (a bf16
matmul that writes float32; torch 2.13 has no CPU kernel for it, see
:func:`out_dtype_support`), or a float32 gate (``F.linear(x.float(), w.float())``), which
casts the activations as well.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mpguide import MPGuideError


def _bf16_gate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _upcast_after(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w).float()


def _float32_gate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float())


def _out_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, w.t(), out_dtype=torch.float32)


GATES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "bf16 gate (bf16 logits)": _bf16_gate,
    "bf16 gate, logits .float() after": _upcast_after,
    "float32 gate (x.float(), w.float())": _float32_gate,
    "torch.mm(..., out_dtype=float32)": _out_dtype,
}
"""How engines compute the router logits from bf16 ``x`` and ``w``, by name."""


def out_dtype_support(dev: torch.device) -> str:
    """``""`` where ``torch.mm(bf16, bf16, out_dtype=torch.float32)`` runs on ``dev``, else the
    first sentence of the error this torch raises."""
    a = torch.ones(2, 2, dtype=torch.bfloat16, device=dev)
    try:
        torch.mm(a, a, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, TypeError) as err:
        return str(err).splitlines()[0].split(". ")[0].rstrip(".") + "."
    return ""


@dataclass(frozen=True)
class Routing:
    """One way of computing the logits against the float64 logits of the same bf16 inputs."""

    gate: str
    logits_dtype: torch.dtype
    changed: float
    """Share of tokens whose top-k expert set differs from float64's."""
    weight_moved: float
    """Mean share of a token's routing weight that goes to another expert than float64's."""
    max_logit_error: float


def routing(x: torch.Tensor, w: torch.Tensor, k: int, gate: str) -> Routing:
    """Route bf16 ``x`` (tokens, hidden) with bf16 ``w`` (experts, hidden) through ``gate``
    (a key of :data:`GATES`): top-``k`` experts and softmax weights over them, compared with
    the same route from float64 logits."""
    if gate not in GATES:
        raise MPGuideError(f"unknown gate {gate!r}; choose one of {', '.join(GATES)}")
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise MPGuideError(f"the router takes bf16 inputs, got {x.dtype} and {w.dtype}")
    exact = x.double() @ w.double().t()
    logits = GATES[gate](x, w)
    return Routing(
        gate=gate,
        logits_dtype=logits.dtype,
        changed=_changed(logits, exact, k),
        weight_moved=_weight_moved(logits, exact, k),
        max_logit_error=(logits.double() - exact).abs().max().item(),
    )


def _changed(logits: torch.Tensor, exact: torch.Tensor, k: int) -> float:
    got = torch.topk(logits.float(), k, dim=-1).indices.sort(-1).values
    want = torch.topk(exact, k, dim=-1).indices.sort(-1).values
    return (got != want).any(-1).float().mean().item()


def _weight_moved(logits: torch.Tensor, exact: torch.Tensor, k: int) -> float:
    def weights(lg: torch.Tensor) -> torch.Tensor:
        top = torch.topk(lg.double(), k, dim=-1)
        dense = torch.zeros_like(lg, dtype=torch.float64)
        return dense.scatter(-1, top.indices, torch.softmax(top.values, -1))

    return (0.5 * (weights(logits) - weights(exact)).abs().sum(-1)).mean().item()

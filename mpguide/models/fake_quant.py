"""Post-training quantization emulated on a whole model: every linear layer's weight (W4A16),
or its weight and its input (W4A4), quantized by a recipe of
:mod:`mpguide.precision.recipes` (NVFP4, MXFP4, ...) and the GEMM run in float32, and how far
the model's output moves: logits error, top-1 agreement and KL divergence against the
unquantized model, with each layer's own output error on the way.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mpguide import MPGuideError
from mpguide.core.table import Table
from mpguide.precision import lowbit_errors, recipes


def _q(x: torch.Tensor, recipe: str) -> torch.Tensor:
    return recipes.quantize(x.float(), recipe).values.to(x.dtype)


@contextmanager
def quantized(
    model: nn.Module, recipe: str, activations: bool, skip: tuple[str, ...] = ()
) -> Iterator[dict[str, float]]:
    """Inside the block every ``nn.Linear`` of ``model`` (but those whose name ends with one of
    ``skip``) computes with its weight, and with ``activations`` its input too, quantized by
    ``recipe``; yields ``{layer: output error}``, filled as the layers run (each layer's output
    against the float64 GEMM of its unquantized input and weight)."""
    if recipe not in recipes.RECIPES:
        raise MPGuideError(f"unknown recipe {recipe!r}; choose one of {', '.join(recipes.RECIPES)}")
    errors: dict[str, float] = {}
    patched = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or name.endswith(skip):
            continue

        def forward(x, mod=mod, name=name):
            qx = _q(x, recipe) if activations else x
            out = F.linear(qx, _q(mod.weight, recipe), mod.bias)
            ref = F.linear(
                x.double(), mod.weight.double(), None if mod.bias is None else mod.bias.double()
            )
            errors.setdefault(name, lowbit_errors.rel_error(out, ref))
            return out

        patched.append(mod)
        mod.forward = forward
    try:
        yield errors
    finally:
        for mod in patched:
            del mod.forward


@dataclass(frozen=True)
class Outcome:
    """One quantization of the whole model."""

    label: str
    logits_error: float
    top1_agreement: float
    kl: float
    layer_errors: dict[str, float]

    @property
    def median_layer_error(self) -> float:
        return statistics.median(self.layer_errors.values())

    @property
    def worst_layer(self) -> str:
        return max(self.layer_errors, key=self.layer_errors.get)


def _logits(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits.float()


def compare(
    model: nn.Module,
    inputs: dict[str, Any],
    recipes_: tuple[str, ...] = ("nvfp4", "mxfp4"),
    skip: tuple[str, ...] = ("lm_head",),
) -> tuple[Outcome, ...]:
    """W4A16 and W4A4 under each recipe, against ``model`` unquantized (its own dtype)."""
    ref = _logits(model, inputs)
    ref_logp = ref.log_softmax(-1)
    out = []
    for recipe in recipes_:
        for activations in (False, True):
            with quantized(model, recipe, activations, skip) as errors:
                got = _logits(model, inputs)
            logp = got.log_softmax(-1)
            out.append(
                Outcome(
                    f"{'W4A4' if activations else 'W4A16'} {recipe}",
                    lowbit_errors.rel_error(got, ref),
                    (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                    F.kl_div(logp, ref_logp, log_target=True, reduction="none")
                    .sum(-1)
                    .mean()
                    .item(),
                    dict(errors),
                )
            )
    return tuple(out)


def table(outcomes: tuple[Outcome, ...], caption: str = "") -> Table:
    rows = tuple(
        (
            o.label,
            o.median_layer_error,
            o.worst_layer,
            o.layer_errors[o.worst_layer],
            o.logits_error,
            o.top1_agreement,
            o.kl,
        )
        for o in outcomes
    )
    return Table(
        (
            "scheme",
            "median layer error",
            "worst layer",
            "its error",
            "logits error",
            "top-1 agreement",
            "KL (nats/token)",
        ),
        rows,
        caption,
    )

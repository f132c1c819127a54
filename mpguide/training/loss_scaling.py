"""Loss scaling: where float32 values land in a low-precision format once scaled
(:func:`landing`), the gradients of one backward pass under autocast (:func:`gradients`), and
the scale a GradScaler keeps, by its documented rule (:func:`scale_schedule`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from mpguide import MPGuideError
from mpguide.core import dtypes as _dtypes
from mpguide.core.table import Table

# -- where values land in a format ------------------------------------------------------------


@dataclass(frozen=True)
class Landing:
    """Where the nonzero values of a float32 tensor land once multiplied by ``scale`` and cast
    to ``dtype``: flushed to zero, subnormal, normal, or overflowed to infinity."""

    dtype: torch.dtype
    scale: float
    values: int
    flushed: int
    subnormal: int
    overflow: int

    @property
    def normal(self) -> int:
        return self.values - self.flushed - self.subnormal - self.overflow

    def share(self, outcome: str) -> float:
        """The share of the values that were ``flushed``, ``subnormal``, ``normal`` or ``overflow``."""
        if outcome not in LANDINGS:
            raise MPGuideError(f"unknown outcome {outcome!r}; choose one of {', '.join(LANDINGS)}")
        return getattr(self, outcome) / self.values if self.values else 0.0

    def row(self) -> tuple:
        return (
            _dtypes.short(self.dtype),
            f"2**{math.log2(self.scale):g}",
            self.values,
            *(f"{self.share(o):.2%}" for o in LANDINGS),
        )

    def __repr__(self) -> str:
        parts = ", ".join(f"{self.share(o):.2%} {o}" for o in LANDINGS)
        return f"{self.values} values x {self.scale:g} in {_dtypes.name(self.dtype)}: {parts}"


LANDINGS = ("flushed", "subnormal", "normal", "overflow")
"""Where a nonzero value can land in a format."""


def landing(values: torch.Tensor, dtype: torch.dtype | str, scale: float = 1.0) -> Landing:
    """Multiply the nonzero ``values`` by ``scale`` in float32 (exact for a power of two) and
    cast them to ``dtype``: how many became zero, subnormal, infinite, or stayed normal."""
    dt = _dtypes.parse(dtype)
    if not values.is_floating_point():
        raise MPGuideError(f"landing needs floating values, got {values.dtype}")
    if not (math.isfinite(scale) and scale > 0):
        raise MPGuideError(f"the scale must be a positive finite number, got {scale}")
    x = values.detach().float().flatten()
    cast = (x[x != 0] * scale).to(dt)
    tiny = torch.finfo(dt).smallest_normal
    return Landing(
        dtype=dt,
        scale=float(scale),
        values=cast.numel(),
        flushed=int((cast == 0).sum()),
        subnormal=int(((cast != 0) & (cast.abs() < tiny)).sum()),
        overflow=int(torch.isinf(cast).sum()),
    )


def landing_table(landings: Sequence[Landing], caption: str = "") -> Table:
    """Landings side by side: one row per dtype and scale."""
    return Table(("dtype", "scale", "values", *LANDINGS), tuple(x.row() for x in landings), caption)


# -- the gradients of one backward pass ---------------------------------------------------------


@dataclass(frozen=True)
class Gradients:
    """The gradients of one backward pass of a classifier, divided back by the loss scale and
    held in float32: of its parameters, and of the output of each ``nn.Linear`` (the
    activation gradients), which autocast computes in its low-precision dtype."""

    autocast: torch.dtype | None
    scale: float
    activation_dtype: torch.dtype
    parameters: torch.Tensor = field(repr=False, compare=False)
    activations: torch.Tensor = field(repr=False, compare=False)

    def flushed(self, reference: Gradients) -> tuple[float, float]:
        """The shares of parameter and of activation gradients that are zero here and nonzero
        in ``reference`` (the same pass in float32)."""
        pairs = ((self.parameters, reference.parameters), (self.activations, reference.activations))
        for mine, theirs in pairs:
            if mine.shape != theirs.shape:
                raise MPGuideError("the reference comes from another model or batch")
        return tuple(((m == 0) & (r != 0)).float().mean().item() for m, r in pairs)

    @property
    def label(self) -> str:
        how = "float32" if self.autocast is None else f"autocast {_dtypes.short(self.autocast)}"
        return f"{how}, loss x {self.scale:g}"

    def __repr__(self) -> str:
        return (
            f"{self.label}: {self.parameters.numel()} parameter gradients, "
            f"{self.activations.numel()} activation gradients in "
            f"{_dtypes.name(self.activation_dtype)}"
        )


def gradients(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    autocast: torch.dtype | str | None = None,
    scale: float = 1.0,
) -> Gradients:
    """Run ``model`` on ``inputs`` (under ``autocast`` for their device when given), take the
    cross-entropy against ``targets`` in float32, multiply it by ``scale``, run the backward
    pass and collect the gradients. ``model``'s own gradients are left as they were."""
    if not (math.isfinite(scale) and scale > 0):
        raise MPGuideError(f"the scale must be a positive finite number, got {scale}")
    dt = None if autocast is None else _dtypes.autocast_dtype(autocast)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise MPGuideError("the model has no nn.Linear whose output gradients could be read")
    params = [p for p in model.parameters() if p.requires_grad]
    seen: list[torch.Tensor] = []

    def watch(_module, _inputs, out):  # the gradient of each output, as backward computes it
        out.register_hook(seen.append)

    hooks = [m.register_forward_hook(watch) for m in linears]
    try:
        with torch.autocast(inputs.device.type, dtype=dt or torch.bfloat16, enabled=dt is not None):
            logits = model(inputs)
        loss = nn.functional.cross_entropy(logits.float(), targets) * scale
        grads = torch.autograd.grad(loss, params)
    finally:
        for h in hooks:
            h.remove()
    return Gradients(
        autocast=dt,
        scale=float(scale),
        activation_dtype=seen[0].dtype,
        parameters=torch.cat([g.float().flatten() for g in grads]) / scale,
        activations=torch.cat([g.float().flatten() for g in seen]) / scale,
    )


# -- the loss scale ---------------------------------------------------------------------------


def scale_schedule(
    found_inf: Iterable[bool],
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
) -> tuple[float, ...]:
    """The loss scale a GradScaler uses at each step, by the rule its documentation states,
    given whether each step's gradients held an inf or NaN: such a step is skipped and the
    scale multiplied by ``backoff_factor``; ``growth_interval`` clean steps in a row multiply
    it by ``growth_factor``."""
    if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1):
        raise MPGuideError(
            "need init_scale > 0, growth_factor > 1 and 0 < backoff_factor < 1, got "
            f"{init_scale}, {growth_factor} and {backoff_factor}"
        )
    if growth_interval < 1:
        raise MPGuideError(f"growth_interval must be at least 1, got {growth_interval}")
    scales, scale, clean = [], float(init_scale), 0
    for inf in found_inf:
        scales.append(scale)
        clean = 0 if inf else clean + 1
        if inf:
            scale *= backoff_factor
        elif clean == growth_interval:
            scale, clean = scale * growth_factor, 0
    return tuple(scales)

"""Training-loop measurements: loss scaling, optimizer precision, layers with state, recompute
and the dtypes gradients are communicated in."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from mpguide import MPGuideError, error_line
from mpguide.autocast import device as _device
from mpguide.autocast import policy as _policy
from mpguide.core import dtypes as _dtypes
from mpguide.core import timing
from mpguide.core.table import Table

BF16, FP32 = torch.bfloat16, torch.float32
from mpguide.precision.numerics import ErrorStats, errors

# --- Loss scaling, optimizer precision, whole training loops (training pages 01, 02, 06) ---
#
# - where float32 values land in a format once scaled (:func:`landing`), and the gradients of
#   one backward pass under autocast (:func:`gradients`);
# - the scale a GradScaler keeps, by its documented rule (:func:`scale_schedule`);
# - writing an update into low-precision weights: rounded to nearest, stochastically rounded
#   (:func:`stochastic_round`) or Kahan-compensated (:func:`kahan_add_`), and
#   :class:`RoundedAdamW`, an AdamW whose step is computed in float32 and written back so;
# - the dtypes the built-in optimizers keep their states in (:func:`optimizer_states`);
# - a small next-character task (:func:`char_task`) trained by several recipes in lockstep
#   (:func:`train`).

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


# -- writing an update into low-precision weights ------------------------------------------------

ROUNDINGS = ("nearest", "stochastic", "kahan")
"""How an update is written into low-precision weights."""


def stochastic_round(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round float32 ``x`` to bfloat16 stochastically: up with probability equal to the
    distance from the bfloat16 value below, over the gap, so the expected result is ``x``.
    A random 16-bit integer is added to the low half of each float32 bit pattern, and the low
    half is then cut off. Infinities and NaNs stay as they are."""
    if x.dtype != torch.float32:
        raise MPGuideError(f"stochastic_round needs a float32 tensor, got {x.dtype}")
    noise = torch.randint(
        0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator
    )
    cut = ((x.view(torch.int32) + noise) & -(1 << 16)).view(torch.float32)
    return torch.where(torch.isfinite(x), cut, x).to(torch.bfloat16)


def kahan_add_(weight: torch.Tensor, compensation: torch.Tensor, update: torch.Tensor) -> None:
    """``weight += update`` with Kahan compensation: the part of each update that rounding to
    ``weight``'s dtype lost is kept in ``compensation`` (same shape, any float dtype) and added
    to the next update. The arithmetic is float32."""
    if compensation.shape != weight.shape:
        raise MPGuideError(
            f"the compensation has shape {tuple(compensation.shape)}, the weight "
            f"{tuple(weight.shape)}"
        )
    total = update.float() + compensation.float()
    new = (weight.float() + total).to(weight.dtype)
    compensation.copy_(total - (new.float() - weight.float()))
    weight.copy_(new)


def rounded_add_(
    weight: torch.Tensor,
    update: torch.Tensor,
    rounding: str = "nearest",
    compensation: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> None:
    """``weight += update``, the sum computed in float32 and written back into ``weight``'s
    dtype by ``rounding`` (one of :data:`ROUNDINGS`; ``kahan`` needs ``compensation``,
    ``stochastic`` bfloat16 weights)."""
    if rounding not in ROUNDINGS:
        raise MPGuideError(f"unknown rounding {rounding!r}; choose one of {', '.join(ROUNDINGS)}")
    if rounding == "kahan":
        if compensation is None:
            raise MPGuideError("Kahan summation needs a compensation tensor")
        kahan_add_(weight, compensation, update)
        return
    total = weight.float() + update.float()
    if rounding == "stochastic":
        if weight.dtype != torch.bfloat16:
            raise MPGuideError(f"stochastic rounding writes bfloat16 weights, not {weight.dtype}")
        total = stochastic_round(total, generator)
    weight.copy_(total)


def accumulate(
    start: torch.Tensor,
    update: float,
    steps: int,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Add the same ``update`` ``steps`` times to weights that start at ``start`` (and are held
    in its dtype) by ``rounding``; the weights after each step, in float32, one row per step
    (the first row is ``start``)."""
    if steps < 1:
        raise MPGuideError(f"steps must be at least 1, got {steps}")
    weight = start.detach().clone()
    comp = torch.zeros_like(weight) if rounding == "kahan" else None
    step = torch.full(weight.shape, float(update), device=weight.device)
    rows = [weight.float()]
    for _ in range(steps):
        rounded_add_(weight, step, rounding, comp, generator)
        rows.append(weight.float())
    return torch.stack(rows)


class RoundedAdamW(torch.optim.Optimizer):
    """AdamW for low-precision weights that keeps no float32 copy between steps.

    Each step runs torch's own AdamW arithmetic (:func:`torch.optim.adamw.adamw`) on float32
    copies of the weights, gradients and moments. The moments are stored back in the weights'
    dtype rounded to nearest; the weights take the update by ``rounding``: ``nearest``,
    ``stochastic`` (bfloat16 weights; :func:`stochastic_round`) or ``kahan`` (a compensation
    tensor in the weights' dtype per parameter; :func:`kahan_add_`). On float32 weights with
    ``nearest`` this is :class:`torch.optim.AdamW`.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        rounding: str = "nearest",
        generator: torch.Generator | None = None,
    ):
        if rounding not in ROUNDINGS:
            raise MPGuideError(
                f"unknown rounding {rounding!r}; choose one of {', '.join(ROUNDINGS)}"
            )
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        low = {p.dtype for g in self.param_groups for p in g["params"]}
        if rounding == "stochastic" and low != {torch.bfloat16}:
            names = ", ".join(sorted(map(_dtypes.name, low)))
            raise MPGuideError(f"stochastic rounding writes bfloat16 weights, not {names}")
        self.rounding = rounding
        self.generator = generator

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise MPGuideError("RoundedAdamW takes no closure")
        from torch.optim.adamw import adamw

        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            states = [self.state[p] for p in params]
            for p, s in zip(params, states, strict=True):
                if not s:
                    s["step"] = torch.tensor(0.0)
                    s["exp_avg"] = torch.zeros_like(p)
                    s["exp_avg_sq"] = torch.zeros_like(p)
                    if self.rounding == "kahan":
                        s["compensation"] = torch.zeros_like(p)

            def wide(ts):
                return [t.to(torch.float32, copy=True) for t in ts]

            weights = wide(params)
            moments = wide(s["exp_avg"] for s in states), wide(s["exp_avg_sq"] for s in states)
            beta1, beta2 = group["betas"]
            adamw(
                weights,
                wide(p.grad for p in params),
                *moments,
                [],
                [s["step"] for s in states],
                foreach=False,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )
            for p, s, new, m, v in zip(params, states, weights, *moments, strict=True):
                s["exp_avg"].copy_(m)
                s["exp_avg_sq"].copy_(v)
                update = new - p.float()
                rounded_add_(p, update, self.rounding, s.get("compensation"), self.generator)


# -- the dtypes optimizers keep their states in -------------------------------------------------

OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, {}),
    "AdamW(foreach=True)": (torch.optim.AdamW, {"foreach": True}),
    "AdamW(fused=True)": (torch.optim.AdamW, {"fused": True}),
    "SGD(momentum=0.9)": (torch.optim.SGD, {"momentum": 0.9}),
    "SGD(momentum=0.9, fused=True)": (torch.optim.SGD, {"momentum": 0.9, "fused": True}),
    "Adafactor": (torch.optim.Adafactor, {}),
}
"""Built-in optimizers, by how they are constructed, to their class and keyword arguments."""


@dataclass(frozen=True)
class StateDtypes:
    """The optimizer states one step leaves for a parameter of one dtype, on one device:
    ``(state, dtype, device type)`` per state, or the error that stopped the step."""

    optimizer: str
    weights: torch.dtype
    target: str
    how: str
    states: tuple[tuple[str, torch.dtype, str], ...]
    error: str = ""

    def dtype(self, state: str) -> torch.dtype:
        """The dtype of ``state`` (``exp_avg``, ``step``, ...)."""
        for name, dt, _ in self.states:
            if name == state:
                return dt
        raise MPGuideError(f"{self.optimizer} keeps no state {state!r}: {self.error or 'absent'}")

    def cell(self, state: str) -> torch.dtype | str:
        """What a table shows for ``state``: its dtype, ``needs hardware`` where the simulation
        could not run the step, the error where the device could not, or nothing."""
        if self.error:
            return (
                _device.NEEDS_HARDWARE if self.how == _device.SIMULATED else f"error: {self.error}"
            )
        return next((dt for name, dt, _ in self.states if name == state), "")


@dataclass(frozen=True)
class OptimizerStates:
    """State dtypes of several optimizers, for weights of several dtypes, on several devices."""

    results: tuple[StateDtypes, ...]

    def get(self, optimizer: str, weights: torch.dtype | str, target: str) -> StateDtypes:
        dt = _dtypes.parse(weights)
        for r in self.results:
            if (r.optimizer, r.weights, r.target) == (optimizer, dt, target):
                return r
        raise MPGuideError(f"no result for {optimizer} with {_dtypes.name(dt)} weights on {target}")

    def table(self) -> Table:
        """One row per optimizer state, one column per weight dtype and device: the state's
        dtype, ``needs hardware`` where a simulation could not run the step, or the error."""
        columns = list(dict.fromkeys((r.target, r.how, r.weights) for r in self.results))
        found = {(r.optimizer, r.target, r.how, r.weights): r for r in self.results}
        names: dict[str, dict[str, None]] = {}
        for r in self.results:
            names.setdefault(r.optimizer, {}).update(dict.fromkeys(n for n, _, _ in r.states))
        rows = tuple(
            (
                f"{opt}: {state}",
                *(found[(opt, *c)].cell(state) if (opt, *c) in found else "" for c in columns),
            )
            for opt, states in names.items()
            for state in (states or ["-"])
        )
        headers = tuple(
            f"{_dtypes.short(w)} weights, {_device.label(t, how)}" for t, how, w in columns
        )
        return Table(
            ("state", *headers), rows, f"optimizer states after one step, torch {torch.__version__}"
        )

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def _state_dtypes(name: str, weights: torch.dtype, target: _device.Target) -> StateDtypes:
    cls, kwargs = OPTIMIZERS[name]
    try:
        with _device.tensors(target):
            p = nn.Parameter(torch.ones(4, 8, device=target.device, dtype=weights))
            p.grad = torch.full_like(p, 0.1)
            opt = cls([p], **kwargs)
            opt.step()
            states = tuple((k, v.dtype, v.device.type) for k, v in opt.state[p].items())
        return StateDtypes(name, weights, target.device.type, target.how, states)
    except Exception as err:  # noqa: BLE001 - the table reports what stopped the step
        return StateDtypes(name, weights, target.device.type, target.how, (), error_line(err))


def optimizer_states(
    optimizers: Sequence[str] = tuple(OPTIMIZERS),
    weights: Sequence[torch.dtype | str] = ("float32", "bfloat16", "float16"),
    targets: Sequence[str] = ("cpu", "cuda"),
) -> OptimizerStates:
    """Construct each optimizer of :data:`OPTIMIZERS` over one 4 x 8 parameter of each weight
    dtype on each device (live where present, else simulated on fake tensors), take one step, and
    record the dtype and device of every state it keeps."""
    unknown = [o for o in optimizers if o not in OPTIMIZERS]
    if unknown:
        raise MPGuideError(
            f"unknown optimizer {unknown[0]!r}; choose among {', '.join(OPTIMIZERS)}"
        )
    dts = [_dtypes.parse(w) for w in weights]
    resolved = [_device.target(t) for t in targets]
    return OptimizerStates(
        tuple(_state_dtypes(o, w, t) for t in resolved for w in dts for o in optimizers)
    )


# -- a small task: the next character of a source file ------------------------------------------


@dataclass(frozen=True)
class CharTask:
    """Predict the next character of a text from the ``context`` characters before it. The
    first nine tenths of the text are for training, the last tenth is held out."""

    source: str
    context: int
    vocab: tuple[str, ...] = field(repr=False)
    codes: torch.Tensor = field(repr=False, compare=False)

    def batch(
        self, size: int, generator: torch.Generator, held_out: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``size`` random windows (on the generator's device): the context and the next code."""
        if size < 1:
            raise MPGuideError(f"a batch needs at least one sample, got {size}")
        split = len(self.codes) * 9 // 10
        low, high = (split, len(self.codes)) if held_out else (0, split)
        dev = generator.device
        starts = torch.randint(low, high - self.context, (size, 1), generator=generator, device=dev)
        windows = self.codes.to(dev)[starts + torch.arange(self.context + 1, device=dev)]
        return windows[:, :-1], windows[:, -1]

    def model(self, seed: int = 0, width: int = 128) -> nn.Module:
        """A small MLP over embedded characters, in float32 on the CPU, initialised from
        ``seed`` without touching the global random state."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return nn.Sequential(
                nn.Embedding(len(self.vocab), 16),
                nn.Flatten(),
                nn.Linear(16 * self.context, width),
                nn.GELU(),
                nn.Linear(width, width),
                nn.GELU(),
                nn.Linear(width, len(self.vocab)),
            )

    def __repr__(self) -> str:
        return (
            f"next character of {self.source}: {len(self.codes)} characters, "
            f"{len(self.vocab)} distinct, {self.context} of context"
        )


def char_task(context: int = 8) -> CharTask:
    """The task on the source of :mod:`torch.optim.optimizer` of the installed torch: a real
    text every installation has."""
    if context < 1:
        raise MPGuideError(f"the context must be at least one character, got {context}")
    import torch.optim.optimizer as module

    text = inspect.getsource(module)
    vocab = tuple(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    codes = torch.tensor([index[c] for c in text])
    return CharTask("torch/optim/optimizer.py", context, vocab, codes)


# -- recipes: how a training loop holds its weights and takes its steps -----------------------

UPDATES = ("adamw", "master", *ROUNDINGS)
"""How a recipe updates its weights: ``adamw``, :class:`torch.optim.AdamW` on the weights
themselves; ``master``, AdamW on a float32 copy that is cast into the weights after each step;
or :class:`RoundedAdamW` with one of :data:`ROUNDINGS`."""


@dataclass(frozen=True)
class Recipe:
    """One way to train: the dtype the weights are held in, the autocast dtype (if any), how
    the weights are updated (one of :data:`UPDATES`), and a GradScaler's initial scale and
    growth interval (no scaler when ``init_scale`` is ``None``)."""

    name: str
    weights: torch.dtype = torch.float32
    autocast: torch.dtype | None = None
    update: str = "adamw"
    init_scale: float | None = None
    growth_interval: int = 2000

    def __post_init__(self):
        if self.update not in UPDATES:
            raise MPGuideError(
                f"unknown update {self.update!r}; choose one of {', '.join(UPDATES)}"
            )
        if self.update != "adamw" and self.weights == torch.float32:
            raise MPGuideError(f"the {self.update!r} update is for low-precision weights")
        if self.update == "stochastic" and self.weights != torch.bfloat16:
            raise MPGuideError("stochastic rounding writes bfloat16 weights")
        if self.init_scale is not None:
            if not (math.isfinite(self.init_scale) and self.init_scale > 0):
                raise MPGuideError(f"init_scale must be positive and finite, got {self.init_scale}")
            if self.weights == torch.float16 and self.update == "adamw":
                raise MPGuideError("a GradScaler cannot unscale the gradients of fp16 weights")
        if self.growth_interval < 1:
            raise MPGuideError(f"growth_interval must be at least 1, got {self.growth_interval}")

    @property
    def setup(self) -> str:
        """The weights, autocast, update and scaler in a few words."""
        parts = [f"{_dtypes.short(self.weights)} weights"]
        if self.autocast is not None:
            parts.append(f"autocast {_dtypes.short(self.autocast)}")
        parts.append(
            {"adamw": "AdamW", "master": "AdamW on an fp32 master copy"}.get(
                self.update, f"fp32 AdamW step, written back by {self.update} rounding"
            )
        )
        if self.init_scale is not None:
            parts.append(f"GradScaler from 2**{math.log2(self.init_scale):g}")
        return ", ".join(parts)


RECIPES = {
    "fp32": Recipe("fp32"),
    "autocast-bf16": Recipe("autocast bf16", autocast=BF16),
    "autocast-fp16": Recipe(
        "autocast fp16 + GradScaler", autocast=torch.float16, init_scale=2.0**16
    ),
    "bf16": Recipe("pure bf16", weights=BF16),
    "bf16-master": Recipe("bf16 + fp32 master weights", weights=BF16, update="master"),
    "bf16-nearest": Recipe("bf16, round to nearest", weights=BF16, update="nearest"),
    "bf16-stochastic": Recipe("bf16 + stochastic rounding", weights=BF16, update="stochastic"),
    "bf16-kahan": Recipe("bf16 + Kahan summation", weights=BF16, update="kahan"),
}
"""The recipes by the short names pages and readers use."""


def recipe(name: str | Recipe) -> Recipe:
    """The recipe a short name stands for (see :data:`RECIPES`), or raise ``MPGuideError``."""
    if isinstance(name, Recipe):
        return name
    if name not in RECIPES:
        raise MPGuideError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]


@dataclass(frozen=True)
class Run:
    """One recipe trained: per step, the training loss, the loss scale used (with a scaler),
    whether the scaled gradients held an inf or NaN, and the shares of weights and of
    ``exp_avg_sq`` entries with a nonzero gradient that the step left as they were; the
    held-out loss every few steps; the step times; and the trained model."""

    recipe: Recipe
    losses: tuple[float, ...] = field(repr=False)
    evals: tuple[tuple[int, float], ...] = field(repr=False)
    scales: tuple[float, ...] = field(repr=False)
    found_inf: tuple[bool, ...] = field(repr=False)
    skipped: tuple[int, ...] = field(repr=False)
    weights_unchanged: tuple[float, ...] = field(repr=False)
    states_unchanged: tuple[float, ...] = field(repr=False)
    state_dtypes: tuple[tuple[str, torch.dtype], ...] = field(repr=False)
    bytes_per_parameter: float = field(repr=False)
    latency: timing.Latency = field(repr=False)
    model: nn.Module = field(repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.recipe.name

    @property
    def final(self) -> float:
        """The held-out loss after the last step."""
        return self.evals[-1][1]

    def __repr__(self) -> str:
        skipped = f", {len(self.skipped)} steps skipped" if self.recipe.init_scale else ""
        return (
            f"{self.name}: {len(self.losses)} steps, held-out loss {self.evals[0][1]:.4g} -> "
            f"{self.final:.4g}{skipped}, median step {self.latency.median * 1e3:.2f} ms"
        )


@dataclass(frozen=True)
class Runs:
    """Several recipes trained in lockstep on the same batches from the same initial weights."""

    runs: tuple[Run, ...]
    task: str
    machine: _device.Machine

    def __getitem__(self, name: str) -> Run:
        """The run of a recipe, by its name or its short name in :data:`RECIPES`."""
        wanted = RECIPES[name].name if name in RECIPES else name
        for r in self.runs:
            if r.name == wanted:
                return r
        raise MPGuideError(f"no run of {name!r}; these ran: {', '.join(r.name for r in self.runs)}")

    def table(self) -> Table:
        """One row per recipe: the final held-out loss and its difference from the
        first run's, skipped steps, bytes per parameter, and step times with their ratio to
        the first run's median."""
        first = self.runs[0]
        rows = tuple(
            (
                r.name,
                r.final,
                f"{r.final - first.final:+.4f}",
                len(r.skipped),
                r.bytes_per_parameter,
                r.latency.median * 1e3,
                r.latency.spread * 1e3,
                f"{r.latency.median / first.latency.median:.2f}",
            )
            for r in self.runs
        )
        columns = (
            "recipe",
            "held-out loss",
            f"vs {first.name}",
            "skipped steps",
            "bytes/param",
            "median ms/step",
            "IQR ms",
            f"time vs {first.name}",
        )
        steps = len(first.losses)
        caption = f"{self.task}, {steps} steps each, {self.machine.caption()}"
        notes = (
            (
                "bytes/param: weights, master copy, optimizer states and compensation kept "
                "between steps; gradients not counted."
            ),
            (
                "Step times: every recipe steps in turn on the same batch, so a background load "
                "hits all alike; medians and interquartile ranges over all steps."
            ),
        )
        return Table(columns, rows, caption, notes)

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


class _Loop:
    """One recipe's model, optimizer and scaler, stepping on the batches it is given."""

    def __init__(self, rec: Recipe, model: nn.Module, dev: torch.device, lr: float, seed: int):
        self.recipe = rec
        self.model = model.to(device=dev, dtype=rec.weights)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.master = None
        if rec.update == "adamw":
            self.optimizer = torch.optim.AdamW(self.params, lr=lr)
        elif rec.update == "master":
            self.master = [p.detach().float() for p in self.params]
            self.optimizer = torch.optim.AdamW(self.master, lr=lr)
        else:
            gen = torch.Generator(device=dev).manual_seed(seed + 1)
            self.optimizer = RoundedAdamW(self.params, lr=lr, rounding=rec.update, generator=gen)
        self.scaler = (
            None
            if rec.init_scale is None
            else torch.amp.GradScaler(
                dev.type, init_scale=rec.init_scale, growth_interval=rec.growth_interval
            )
        )
        self.sync = timing.synchronizer(dev)
        self.losses: list[float] = []
        self.scales: list[float] = []
        self.found_inf: list[bool] = []
        self.weights_unchanged: list[float] = []
        self.states_unchanged: list[float] = []
        self.times: list[float] = []

    def held(self) -> list[torch.Tensor]:
        """The value each weight holds, in float32: the master copy, weight plus compensation,
        or the weight."""
        if self.master is not None:
            return [m.clone() for m in self.master]
        out = []
        for p in self.params:
            comp = self.optimizer.state[p].get("compensation")
            out.append(p.float() + (0 if comp is None else comp.float()))
        return out

    def second_moments(self) -> list[torch.Tensor]:
        owners = self.params if self.master is None else self.master
        return [
            self.optimizer.state[p]["exp_avg_sq"].to(torch.float32, copy=True)
            if "exp_avg_sq" in self.optimizer.state[p]
            else torch.zeros(p.shape, device=p.device)
            for p in owners
        ]

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> None:
        rec = self.recipe
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        before, moments = self.held(), self.second_moments()
        self.sync()
        start = time.perf_counter()
        with torch.autocast(
            x.device.type, dtype=rec.autocast or BF16, enabled=rec.autocast is not None
        ):
            logits = self.model(x)
        loss = nn.functional.cross_entropy(logits.float(), y)
        scaled = loss if self.scaler is None else self.scaler.scale(loss)
        scaled.backward()
        if self.master is not None:
            for m, p in zip(self.master, self.params, strict=True):
                m.grad = p.grad.float()
        grads = [p.grad for p in self.params]
        found = not all(bool(torch.isfinite(g).all()) for g in grads)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scales.append(self.scaler.get_scale())
            self.scaler.step(self.optimizer)
            self.scaler.update()
        if self.master is not None:
            with torch.no_grad():
                for m, p in zip(self.master, self.params, strict=True):
                    p.copy_(m)
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            for p in self.params:
                p.grad = None
        self.sync()
        self.times.append(time.perf_counter() - start)
        self.losses.append(loss.item())
        self.found_inf.append(found)
        moved = [g != 0 for g in grads]
        for was, now, share in (
            (before, self.held(), self.weights_unchanged),
            (moments, self.second_moments(), self.states_unchanged),
        ):
            kept = sum(int(((a == b) & m).sum()) for a, b, m in zip(was, now, moved, strict=True))
            share.append(kept / max(1, sum(int(m.sum()) for m in moved)))

    def bytes_per_parameter(self) -> float:
        tensors = [*self.params, *(self.master or [])]
        for state in self.optimizer.state.values():
            tensors += [t for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
        return sum(t.numel() * t.element_size() for t in tensors) / sum(
            p.numel() for p in self.params
        )

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The loss on ``(x, y)`` in float32, of the weights as the model holds them."""
        weights = {n: p.detach().float() for n, p in self.model.named_parameters()}
        with torch.no_grad():
            logits = torch.func.functional_call(self.model, weights, (x,))
            return nn.functional.cross_entropy(logits, y).item()


def train(
    recipes: Sequence[str | Recipe],
    task: CharTask | None = None,
    steps: int = 200,
    batch: int = 64,
    lr: float = 3e-3,
    eval_every: int = 10,
    seed: int = 0,
    dev: torch.device | str | None = None,
) -> Runs:
    """Train ``task``'s model (default: :func:`char_task`) by each recipe, in lockstep: every
    recipe starts from the same weights, takes its step on the same batch in turn, and is
    timed around its forward, backward and optimizer step. AdamW's learning rate follows a
    cosine from ``lr`` to zero. Every ``eval_every`` steps and after the last, each recipe's
    weights are evaluated in float32 on one fixed held-out batch of 512 windows."""
    if not recipes:
        raise MPGuideError("no recipe to train")
    if steps < 1 or batch < 1 or eval_every < 1:
        raise MPGuideError(
            f"steps, batch and eval_every must be at least 1, got {steps}, {batch}, {eval_every}"
        )
    if not (math.isfinite(lr) and lr > 0):
        raise MPGuideError(f"the learning rate must be positive and finite, got {lr}")
    recs = [recipe(r) for r in recipes]
    task = char_task() if task is None else task
    dev = _device.pick() if dev is None else _device.resolve(str(dev))
    loops = [_Loop(r, task.model(seed), dev, lr, seed) for r in recs]
    gen = torch.Generator(device=dev).manual_seed(seed)
    held_x, held_y = task.batch(512, torch.Generator(device=dev).manual_seed(seed + 2), True)
    evals: list[list[tuple[int, float]]] = [[(0, loop.evaluate(held_x, held_y))] for loop in loops]
    for step in range(steps):
        x, y = task.batch(batch, gen)
        rate = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        for loop, ev in zip(loops, evals, strict=True):
            loop.step(x, y, rate)
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                ev.append((step + 1, loop.evaluate(held_x, held_y)))
    runs = []
    for loop, ev in zip(loops, evals, strict=True):
        owner = loop.params[0] if loop.master is None else loop.master[0]
        state = loop.optimizer.state[owner]
        runs.append(
            Run(
                recipe=loop.recipe,
                losses=tuple(loop.losses),
                evals=tuple(ev),
                scales=tuple(loop.scales),
                found_inf=tuple(loop.found_inf),
                skipped=tuple(i for i, s in enumerate(loop.weights_unchanged) if s == 1.0),
                weights_unchanged=tuple(loop.weights_unchanged),
                states_unchanged=tuple(loop.states_unchanged),
                state_dtypes=tuple((k, v.dtype) for k, v in state.items() if torch.is_tensor(v)),
                bytes_per_parameter=loop.bytes_per_parameter(),
                latency=timing.Latency(loop.recipe.name, tuple(loop.times), dev.type),
                model=loop.model,
            )
        )
    return Runs(tuple(runs), repr(task), _device.describe(dev))


# --- Layers with state, recompute, communication dtypes (training pages 03, 04, 05) ---
#
# - the dtypes each normalization layer takes, returns and keeps under autocast, per device
#   (:func:`norms`), and the running mean a BatchNorm keeps in each buffer dtype
#   (:func:`running_means`);
# - the error of a gradient summed from many contributions in one dtype (a :class:`Sweep`): an
#   embedding row used many times in a batch (:func:`embedding_grads`), micro-batches
#   accumulated into ``.grad`` (:func:`grad_accumulation`);
# - a gloo process group (:func:`process_group`), and what DDP's comm hooks and FSDP2's
#   mixed-precision policies hand to the collectives, measured in worker processes with the
#   error of the reduced gradient (:func:`communication`).

# -- normalization layers under autocast --------------------------------------------------------

_NORM_LAYERS = {
    "BatchNorm1d": lambda n, dev: nn.BatchNorm1d(n, device=dev),
    "LayerNorm": lambda n, dev: nn.LayerNorm(n, device=dev),
    "GroupNorm": lambda n, dev: nn.GroupNorm(2, n, device=dev),
    "RMSNorm": lambda n, dev: nn.RMSNorm(n, device=dev),
}
NORMS = tuple(_NORM_LAYERS)
"""The normalization layers :func:`norms` calls."""

# The ops that compute a norm's statistics: the fused kernels, or the mean of squares of a
# decomposed RMSNorm.
_STATISTICS_OPS = frozenset(
    {
        "aten.native_batch_norm.default",
        "aten.cudnn_batch_norm.default",
        "aten._batch_norm_with_update.default",
        "aten._native_batch_norm_legit.default",
        "aten._native_batch_norm_legit_functional.default",
        "aten.native_layer_norm.default",
        "aten.native_group_norm.default",
        "aten._fused_rms_norm.default",
        "aten.mean.dim",
    }
)


def _casts_text(casts: Sequence[tuple[torch.dtype, torch.dtype]]) -> str:
    return ", ".join(f"{_dtypes.short(a)}->{_dtypes.short(b)}" for a, b in casts)


@dataclass(frozen=True)
class NormRun:
    """One normalization layer with float32 parameters, called under autocast on one device
    on activations in the autocast dtype (what a matmul under autocast hands it): the dtype of
    the input the op computing its statistics takes (``computes``; a kernel may accumulate in
    a wider type inside, which no log sees), its output's, its running statistics' (``None``:
    it keeps none), every cast inside the call, and the warning or error it raised."""

    layer: str
    device: str
    how: str
    given: torch.dtype
    computes: torch.dtype | None
    out: torch.dtype | None
    keeps: torch.dtype | None
    casts: tuple[tuple[torch.dtype, torch.dtype], ...]
    warning: str | None = None
    error: str | None = None

    def row(self) -> tuple:
        return (
            self.layer,
            _device.label(self.device, self.how),
            self.given,
            self.computes or "unknown",
            self.out or f"error: {self.error}",
            self.keeps or "none",
            _casts_text(self.casts),
            (self.warning or "").split(". ")[0],
        )


@dataclass(frozen=True)
class Norms:
    """Normalization layers under autocast with one dtype, on each device."""

    dtype: torch.dtype
    runs: tuple[NormRun, ...]

    def __getitem__(self, key: tuple[str, str]) -> NormRun:
        """The run of ``(layer, device)``."""
        for r in self.runs:
            if (r.layer, r.device) == key:
                return r
        raise KeyError(key)

    def table(self) -> Table:
        return Table(
            (
                "layer",
                "device",
                "input",
                "statistics op takes",
                "output",
                "running statistics",
                "casts in the call",
                "warning",
            ),
            tuple(r.row() for r in self.runs),
            f"normalization layers with float32 parameters under autocast "
            f"dtype={_dtypes.name(self.dtype)}, torch {torch.__version__}",
        )

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def _norm_run(layer: str, target: _device.Target, dtype: torch.dtype, features: int) -> NormRun:
    with _device.tensors(target):
        module = _NORM_LAYERS[layer](features, target.device)
        x = torch.randn(16, features, device=target.device).to(dtype)
        run = _policy.run(_policy.Op(layer, "norm", lambda t: (), module), (x,), target, dtype)
    statistics = next((c for c in run.calls if c.op in _STATISTICS_OPS), None)
    buffer = getattr(module, "running_mean", None)
    return NormRun(
        layer=layer,
        device=target.device.type,
        how=target.how,
        given=dtype,
        computes=statistics.ins[0] if statistics is not None else None,
        out=run.out,
        keeps=buffer.dtype if buffer is not None else None,
        casts=tuple(pair for c in run.calls if (pair := c.conversion) is not None),
        warning=run.warning,
        error=run.error,
    )


def norms(
    dtype: torch.dtype | str = torch.bfloat16,
    devices: Sequence[str] = ("cpu", "cuda"),
    layers: Sequence[str] = NORMS,
    features: int = 8,
) -> Norms:
    """Call each of ``layers`` (of :data:`NORMS`) under autocast with ``dtype`` on each of
    ``devices``: live where this machine has the device, else simulated from this build's
    dispatch rules (fake tensors: dtypes and casts, no values)."""
    dt = _dtypes.autocast_dtype(dtype)
    unknown = [name for name in layers if name not in _NORM_LAYERS]
    if unknown:
        raise MPGuideError(f"unknown layer {unknown[0]!r}; choose among {', '.join(NORMS)}")
    if features < 2 or features % 2:
        raise MPGuideError(f"features must be an even number of at least 2, got {features}")
    targets = [_device.target(name) for name in devices]
    return Norms(dt, tuple(_norm_run(n, t, dt, features) for t in targets for n in layers))


def _spacing(value: float, dtype: torch.dtype) -> float:
    """The gap from ``value`` (rounded to ``dtype``) to the next number of ``dtype`` above."""
    t = torch.tensor(value, dtype=dtype)
    return (torch.nextafter(t, torch.tensor(math.inf, dtype=dtype)) - t).item()


@dataclass(frozen=True)
class RunningMeans:
    """The running mean a ``BatchNorm1d`` kept after each training step, with its buffers in
    each dtype, fed batches whose every channel has mean ``mean`` (before rounding)."""

    mean: float
    momentum: float
    device: str
    traces: tuple[tuple[torch.dtype, tuple[float, ...]], ...] = field(repr=False)

    @property
    def buffers(self) -> tuple[torch.dtype, ...]:
        return tuple(dt for dt, _ in self.traces)

    def trace(self, dtype: torch.dtype | str) -> tuple[float, ...]:
        """The running mean (averaged over channels) after each step."""
        dt = _dtypes.parse(dtype)
        for d, values in self.traces:
            if d == dt:
                return values
        raise MPGuideError(f"no run with {_dtypes.name(dt)} buffers")

    def gap(self, dtype: torch.dtype | str) -> float:
        """How far below ``mean`` the running mean ended."""
        return self.mean - self.trace(dtype)[-1]

    def settled_at(self, dtype: torch.dtype | str) -> int | None:
        """The first step from which the running mean never changed again (``None`` when it
        still moved at the last step)."""
        values = self.trace(dtype)
        if len(values) < 2 or values[-1] != values[-2]:
            return None
        i = len(values) - 1
        while i > 0 and values[i - 1] == values[-1]:
            i -= 1
        return i

    def table(self) -> Table:
        rows = tuple(
            (
                dt,
                self.trace(dt)[-1],
                self.gap(dt),
                _spacing(self.mean, dt),
                "still moving" if self.settled_at(dt) is None else self.settled_at(dt),
            )
            for dt in self.buffers
        )
        return Table(
            (
                "buffers",
                "final running mean",
                "below the mean by",
                "spacing at the mean",
                "stopped moving at step",
            ),
            rows,
            f"BatchNorm1d(momentum={self.momentum:g}) fed batches of mean {self.mean:g}, "
            f"{len(self.traces[0][1])} steps, torch {torch.__version__} on {self.device}",
        )

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def running_means(
    buffers: Sequence[torch.dtype | str] = ("float32", "bfloat16", "float16"),
    steps: int = 100,
    mean: float = 3.0,
    momentum: float = 0.1,
    seed: int = 0,
    dev: torch.device | str | None = None,
) -> RunningMeans:
    """Train a ``BatchNorm1d`` of 4 channels cast to each dtype of ``buffers`` for ``steps``
    steps on batches of 64 whose channels all have mean ``mean`` (standard normal values
    shifted, rounded to that dtype), recording the running mean after each step."""
    if steps < 1:
        raise MPGuideError(f"steps must be at least 1, got {steps}")
    if not 0 < momentum <= 1:
        raise MPGuideError(f"momentum must be in (0, 1], got {momentum}")
    if not math.isfinite(mean):
        raise MPGuideError(f"mean must be finite, got {mean}")
    dts = [_dtypes.parse(b) for b in buffers]
    dev = _device.pick() if dev is None else _device.resolve(str(dev))
    traces = []
    for dt in dts:
        gen = torch.Generator(device=dev).manual_seed(seed)
        bn = nn.BatchNorm1d(4, momentum=momentum).to(dev, dt)
        values = []
        for _ in range(steps):
            z = torch.randn(64, 4, generator=gen, device=dev, dtype=torch.float64)
            bn((z - z.mean(0) + mean).to(dt))
            values.append(bn.running_mean.double().mean().item())
        traces.append((dt, tuple(values)))
    return RunningMeans(float(mean), float(momentum), dev.type, tuple(traces))


# -- gradients summed from many contributions ---------------------------------------------------


@dataclass(frozen=True)
class Sweep:
    """The error of a gradient summed from many contributions, against their float64 sum: one
    :class:`~mpguide.precision.numerics.ErrorStats` per way of summing (``ways``) and count."""

    what: str
    counted: str
    counts: tuple[int, ...]
    ways: tuple[str, ...]
    stats: tuple[tuple[ErrorStats, ...], ...] = field(repr=False)
    device: str = "cpu"

    def errors(self, way: str) -> list[float]:
        """Max error over mean ``|reference|`` of one way, per count."""
        if way not in self.ways:
            raise MPGuideError(f"unknown way {way!r}; choose one of {', '.join(self.ways)}")
        return [s.max_rel for s in self.stats[self.ways.index(way)]]

    def table(self) -> Table:
        rows = tuple(
            (n, *(self.stats[w][i].max_rel for w in range(len(self.ways))))
            for i, n in enumerate(self.counts)
        )
        return Table(
            (self.counted, *self.ways),
            rows,
            f"{self.what}: max |error| / mean |float64 sum|, torch {torch.__version__} "
            f"on {self.device}",
        )

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def _counts(counts: Sequence[int]) -> tuple[int, ...]:
    out = tuple(int(n) for n in counts)
    if not out or any(n < 1 for n in out) or list(out) != sorted(set(out)):
        raise MPGuideError(f"counts must be increasing positive integers, got {list(counts)}")
    return out


def embedding_grads(
    counts: Sequence[int] = (1, 4, 16, 64, 256, 1024, 4096),
    tables: Sequence[torch.dtype | str] = ("float32", "bfloat16"),
    dim: int = 16,
    seed: int = 0,
    dev: torch.device | str | None = None,
) -> Sweep:
    """The gradient of one embedding row used ``n`` times in a batch, for each ``n`` of
    ``counts``, with the table in each dtype of ``tables``: backward sums the ``n`` incoming
    gradient rows (standard normal, in the table's dtype) into the row's gradient."""
    counts = _counts(counts)
    dts = [_dtypes.parse(t) for t in tables]
    dev = _device.pick() if dev is None else _device.resolve(str(dev))
    stats = []
    for dt in dts:
        row = []
        for n in counts:
            gen = torch.Generator(device=dev).manual_seed(seed)
            incoming = torch.randn(n, dim, generator=gen, device=dev).to(dt)
            table = torch.zeros(4, dim, device=dev, dtype=dt, requires_grad=True)
            ids = torch.zeros(n, dtype=torch.long, device=dev)
            nn.functional.embedding(ids, table).backward(incoming)
            row.append(errors(table.grad[0], incoming.double().sum(0)))
        stats.append(tuple(row))
    return Sweep(
        "gradient of an embedding row used n times",
        "uses of the row",
        counts,
        tuple(f"{_dtypes.name(dt)} table" for dt in dts),
        tuple(stats),
        dev.type,
    )


GRAD_ACCUMULATION = (
    "float32 parameter, autocast bf16",
    "bfloat16 parameter",
    "bfloat16 parameter, grad_dtype=float32",
)
"""The ways :func:`grad_accumulation` accumulates micro-batch gradients into ``.grad``."""


def grad_accumulation(
    counts: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    ways: Sequence[str] = GRAD_ACCUMULATION,
    seed: int = 0,
    dev: torch.device | str | None = None,
) -> Sweep:
    """Accumulate the weight gradient of a ``Linear(32, 4)`` over micro-batches of 8 samples
    by calling ``backward`` once per micro-batch, and compare ``.grad`` after each count of
    ``counts`` with the float64 sum of the gradients the micro-batches delivered. Each way of
    :data:`GRAD_ACCUMULATION` keeps the weight, runs the forward and holds ``.grad`` its own
    way; the last needs :attr:`torch.Tensor.grad_dtype`."""
    counts = _counts(counts)
    unknown = [w for w in ways if w not in GRAD_ACCUMULATION]
    if unknown:
        raise MPGuideError(
            f"unknown way {unknown[0]!r}; choose among {', '.join(GRAD_ACCUMULATION)}"
        )
    if GRAD_ACCUMULATION[2] in ways and not hasattr(torch.Tensor, "grad_dtype"):
        raise MPGuideError(
            f"{GRAD_ACCUMULATION[2]!r} needs Tensor.grad_dtype, which torch "
            f"{torch.__version__} lacks"
        )
    dev = _device.pick() if dev is None else _device.resolve(str(dev))
    gen = torch.Generator(device=dev).manual_seed(seed)
    xs = torch.randn(counts[-1], 8, 32, generator=gen, device=dev)
    ys = torch.randn(counts[-1], 8, 4, generator=gen, device=dev)
    start = 0.1 * torch.randn(4, 32, generator=gen, device=dev)
    stats = []
    for way in ways:
        autocast = way == GRAD_ACCUMULATION[0]
        dt = torch.float32 if autocast else torch.bfloat16
        weight = start.to(dt, copy=True).requires_grad_()
        if way == GRAD_ACCUMULATION[2]:
            weight.grad_dtype = torch.float32
        delivered = torch.zeros(weight.shape, dtype=torch.float64, device=dev)
        row = []
        for i in range(counts[-1]):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                out = nn.functional.linear(xs[i].to(dt), weight)
            loss = (out.float() - ys[i]).pow(2).mean()
            (grad,) = torch.autograd.grad(loss, weight, retain_graph=True)
            delivered += grad.double()
            loss.backward()
            if i + 1 in counts:
                row.append(errors(weight.grad, delivered))
        stats.append(tuple(row))
    return Sweep(
        "weight gradient accumulated over n micro-batches",
        "micro-batches",
        counts,
        tuple(ways),
        tuple(stats),
        dev.type,
    )


# -- communication dtypes ---------------------------------------------------------------------


@contextmanager
def process_group(rank: int = 0, world_size: int = 1, store: str | None = None) -> Iterator[None]:
    """A gloo process group for the block: rank ``rank`` of ``world_size``, meeting in a
    :class:`torch.distributed.FileStore` at the file path ``store`` (no port to pick; a world
    of one may leave it out for a new temporary folder). Destroyed after the block."""
    import torch.distributed as dist

    if world_size < 1 or not 0 <= rank < world_size:
        raise MPGuideError(f"rank {rank} is not in a world of {world_size}")
    if store is None and world_size > 1:
        raise MPGuideError(f"a world of {world_size} processes needs a store path they share")
    if dist.is_initialized():
        raise MPGuideError("this process already has a process group")
    folder = tempfile.TemporaryDirectory() if store is None else None
    path = store if folder is None else os.path.join(folder.name, "store")
    try:
        dist.init_process_group(
            "gloo", store=dist.FileStore(path, world_size), rank=rank, world_size=world_size
        )
        try:
            yield
        finally:
            dist.destroy_process_group()
    finally:
        if folder is not None:
            folder.cleanup()


_DDP_HOOKS = {
    "DDP": None,
    "DDP, fp16_compress_hook": "fp16_compress_hook",
    "DDP, bf16_compress_hook": "bf16_compress_hook",
}
# The param_dtype, reduce_dtype and output_dtype of each FSDP2 setup's MixedPrecisionPolicy.
_FSDP2_POLICIES = {
    "FSDP2": (None, None, None),
    "FSDP2, param bf16, reduce float32": (BF16, FP32, None),
    "FSDP2, param bf16, reduce bf16": (BF16, BF16, None),
    "FSDP2, param bf16, reduce float32, output float32": (BF16, FP32, FP32),
}
COMM_SETUPS = (*_DDP_HOOKS, *_FSDP2_POLICIES)
"""What :func:`communication` runs: DDP without a comm hook and with the built-in hooks that
compress gradients to fp16 and bf16 (``default_hooks``); FSDP2 without a mixed-precision
policy and with ``MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype)`` as named."""


@dataclass(frozen=True)
class Collective:
    """One collective as the dtype log saw it: the op, the dtype of its tensors, and the bytes
    of the largest tensor handed to it (the buffer reduced, gathered into or scattered)."""

    op: str
    dtype: torch.dtype
    nbytes: int

    def __str__(self) -> str:
        return f"{self.op.removeprefix('c10d.')} {_dtypes.short(self.dtype)}"


@dataclass(frozen=True)
class CommRun:
    """One training step of one setup of :data:`COMM_SETUPS` with the loss multiplied by
    ``scale``: the collectives, the dtype of the gradient left on the parameters, the model
    output's dtype, and rank 0's reduced gradient against two references: the mean of the
    gradients the ranks computed before communicating (``comm_error``, what communication
    alone cost; ``flushed``, the share of its nonzero entries that arrived as zero) and the
    mean of the ranks' float64 gradients (``error``, compute and communication together).
    Also whether every rank holds the same reduced gradient, and how the setup was made where
    it needed a detour."""

    setup: str
    scale: float
    collectives: tuple[Collective, ...]
    grad_dtype: torch.dtype
    out_dtype: torch.dtype
    comm_error: ErrorStats
    error: ErrorStats
    flushed: float
    ranks_agree: bool
    note: str = ""

    @property
    def comm_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes of the collectives, in order of first use."""
        return tuple(dict.fromkeys(c.dtype for c in self.collectives))

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.collectives)

    def row(self) -> tuple:
        counts: dict[str, int] = {}
        for c in self.collectives:
            counts[str(c)] = counts.get(str(c), 0) + 1
        return (
            self.setup,
            f"{self.scale:g}",
            ", ".join(f"{n} x {name}" for name, n in counts.items()),
            self.nbytes,
            self.grad_dtype,
            self.out_dtype,
            self.comm_error.max_rel,
            f"{self.flushed:.1%}",
            self.error.max_rel,
            "yes" if self.ranks_agree else "no",
            self.note,
        )


@dataclass(frozen=True)
class Communication:
    """:class:`CommRun` of each setup and loss scale, in a world of ``world_size`` processes
    on gloo, CPU, training a model of ``parameters`` parameters."""

    world_size: int
    parameters: int
    runs: tuple[CommRun, ...]

    def get(self, setup: str, scale: float = 1.0) -> CommRun:
        for r in self.runs:
            if r.setup == setup and r.scale == scale:
                return r
        raise KeyError((setup, scale))

    @property
    def scales(self) -> tuple[float, ...]:
        return tuple(dict.fromkeys(r.scale for r in self.runs))

    def table(self) -> Table:
        return Table(
            (
                "setup",
                "loss x",
                "collectives",
                "bytes handed to them",
                "gradient",
                "output",
                "communication error",
                "flushed to zero",
                "error against float64",
                "ranks agree",
                "note",
            ),
            tuple(r.row() for r in self.runs),
            f"one training step of {self.parameters} parameters, world of {self.world_size} "
            f"processes on gloo, cpu, "
            f"torch {torch.__version__}; errors are max |error| / mean |reference| of the "
            f"reduced gradient against the mean of the ranks' own gradients (communication) "
            f"and of their float64 gradients",
        )

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def _comm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _comm_loss(
    model: nn.Module, x: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(x)
    return out, out.float().pow(2).mean() * scale


def _flat_grads(model: nn.Module) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    grads = [
        p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()
    ]
    return torch.cat([g.double().flatten() for g in grads])


def _bf16_hook(state, bucket):
    """``bf16_compress_hook`` under another name: DDP refuses to register the built-in one on
    a build without CUDA and NCCL, but not this."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def _wrap(setup: str, model: nn.Module) -> tuple[nn.Module, str]:
    """The model set up for ``setup``, and a note on how, where it needed a detour."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if setup in _DDP_HOOKS:
        ddp = DistributedDataParallel(model)
        hook, note = _DDP_HOOKS[setup], ""
        if hook is not None:
            try:
                ddp.register_comm_hook(dist.group.WORLD, getattr(default_hooks, hook))
            except TypeError as err:
                note = f"registered under another name; DDP refused it: {err}"
                ddp.register_comm_hook(dist.group.WORLD, _bf16_hook)
        return ddp, note
    param, reduce, output = _FSDP2_POLICIES[setup]
    policy = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=output)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model, ""


def _comm_step(setup: str, scale: float, rank: int) -> dict:
    from mpguide.training.autograd import DtypeLog

    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(32, 16, generator=gen)
    # The rank's own gradient, computed in the dtype the setup computes in but not
    # communicated; and in float64.
    own_dtype = _FSDP2_POLICIES.get(setup, (None,))[0] or torch.float32
    own = _comm_model().to(own_dtype)
    exact = _comm_model().double()
    for local, inputs in ((own, x.to(own_dtype)), (exact, x.double())):
        _comm_loss(local, inputs, scale)[1].backward()
    model = _comm_model()
    wrapped, note = _wrap(setup, model)
    with DtypeLog() as log:
        out, loss = _comm_loss(wrapped, x, scale)
        loss.backward()
    collectives = [
        (r.op_name, _dtypes.name(r.inputs[0].dtype), max(m.nbytes for m in r.inputs))
        for r in log.records
        if r.op.startswith("c10d.")
    ]
    grad = next(model.parameters()).grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    return {
        "collectives": collectives,
        "grad_dtype": _dtypes.name(local.dtype),
        "out_dtype": _dtypes.name(out.dtype),
        "grad": _flat_grads(model),
        "own": _flat_grads(own),
        "exact": _flat_grads(exact),
        "note": note,
    }


def _rank(rank: str, world_size: str, store: str, plan: str, out: str) -> None:
    """One worker process of :func:`communication`, started with its arguments as text: runs
    each ``[setup, scale]`` of the JSON ``plan`` and saves the results to ``out``."""
    torch.set_num_threads(1)
    with process_group(int(rank), int(world_size), store):
        results = [_comm_step(setup, scale, int(rank)) for setup, scale in json.loads(plan)]
    torch.save(results, out)


def communication(
    world_size: int = 2,
    setups: Sequence[str] = COMM_SETUPS,
    scales: Sequence[float] = (1.0, 1e-7),
    timeout: float = 180.0,
) -> Communication:
    """One training step of each of ``setups`` (of :data:`COMM_SETUPS`) at each loss scale, in
    ``world_size`` worker processes on the CPU, gloo, meeting in a file store: what each
    hands to the collectives (logged by :class:`~mpguide.training.autograd.DtypeLog`), and the
    reduced gradient against the ranks' own and float64 gradients (see :class:`CommRun`).
    Each rank trains the same small MLP on its own batch. Workers still running after
    ``timeout`` seconds are killed."""
    if not 1 <= world_size <= 8:
        raise MPGuideError(f"world_size must be 1 to 8, got {world_size}")
    unknown = [x for x in setups if x not in COMM_SETUPS]
    if unknown or not setups:
        raise MPGuideError(
            f"unknown setup {unknown[0] if unknown else None!r}; choose among "
            f"{', '.join(COMM_SETUPS)}"
        )
    scales = [float(s) for s in scales]
    if not scales or not all(math.isfinite(s) and s > 0 for s in scales):
        raise MPGuideError(f"scales must be positive finite numbers, got {scales}")
    if not timeout > 0:
        raise MPGuideError(f"timeout must be positive, got {timeout}")
    plan = [(setup, scale) for setup in setups for scale in scales]
    results = _run_ranks(world_size, json.dumps(plan), timeout)
    runs = []
    for (setup, scale), *mine in zip(plan, *results, strict=True):
        first = mine[0]
        own = torch.stack([m["own"] for m in mine]).mean(0)
        exact = torch.stack([m["exact"] for m in mine]).mean(0)
        runs.append(
            CommRun(
                setup=setup,
                scale=scale,
                collectives=tuple(
                    Collective(op, getattr(torch, dt), n) for op, dt, n in first["collectives"]
                ),
                grad_dtype=getattr(torch, first["grad_dtype"]),
                out_dtype=getattr(torch, first["out_dtype"]),
                comm_error=errors(first["grad"], own),
                error=errors(first["grad"], exact),
                flushed=((first["grad"] == 0) & (own != 0)).double().mean().item(),
                ranks_agree=all(torch.equal(first["grad"], m["grad"]) for m in mine),
                note=first["note"],
            )
        )
    parameters = sum(p.numel() for p in _comm_model().parameters())
    return Communication(world_size, parameters, tuple(runs))


def _run_ranks(world_size: int, plan: str, timeout: float) -> list[list[dict]]:
    """Start one :func:`_rank` process per rank, wait for all of them (killing those left
    after ``timeout`` seconds, or all of them when this process is interrupted) and read
    their results; a rank that failed raises ``RuntimeError`` with its last error line."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
    code = "import sys; from mpguide.training.loop import _rank; _rank(*sys.argv[1:])"
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        outs = [os.path.join(folder, f"rank{r}.pt") for r in range(world_size)]
        logs = [os.path.join(folder, f"rank{r}.log") for r in range(world_size)]
        procs: list[subprocess.Popen] = []
        try:
            for r in range(world_size):
                args = [str(r), str(world_size), store, plan, outs[r]]
                with open(logs[r], "w") as err:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, "-c", code, *args],
                            env={**os.environ, "PYTHONPATH": path},
                            stdout=subprocess.DEVNULL,
                            stderr=err,
                        )
                    )
            for p in procs:
                p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the ranks did not finish in {timeout:g} s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for r, p in enumerate(procs):
            if p.returncode != 0:
                with open(logs[r]) as err:
                    lines = [line for line in err.read().splitlines() if line.strip()]
                # torch.distributed prefixes a rank's traceback lines with "[rankN]: ".
                last = lines[-1].removeprefix(f"[rank{r}]: ") if lines else p.returncode
                raise RuntimeError(f"rank {r} failed: {last}")
        return [torch.load(o, weights_only=True) for o in outs]

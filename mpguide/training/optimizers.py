"""Optimizer precision: writing an update into low-precision weights, rounded to nearest,
stochastically rounded (:func:`stochastic_round`) or Kahan-compensated (:func:`kahan_add_`);
:class:`RoundedAdamW`, an AdamW whose step is computed in float32 and written back so; and the
dtypes the built-in optimizers keep their states in (:func:`optimizer_states`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mpguide import MPGuideError, error_line
from mpguide.core import device as _device
from mpguide.core import dtypes as _dtypes
from mpguide.core.table import Table

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

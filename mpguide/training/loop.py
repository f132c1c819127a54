"""The training loop: a small next-character task every torch installation can build
(:func:`char_task`), the ways a loop holds its weights and takes its steps (:class:`Recipe`,
:data:`RECIPES`), and several recipes trained in lockstep on the same batches, timed
(:func:`train`)."""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from mpguide import MPGuideError
from mpguide.core import device as _device
from mpguide.core import dtypes as _dtypes
from mpguide.core import timing
from mpguide.core.table import Table
from mpguide.training.optimizers import ROUNDINGS, RoundedAdamW

BF16 = torch.bfloat16


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
or :class:`~mpguide.training.optimizers.RoundedAdamW` with one of
:data:`~mpguide.training.optimizers.ROUNDINGS`."""


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

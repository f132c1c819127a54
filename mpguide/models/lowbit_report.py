"""Your model in a low-bit format, linear layer by linear layer.

:func:`capture` runs the model once in its own dtype with hooks on every :class:`torch.nn.Linear`
and transformers ``Conv1D`` (its first call; the other modules with a weight of 2 dims or
more, such as convolutions and embeddings, are named as left out), keeping the input, the
weight and, with ``backward=True``, the gradient of the output (seeded standard-normal output
gradients: ones would make a head's exact). :func:`report` quantizes each under a target of
:data:`mpguide.precision.lowbit_errors.TARGETS` (a recipe, or a format cast without a scale)
and measures, against float64 (statistics of :mod:`mpguide.precision.lowbit_errors`): the
share of nonzero input and weight values that become zero, the share past the format's max
(saturated by a recipe, inf or NaN for a plain cast), the error of the input, the weight and
the layer's output (the GEMM of the quantized input and weight in float32, against the float64
GEMM of the unquantized ones), and of the output gradient. The layers with the largest output
error are the ones to keep in higher precision first."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from mpguide import MPGuideError
from mpguide.core import output, terminal
from mpguide.core.table import Table
from mpguide.precision import lowbit_errors

KEEP = 3
"""How many layers the report names to keep in higher precision."""


@dataclass(frozen=True)
class Captured:
    """One linear layer's first call: its input, weight and bias, and its output gradient."""

    name: str
    input: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    grad_output: torch.Tensor | None


def _is_conv1d(module: torch.nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's projections): a linear layer whose 2-D weight is
    stored transposed, ``(in, out)``, and used in a matmul."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and torch.is_tensor(weight)
        and weight.ndim == 2
        and isinstance(getattr(module, "nf", None), int)
    )


def quantized(module: torch.nn.Module) -> bool:
    """Whether ``--target`` quantizes ``module``: a :class:`torch.nn.Linear` or a
    transformers ``Conv1D``, the layers that multiply their input by a 2-D weight."""
    return isinstance(module, torch.nn.Linear) or _is_conv1d(module)


def _weight(module: torch.nn.Module) -> torch.Tensor:
    """The layer's weight as :func:`torch.nn.functional.linear` takes it, ``(out, in)``."""
    return module.weight.detach().t() if _is_conv1d(module) else module.weight.detach()


def left_out(model: torch.nn.Module) -> dict[str, int]:
    """The modules with a weight of 2 dims or more that ``--target`` does not quantize
    (convolutions, embeddings, layers of the reader's own), counted by type."""
    found: dict[str, int] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not quantized(module) and torch.is_tensor(weight) and weight.ndim >= 2:
            found[type(module).__name__] = found.get(type(module).__name__, 0) + 1
    return found


@contextmanager
def _hooks(model: torch.nn.Module, seen: dict[str, dict[str, Any]]) -> Iterator[None]:
    handles = []

    def forward(name):
        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs.get("input", kwargs.get("x"))
            if name in seen or not torch.is_tensor(x):
                return
            seen[name] = {"input": x.detach(), "module": module}
            if torch.is_tensor(output) and output.requires_grad:
                output.register_hook(lambda grad: seen[name].setdefault("grad", grad.detach()))

        return hook

    try:
        for name, module in model.named_modules():
            if quantized(module):
                handles.append(module.register_forward_hook(forward(name), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def capture(
    model: torch.nn.Module, inputs: Any, *, backward: bool = False, seed: int = 0
) -> list[Captured]:
    """The first call of every linear layer of ``model`` (:func:`quantized`) on ``inputs`` (a
    tensor, a tuple of arguments or a dict of keyword arguments), in call order; a ``Conv1D``'s
    weight is given as a Linear's, ``(out, in)``."""
    args, kwargs = (
        ((), inputs)
        if isinstance(inputs, dict)
        else ((inputs,), {})
        if torch.is_tensor(inputs)
        else (tuple(inputs), {})
    )
    seen: dict[str, dict[str, Any]] = {}
    was_training = model.training
    model.eval()
    try:
        with _hooks(model, seen), torch.set_grad_enabled(backward):
            out = model(*args, **kwargs)
            if backward:
                leaves = [t for t in tree_leaves(out) if torch.is_tensor(t) and t.requires_grad]
                if not leaves:
                    raise MPGuideError(
                        "--backward: no output of the model requires grad (are its parameters "
                        "frozen, or its outputs detached?)"
                    )
                gen = torch.Generator(device=leaves[0].device).manual_seed(seed)
                grads = [
                    torch.randn(t.shape, generator=gen, device=t.device).to(t.dtype) for t in leaves
                ]
                torch.autograd.backward(leaves, grads)
    finally:
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    if not seen:
        others = left_out(model)
        also = f"; left out: {_counted(others)}" if others else ""
        raise MPGuideError(
            f"the model ran no linear layer (torch.nn.Linear or transformers' Conv1D): nothing "
            f"to quantize{also}"
        )
    return [
        Captured(
            name,
            s["input"],
            _weight(s["module"]),
            None if s["module"].bias is None else s["module"].bias.detach(),
            s.get("grad"),
        )
        for name, s in seen.items()
    ]


def _counted(found: dict[str, int]) -> str:
    return ", ".join(f"{n} {name}" for name, n in sorted(found.items(), key=lambda x: -x[1]))


def left_out_note(found: dict[str, int]) -> str:
    """The note naming the layers :func:`left_out` found, and which ones a target quantizes."""
    return (
        f"left out: {_counted(found)} (quantized: torch.nn.Linear and transformers' Conv1D, the "
        "layers that multiply by a 2-D weight)"
    )


@dataclass(frozen=True)
class Row:
    """One linear layer under the target."""

    module: str
    shape: tuple[int, int]
    input: lowbit_errors.Quantization
    weight: lowbit_errors.Quantization
    output_error: float
    grad_error: float | None


@dataclass(frozen=True)
class TargetReport:
    """Every linear layer of a model under one target."""

    target: str
    rows: tuple[Row, ...]
    left_out: tuple[tuple[str, int], ...] = ()
    """The modules with a weight of 2 dims or more not quantized, by type, and how many."""

    @property
    def keep_first(self) -> tuple[str, ...]:
        """The layers with the largest output error, largest first (at most :data:`KEEP`)."""
        ranked = sorted(self.rows, key=lambda r: r.output_error, reverse=True)
        return tuple(r.module for r in ranked[:KEEP])

    def table(self, limit: int | None = None) -> Table:
        shown = self.rows if limit is None else self.rows[:limit]
        grads = any(r.grad_error is not None for r in self.rows)
        rows = []
        for r in shown:
            cells = [
                r.module,
                100 * r.input.to_zero,
                100 * (r.input.saturated + r.input.overflow),
                100 * r.weight.to_zero,
                100 * (r.weight.saturated + r.weight.overflow),
                r.input.rel_error,
                r.weight.rel_error,
                r.output_error,
            ]
            rows.append((*cells, r.grad_error) if grads else tuple(cells))
        columns = ("module", "in→0 %", "in max %", "w→0 %", "w max %", "in err", "w err")
        columns += ("out err", "grad err") if grads else ("out err",)
        scaled = self.target in lowbit_errors.recipes.RECIPES
        notes = [
            "err: ||q - x|| / ||x|| against float64; out err: the layer's GEMM on the quantized "
            "input and weight; →0: nonzero values that became zero; max: values past the "
            + ("format's max, saturated by the recipe" if scaled else "format's max (inf/NaN)"),
            f"keep in higher precision first: {', '.join(self.keep_first)}",
        ]
        if len(shown) < len(self.rows):
            notes.append(f"{len(self.rows) - len(shown)} more layers")
        if self.left_out:
            notes.append(left_out_note(dict(self.left_out)))
        bits = self.rows[0].weight.bits_per_value
        caption = f"linear layers under {self.target} ({bits:g} bits per weight), live on the CPU"
        return Table(columns, tuple(rows), caption, tuple(notes))

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def report(
    model: torch.nn.Module, inputs: Any, target: str, *, backward: bool = False
) -> TargetReport:
    """Each linear layer of ``model`` on ``inputs`` under ``target``."""
    lowbit_errors.check_target(target)
    rows = []
    for c in capture(model, inputs, backward=backward):
        try:
            qx = lowbit_errors.quantize(c.input, target)
            qw = lowbit_errors.quantize(c.weight, target)
            qg = None if c.grad_output is None else lowbit_errors.quantize(c.grad_output, target)
        except MPGuideError as err:
            raise MPGuideError(f"{c.name}: {err}") from None
        bias = None if c.bias is None else c.bias.float()
        out = torch.nn.functional.linear(qx.values, qw.values, bias)
        ref = torch.nn.functional.linear(
            c.input.double(), c.weight.double(), None if c.bias is None else c.bias.double()
        )
        rows.append(
            Row(
                module=c.name,
                shape=tuple(c.weight.shape),
                input=qx,
                weight=qw,
                output_error=lowbit_errors.rel_error(out, ref),
                grad_error=None if qg is None else qg.rel_error,
            )
        )
    return TargetReport(target, tuple(rows), tuple(left_out(model).items()))


def main(args: Any, factory: Any, readers_code: Any) -> str:
    """``python -m mpguide model SPEC --target FORMAT``: the checks on the options, the
    reader's factory called (and its code run) under ``readers_code``, the table rendered."""
    lowbit_errors.check_target(args.target)
    for flag in ("autocast", "dtype", "device"):
        if getattr(args, flag) is not None:
            raise MPGuideError(f"--target runs the model in its own dtype on the CPU: no --{flag}")
    if args.simulate:
        raise MPGuideError("--target measures numbers: it cannot be simulated")
    if args.limit < 0:
        raise MPGuideError(f"--limit must be 0 (no limit) or more, got {args.limit}")
    if args.columns is not None:
        raise MPGuideError("--columns picks the per-module report's columns; --target has its own")
    model, inputs = factory(args.spec)
    with readers_code(f"running the model of {args.spec} on its inputs"):
        result = report(model, inputs, args.target, backward=args.backward)
    table = result.table(limit=args.limit or None)
    if args.format == "csv":
        output.notes((table.caption, *table.notes))
    return table.render(args.format, terminal.width())


def by_kind(captured: list[Captured], targets: tuple[str, ...] | list[str]) -> Table:
    """For activations (inputs), weights and output gradients of the captured layers: the
    median error over the layers under each target, and the layer where it is largest."""
    kinds = {
        "activations": [(c.name, c.input) for c in captured],
        "weights": [(c.name, c.weight) for c in captured],
        "gradients": [(c.name, c.grad_output) for c in captured if c.grad_output is not None],
    }
    rows = []
    for kind, tensors in kinds.items():
        for target in targets if tensors else ():
            errors = sorted(
                (lowbit_errors.quantize(t, target).rel_error, name) for name, t in tensors
            )
            rows.append((kind, target, errors[(len(errors) - 1) // 2][0], *errors[-1]))
    columns = ("tensors", "recipe", "median rel error", "worst rel error", "worst layer")
    caption = f"error against float64 over {len(captured)} linear layers (live, on the CPU)"
    return Table(columns, tuple(rows), caption)

"""Serve one classifier several ways (dtype casts, autocast, torch.compile) and compare with fp32.

A :class:`Variant` says how the model is served: the dtype its weights are cast to, the
autocast dtype (if any) and whether it is compiled. :func:`compare` runs the same inputs
through every variant under :func:`torch.inference_mode` and measures, against the float32
model: the absolute error of the logits, the share of predicted classes that agree,
parameter memory, the peak memory of a forward pass and the latency (see
:mod:`mpguide.core.timing`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from mpguide import MPGuideError
from mpguide.core import device as _device
from mpguide.core import timing
from mpguide.core.table import Table
from mpguide.models.per_module import arguments


@dataclass(frozen=True)
class Variant:
    """One way to serve a model."""

    name: str
    weights: torch.dtype = torch.float32
    autocast: torch.dtype | None = None
    compile: bool = False

    def prepare(self, model: nn.Module, dev: torch.device) -> nn.Module:
        """A copy of ``model`` on ``dev`` with floating weights in :attr:`weights`, in eval mode."""
        prepared = copy.deepcopy(model).to(device=dev, dtype=self.weights).eval()
        return torch.compile(prepared) if self.compile else prepared

    def __call__(self, prepared: nn.Module, inputs: Any, dev: torch.device) -> Any:
        """Run ``prepared`` on ``inputs``, ``(args, kwargs)`` (floating tensors cast to
        :attr:`weights`)."""
        args, kwargs = tree_map(
            lambda x: (
                x.to(self.weights) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            ),
            inputs,
        )
        with (
            torch.inference_mode(),
            torch.autocast(
                dev.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None
            ),
        ):
            return prepared(*args, **kwargs)

    def compiled(self) -> Variant:
        """The same variant under :func:`torch.compile`."""
        return replace(self, name=f"{self.name} + compile", compile=True)


VARIANTS = {
    "fp32": Variant("fp32"),
    "bf16": Variant("bf16 weights", torch.bfloat16),
    "fp16": Variant("fp16 weights", torch.float16),
    "autocast-bf16": Variant("autocast bf16", autocast=torch.bfloat16),
    "autocast-fp16": Variant("autocast fp16", autocast=torch.float16),
}
"""The variants by the short names readers type; ``NAME+compile`` compiles one."""


def variant(name: str) -> Variant:
    """The variant a short name stands for (see :data:`VARIANTS`), or raise ``MPGuideError``."""
    base, plus, suffix = name.strip().partition("+")
    if base not in VARIANTS or (plus and suffix != "compile"):
        raise MPGuideError(
            f"unknown variant {name!r}; choose among {', '.join(VARIANTS)}, "
            "each optionally followed by +compile"
        )
    return VARIANTS[base].compiled() if plus else VARIANTS[base]


def standard(dev: torch.device | str | None = None) -> tuple[Variant, ...]:
    """fp32, the model cast to bf16 and to fp16, fp32 weights under autocast bf16, and (on
    CUDA) under autocast fp16."""
    dev = _device.pick() if dev is None else torch.device(dev)
    names = ["fp32", "bf16", "fp16", "autocast-bf16"]
    if dev.type == "cuda":
        names.append("autocast-fp16")
    return tuple(VARIANTS[n] for n in names)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes held by the parameters and buffers of ``model``."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


COLUMNS = (
    "variant",
    "same class %",
    "max |err|",
    "mean |err|",
    "median ms",
    "IQR ms",
    "items/s",
    "params KiB",
    "peak KiB",
    "logits",
)
"""In the order a narrow terminal keeps them: agreement, error and latency before memory."""
ERROR_NOTE = (
    "|err|: |logit - fp32 model's logit|, absolute, in the logits' units (the model command's "
    "err is relative: max |error| / mean |ref|)"
)


@dataclass(frozen=True)
class Result:
    """One variant measured against the float32 model."""

    variant: Variant
    output: torch.dtype
    max_error: float
    mean_error: float
    agreement: float
    nonfinite: int
    parameter_bytes: int
    peak_bytes: int
    latency: timing.Latency

    @property
    def name(self) -> str:
        return self.variant.name

    def row(self) -> tuple:
        """The cells of this result under :data:`COLUMNS`."""
        return (
            self.name,
            100 * self.agreement,
            self.max_error,
            self.mean_error,
            self.latency.median * 1e3,
            self.latency.spread * 1e3,
            self.latency.throughput,
            self.parameter_bytes / 2**10,
            self.peak_bytes / 2**10,
            self.output,
        )

    def __repr__(self) -> str:
        return Table(COLUMNS, (self.row(),)).to_text()

    def _repr_html_(self) -> str:
        return Table(COLUMNS, (self.row(),)).to_html()


@dataclass(frozen=True)
class Comparison:
    """Every variant of one model on one device, with fp32 as the reference."""

    results: tuple[Result, ...]
    machine: _device.Machine
    items: int = field(repr=False)

    def __getitem__(self, name: str) -> Result:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.results]

    def best(self, min_agreement: float = 0.99) -> Result:
        """The variant with the lowest median latency among those whose logits are all finite
        and whose predicted classes agree with fp32 for at least ``min_agreement`` of inputs."""
        fit = [r for r in self.results if r.nonfinite == 0 and r.agreement >= min_agreement]
        if not fit:
            raise MPGuideError(f"no variant agrees with fp32 on {min_agreement:.0%} of inputs")
        return min(fit, key=lambda r: r.latency.median)

    @property
    def caption(self) -> str:
        return f"{self.items} inputs per forward pass, {self.machine.caption()}"

    def table(self) -> Table:
        """One row per variant; the notes list the noisy latencies."""
        warned = [
            f"{r.name}: {', '.join(r.latency.warnings)}" for r in self.results if r.latency.warnings
        ]
        notes = (ERROR_NOTE, *([f"latency warnings: {'; '.join(warned)}"] if warned else []))
        return Table(COLUMNS, tuple(r.row() for r in self.results), self.caption, notes)

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def _logits(out: Any) -> torch.Tensor:
    """The logits in what a model returned: a tensor, the first of a tuple, or the
    ``logits`` of a mapping or an object (a transformers model's output)."""
    returned = type(out).__name__
    if isinstance(out, Mapping) and "logits" in out:
        out, returned = out["logits"], f"{returned} whose logits are {type(out['logits']).__name__}"
    elif isinstance(out, (tuple, list)):
        if not out:
            raise MPGuideError(f"the model returned an empty {returned}, not logits")
        out, returned = out[0], f"{returned} whose first item is {type(out[0]).__name__}"
    elif not isinstance(out, torch.Tensor) and hasattr(out, "logits"):
        out, returned = out.logits, f"{returned} whose .logits is {type(out.logits).__name__}"
    if not isinstance(out, torch.Tensor):
        raise MPGuideError(f"the model returned {returned}, not a tensor of logits")
    return out


def compare(
    model: nn.Module,
    inputs: Any,
    variants: Sequence[Variant] | None = None,
    dev: torch.device | str | None = None,
    *,
    warmup: int = 3,
    repeat: int = 15,
    progress: Callable[[str], None] | None = None,
) -> Comparison:
    """Run ``inputs`` through every variant of ``model`` and measure each against fp32.

    ``inputs`` are a tensor, a tuple or list of arguments, or a dict of keyword arguments
    (what a transformers model takes). ``model`` returns logits whose last dimension is the
    class (or an output with ``logits``); the first dimension of the first input tensor counts
    the items of a forward pass (for throughput). Latencies are taken in interleaved rounds,
    so background load hits every variant alike. ``progress`` is told which variant runs
    (:class:`mpguide.models.progress.Progress`).
    """
    dev = _device.pick() if dev is None else _device.resolve(str(dev))
    variants = standard(dev) if variants is None else tuple(variants)
    if not variants:
        raise MPGuideError("no variants to compare")
    if len({v.name for v in variants}) != len(variants):
        raise MPGuideError("variant names must differ")
    inputs = tree_map(lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x, arguments(inputs))
    first = next(t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor))
    items = first.shape[0] if first.dim() else 1

    reference = Variant("reference")
    ref = _logits(reference(reference.prepare(model, dev), inputs, dev)).double()
    ref_class = ref.argmax(-1)

    prepared = {v.name: v.prepare(model, dev) for v in variants}
    calls = {v.name: (lambda v=v: v(prepared[v.name], inputs, dev)) for v in variants}
    measured = {}
    for i, v in enumerate(variants, 1):
        if progress is not None:
            progress(f"measuring {v.name} ({i} of {len(variants)} variants)")
        out = _logits(calls[v.name]())
        if out.shape != ref.shape:
            raise MPGuideError(
                f"{v.name} returned shape {tuple(out.shape)}, fp32 returned {tuple(ref.shape)}"
            )
        err = (out.double() - ref).abs()
        measured[v.name] = (
            out.dtype,
            err.max().item(),
            err.mean().item(),
            (out.argmax(-1) == ref_class).double().mean().item(),
            int((~torch.isfinite(out)).sum()),
            parameter_bytes(prepared[v.name]),
            timing.peak_memory(calls[v.name], dev, label=v.name).peak_bytes,
        )
    if progress is not None:
        calls = _counted(calls, progress, len(calls) * (warmup + repeat))
    latencies = timing.compare_latency(calls, dev, warmup=warmup, repeat=repeat, items=items)
    results = tuple(Result(v, *measured[v.name], latencies[v.name]) for v in variants)
    return Comparison(results, _device.describe(dev), items)


def _counted(
    calls: dict[str, Callable[[], Any]], progress: Callable[[str], None], total: int
) -> dict[str, Callable[[], Any]]:
    """``calls``, each saying before it runs which timed call of ``total`` it is (a progress
    line costs a clock read where it is not due)."""
    done = 0

    def counted(name: str, fn: Callable[[], Any]) -> Any:
        nonlocal done
        done += 1
        progress(f"timing: call {done} of {total} ({name})")
        return fn()

    return {name: (lambda n=name, f=fn: counted(n, f)) for name, fn in calls.items()}


def guide(comparison: Comparison, min_agreement: float = 0.99) -> list[str]:
    """Decision-guide sentences comparing every variant with the first (the baseline), each
    stating only relations that hold in ``comparison``; latency counts as faster or slower
    only when the gap exceeds both spreads (:meth:`mpguide.core.timing.Latency.clearly_below`)."""
    base = comparison.results[0]
    out = []
    for r in comparison.results[1:]:
        parts = []
        if r.nonfinite:
            parts.append(f"produced {r.nonfinite} non-finite logits")
        if r.parameter_bytes < base.parameter_bytes:
            parts.append(
                f"holds {r.parameter_bytes / base.parameter_bytes:.0%} of "
                f"{base.name}'s parameter memory"
            )
        elif r.parameter_bytes > base.parameter_bytes:
            parts.append(f"holds more parameter memory than {base.name}")
        else:
            parts.append(f"keeps {base.name}'s parameter memory")
        parts.append(
            f"agrees with fp32 on {r.agreement:.2%} of predicted classes "
            f"({'at least' if r.agreement >= min_agreement else 'below'} "
            f"{min_agreement:.0%})"
        )
        if r.latency.clearly_below(base.latency):
            parts.append(
                f"is faster ({r.latency.median * 1e3:.2f} ms against "
                f"{base.latency.median * 1e3:.2f} ms, beyond both spreads)"
            )
        elif base.latency.clearly_below(r.latency):
            parts.append(
                f"is slower ({r.latency.median * 1e3:.2f} ms against "
                f"{base.latency.median * 1e3:.2f} ms, beyond both spreads)"
            )
        else:
            parts.append("is not clearly faster or slower: the gap is within the spreads")
        out.append(f"{r.name} " + ", ".join(parts) + ".")
    return out


def choices(comparison: Comparison, min_agreement: float = 0.99) -> list[str]:
    """The choices the table supports among the variants that keep the predictions (finite
    logits, agreement with the first variant of at least ``min_agreement``): the closest to
    the baseline, the least parameter memory, and the fastest, said to be ahead of the
    runner-up only when the gap exceeds both spreads."""
    base = comparison.results[0]
    keep = [r for r in comparison.results if r.nonfinite == 0 and r.agreement >= min_agreement]
    kept = f"keeping {min_agreement:.0%} of fp32's predicted classes"
    lower = [r for r in keep if r is not base]
    out = []
    if lower:
        closest = min(lower, key=lambda r: r.mean_error)
        out.append(
            f"Closest to {base.name} while {kept}: {closest.name} "
            f"(mean logit error {closest.mean_error:.2e})."
        )
    least = min(r.parameter_bytes for r in keep)
    names = ", ".join(r.name for r in keep if r.parameter_bytes == least)
    out.append(f"Least parameter memory while {kept}: {names} ({least / 2**10:.1f} KiB).")
    ranked = sorted(keep, key=lambda r: r.latency.median)
    fastest = ranked[0]
    line = f"Fastest while {kept}: {fastest.name} ({fastest.latency.median * 1e3:.2f} ms median)"
    if len(ranked) > 1:
        second = ranked[1]
        ahead = fastest.latency.clearly_below(second.latency)
        line += (
            f", {'clearly ahead of' if ahead else 'within the spreads of'} {second.name} "
            f"({second.latency.median * 1e3:.2f} ms)"
        )
    out.append(line + ".")
    return out

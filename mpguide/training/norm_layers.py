"""Layers with state under autocast: the dtypes each normalization layer takes, returns
and keeps, per device (:func:`norms`), and the running mean a BatchNorm keeps in each buffer
dtype (:func:`running_means`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from mpguide import MPGuideError
from mpguide.autocast import policy as _policy
from mpguide.core import device as _device
from mpguide.core import dtypes as _dtypes
from mpguide.core.table import Table

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

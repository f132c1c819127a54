"""Gradients summed from many contributions in one dtype (a :class:`Sweep`): an embedding
row used many times in a batch (:func:`embedding_grads`), and micro-batches accumulated into
``.grad`` (:func:`grad_accumulation`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from mpguide import MPGuideError
from mpguide.core import device as _device
from mpguide.core import dtypes as _dtypes
from mpguide.core.table import Table
from mpguide.precision.numerics import ErrorStats, errors

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

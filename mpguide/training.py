"""Training-loop measurements: loss scaling, optimizer precision, layers with state, recompute
and the dtypes gradients are communicated in."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from mpguide import MPGuideError
from mpguide import device as _device
from mpguide import dtypes as _dtypes
from mpguide import policy as _policy
from mpguide.numerics import ErrorStats, errors
from mpguide.table import Table

# --- Loss scaling, optimizer precision, whole training loops (training pages 01, 02, 06) ---


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
    :class:`~mpguide.numerics.ErrorStats` per way of summing (``ways``) and count."""

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
_BF16, _FP32 = torch.bfloat16, torch.float32
# The param_dtype, reduce_dtype and output_dtype of each FSDP2 setup's MixedPrecisionPolicy.
_FSDP2_POLICIES = {
    "FSDP2": (None, None, None),
    "FSDP2, param bf16, reduce float32": (_BF16, _FP32, None),
    "FSDP2, param bf16, reduce bf16": (_BF16, _BF16, None),
    "FSDP2, param bf16, reduce float32, output float32": (_BF16, _FP32, _FP32),
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
    from mpguide.autograd import DtypeLog

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
    hands to the collectives (logged by :class:`~mpguide.autograd.DtypeLog`), and the
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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
    code = "import sys; from mpguide.training import _rank; _rank(*sys.argv[1:])"
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

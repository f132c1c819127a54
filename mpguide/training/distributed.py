"""Distributed training on the CPU: a gloo process group (:func:`process_group`; a world of
one needs no arguments), FSDP2's ``fully_shard`` applied block by block (:func:`shard`), and
what DDP's comm hooks and FSDP2's mixed-precision policies hand to the collectives, measured
in worker processes with the error of the reduced gradient (:func:`communication`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from mpguide import MPGuideError
from mpguide.core import dtypes as _dtypes
from mpguide.core.table import Table
from mpguide.precision.numerics import ErrorStats, errors
from mpguide.training.autograd import DtypeLog

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

BF16, FP32 = torch.bfloat16, torch.float32


# -- a process group, FSDP2 sharding ---------------------------------------------------------


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


def shard(
    model: nn.Module,
    policy: MixedPrecisionPolicy | None = None,
    units: Iterable[nn.Module] | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 block by block, as training code does: ``fully_shard`` each
    of ``units`` as its own group, then ``model`` (the root group takes the parameters left),
    all with the mixed-precision ``policy`` (``None``: FSDP2's default policy). ``units``
    defaults to ``model``'s direct children that hold parameters; ``()`` makes the whole
    model one group. Runs inside a process group (:func:`process_group`), on a CPU mesh on
    every machine (FSDP2's default mesh is the accelerator's: on a GPU machine it would move
    the model there); returns ``model``, sharded in place."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise MPGuideError("shard needs a process group: call it inside process_group()")
    policy = MixedPrecisionPolicy() if policy is None else policy
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if units is None:
        units = [m for m in model.children() if next(m.parameters(), None) is not None]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


REDUCE_SCATTER_COPY = "fsdp.chunk_cat.default"
"""The op FSDP2 copies a group's gradients with into its reduce-scatter buffer: the gradients
are its inputs, and the buffer, in ``reduce_dtype``, is its ``out=`` argument, the last input
a :class:`mpguide.core.dtypes.Log` records."""


def reduce_scatter_inputs(log: _dtypes.Log) -> list[_dtypes.Call]:
    """The calls of ``log`` that copied gradients into a reduce-scatter buffer (one per
    ``fully_shard`` group and backward pass), also at world size 1, where no collective runs."""
    return [c for c in log.calls if c.op == REDUCE_SCATTER_COPY]


# -- communication dtypes ---------------------------------------------------------------------

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
    from torch.distributed.fsdp import MixedPrecisionPolicy
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
    return shard(model, policy), ""


def _comm_step(setup: str, scale: float, rank: int) -> dict:
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
    code = "import sys; from mpguide.training.distributed import _rank; _rank(*sys.argv[1:])"
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

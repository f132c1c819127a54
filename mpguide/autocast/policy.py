"""Probe autocast's per-op behaviour on a device and dtype, classify each op, tabulate.

Each op (by default every op this torch registers an autocast kernel for, see
:func:`registered`; :data:`CATALOGUE` holds hand-written calls a page may pick from) runs
under :func:`torch.autocast` three ways: with float32 inputs,
with low-precision inputs, and (for ops with several floating inputs) with the first input in
low precision and the rest in float32. A dispatch mode records the casts autocast inserts.
The class comes from what happened, not from a list:

- ``lower precision``: float32 inputs come out in the low-precision dtype;
- ``float32``: low-precision inputs come out in float32;
- ``promote``: mixed inputs are cast to the widest dtype before the op;
- ``unchanged``: autocast casts nothing, the op keeps the dtypes it was given;
- ``unsupported``: the op raises under autocast on uniform inputs (the error is kept):
  autocast refuses it, or the kernel refuses the dtype;
- ``needs hardware``: on a simulated device, what neither the dispatch rules nor the CPU can
  tell (see :func:`probe_op`): the meta kernel raised and autocast's casts do not settle the
  class, or the meta kernel accepts inputs the real CPU kernel rejects and this device's
  autocast hands the kernel those same inputs.

The casts counted are those autocast added: casts the same call also makes outside autocast
(inside an op's own decomposition) are not autocast's.

Any device type this build has autocast kernels for can be probed: live where the machine has
it, otherwise simulated with fake tensors under that device's autocast (see
:func:`mpguide.core.device.target`). Every result says which.

This module holds the results (:class:`Policy`, :class:`Devices`) and how they are built; one
op's runs and class come from :mod:`mpguide.autocast.probing`, the hand-written calls from
:mod:`mpguide.autocast.calls`, and the names of both are importable from here.
"""

from __future__ import annotations

import importlib.util
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

import torch

from mpguide.autocast import catalogue, isolated
from mpguide.autocast.calls import CATALOGUE, Inputs, Op
from mpguide.autocast.probing import (
    CLASSES,
    FLOAT32,
    LOWER,
    NEEDS_HARDWARE,
    PROMOTE,
    RUNS,
    UNCHANGED,
    UNSUPPORTED,
    Probe,
    Reference,
    Run,
    classify,
    meta_gaps,
    observe,
    probe_op,
    references,
    run,
)
from mpguide.core import device as _device
from mpguide.core import dtypes, stored
from mpguide.core.table import Table

log = logging.getLogger(__name__)

__all__ = [
    "CATALOGUE",
    "CLASSES",
    "FLOAT32",
    "LOWER",
    "NEEDS_HARDWARE",
    "PROMOTE",
    "RUNS",
    "UNCHANGED",
    "UNSUPPORTED",
    "Devices",
    "Inputs",
    "Op",
    "Policy",
    "Probe",
    "Reference",
    "Run",
    "across",
    "classify",
    "differences",
    "meta_gaps",
    "observe",
    "probe",
    "probe_op",
    "references",
    "registered",
    "run",
]


@dataclass(frozen=True)
class Policy:
    """Autocast's behaviour for every probed op on one device and low-precision dtype."""

    device: str
    dtype: torch.dtype
    machine: _device.Machine
    probes: tuple[Probe, ...] = field(repr=False)
    how: str = _device.LIVE

    def __getitem__(self, op: str) -> Probe:
        for p in self.probes:
            if p.op == op:
                return p
        raise KeyError(op)

    def has(self, op: str) -> bool:
        """Whether ``op`` was probed."""
        return any(p.op == op for p in self.probes)

    def kind(self, op: str) -> str:
        """The class of one op."""
        return self[op].kind

    def ops(self, kind: str) -> list[str]:
        """The ops in one class, in catalogue order."""
        return [p.op for p in self.probes if p.kind == kind]

    def counts(self) -> dict[str, int]:
        """How many ops fall in each class (every class listed, zeros included)."""
        c = Counter(p.kind for p in self.probes)
        return {k: c.get(k, 0) for k in CLASSES}

    @property
    def caption(self) -> str:
        return (
            f"autocast({self.device!r}, dtype={dtypes.name(self.dtype)}): "
            f"{len(self.probes)} ops, {self.machine.caption()}; {self.how}"
        )

    def table(self, kind: str | None = None) -> Table:
        """The probes as a table grouped by class (or one class only); the last column says
        how the results were obtained."""
        low = dtypes.name(self.dtype)
        columns = (
            "op",
            "family",
            "class",
            "float32 in",
            f"{low} in",
            "mixed in",
            "casts",
            "note",
            "obtained",
        )
        order = {k: i for i, k in enumerate(CLASSES)}
        rows = tuple(
            (
                p.op,
                p.family,
                p.kind,
                *(_out(getattr(p, r), r in p.undecided) for r in RUNS),
                ", ".join(p.casts),
                p.note,
                self.how,
            )
            for p in sorted(self.probes, key=lambda p: order[p.kind])
            if kind is None or p.kind == kind
        )
        return Table(columns, rows, self.caption)

    def __repr__(self) -> str:
        counts = ", ".join(f"{k}: {n}" for k, n in self.counts().items())
        return f"{self.caption}\n{counts}\n\n{self.table().to_text()}"

    def _repr_html_(self) -> str:
        parts = [f"<p><strong>{escape(self.caption)}</strong></p>"]
        for kind, n in self.counts().items():
            if n:
                t = self.table(kind)
                keep = [i for i, c in enumerate(t.columns) if c not in ("class", "obtained")]
                rows = tuple(tuple(r[i] for i in keep) for r in t.rows)
                parts.append(f"<p><em>{escape(kind)}</em>: {n} ops</p>")
                parts.append(Table(tuple(t.columns[i] for i in keep), rows).to_html())
        return "".join(parts)


def _out(r: Run | None, undecided: bool = False) -> str:
    if r is None:
        return ""
    if undecided:
        return NEEDS_HARDWARE
    return "error" if r.error else dtypes.name(r.out) if r.out else "-"


def registered() -> tuple[Op, ...]:
    """A probe call for every op this build registers an autocast kernel for that has one
    (see :mod:`mpguide.autocast.catalogue`)."""
    return catalogue.ops()


def probe(
    dev: _device.Target | torch.device | str | None = None,
    dtype: torch.dtype | str = torch.bfloat16,
    ops: Sequence[Op] | None = None,
    seed: int = 0,
    simulate: bool = False,
) -> Policy:
    """Probe every op of ``ops`` under autocast on ``dev`` (default: :func:`mpguide.core.device.pick`).

    A device type this machine lacks, or any with ``simulate=True``, is simulated from this
    build's dispatch rules (see :func:`mpguide.core.device.target`); the result says so. The
    registered ops on a real accelerator run in a child process (:mod:`~mpguide.autocast.isolated`):
    an op that crashes it is listed as such and the probe goes on. A probe of the registered
    ops (simulated, on the CPU, or on an accelerator, keyed by its name and CUDA) is kept in
    ``$MPGUIDE_CACHE`` when that names a folder (:mod:`mpguide.core.stored`), so the pages of
    one build probe a GPU once: a page asking while another computes waits and reads.
    """
    dtype = dtypes.autocast_dtype(dtype)
    target = dev if isinstance(dev, _device.Target) else _device.target(dev, simulate)
    if ops is None:  # the same on every run of this build on this machine (and accelerator)
        samples = importlib.util.find_spec("expecttest") is not None  # see catalogue.has_samples
        key = (target.device.type, target.simulated, str(dtype), seed, samples)
        if not target.simulated and target.device.type != "cpu":
            key += (repr(_device.describe(target.device)),)  # name, capability, CUDA
        return stored.kept("policy", key, lambda: _probe(target, dtype, None, seed), Policy)
    return _probe(target, dtype, ops, seed)


def _probe(target: _device.Target, dtype: torch.dtype, ops: Sequence[Op] | None, seed: int):
    isolate = ops is None and not target.simulated and target.device.type != "cpu"
    ops = registered() if ops is None else ops
    if isolate:
        probes = isolated.probe_ops(ops, str(target.device), dtype, seed, log.warning)
    else:
        refs = references(dtype, tuple(ops)) if target.simulated else {}
        probes = tuple(probe_op(op, target, dtype, seed, refs.get(op.name)) for op in ops)
    return Policy(target.device.type, dtype, target.describe(), probes, target.how)


def differences(a: Policy, b: Policy) -> Table:
    """The ops whose class differs between two policies: bf16 and fp16 on one device, or one
    dtype on two devices (a simulated device against the real one, say)."""
    if a.dtype != b.dtype:
        na, nb = dtypes.name(a.dtype), dtypes.name(b.dtype)
        where = f"on {a.device}"
    else:
        na, nb = _device.label(a.device, a.how), _device.label(b.device, b.how)
        where = f"for {dtypes.name(a.dtype)}"
    rows = tuple(
        (pa.op, pa.family, pa.kind, pb.kind, pb.note or pa.note)
        for pa, pb in zip(a.probes, b.probes, strict=True)
        if pa.kind != pb.kind
    )
    return Table(("op", "family", na, nb, "note"), rows, f"ops whose class differs {where}")


def against_recording(simulated: Policy, recorded: Table) -> Table:
    """The ops whose class in ``recorded`` (a policy table measured on a real device, see
    :mod:`mpguide.core.record`) differs from ``simulated``'s, with the recorded note; a
    ``simulated`` class other than ``needs hardware`` there is a wrong answer of the simulation."""
    cls, note = recorded.columns.index("class"), recorded.columns.index("note")
    real = {row[0]: row for row in recorded.rows}
    rows = tuple(
        (p.op, p.family, p.kind, real[p.op][cls], real[p.op][note] or p.note)
        for p in simulated.probes
        if p.op in real and real[p.op][cls] != p.kind
    )
    columns = ("op", "family", "simulated", "on the GPU", "note")
    caption = f"ops whose class differs: {simulated.caption} against the recording"
    return Table(columns, rows, caption)


@dataclass(frozen=True)
class Devices:
    """One dtype's policy on several devices, side by side."""

    dtype: torch.dtype
    policies: tuple[Policy, ...] = field(repr=False)

    def __getitem__(self, device: str) -> Policy:
        for p in self.policies:
            if p.device == device:
                return p
        raise KeyError(device)

    @property
    def labels(self) -> tuple[str, ...]:
        """``cpu (ran on hardware)``, ``cuda (simulated)``, ... in column order."""
        return tuple(_device.label(p.device, p.how) for p in self.policies)

    @property
    def caption(self) -> str:
        simulated = [p.device for p in self.policies if p.how == _device.SIMULATED]
        how = f"; simulated ({', '.join(simulated)}): {_device.SIMULATED}" if simulated else ""
        return (
            f"autocast classes per device, dtype={dtypes.name(self.dtype)}, "
            f"torch {torch.__version__}{how}"
        )

    def _differs(self, i: int) -> bool:
        return len({p.probes[i].kind for p in self.policies} - {NEEDS_HARDWARE}) > 1

    def table(self) -> Table:
        """Every op's class, one column per device, and whether the class differs between
        devices that decided it (a :data:`NEEDS_HARDWARE` cell is not a difference)."""
        rows = tuple(
            (
                first.op,
                first.family,
                *(p.probes[i].kind for p in self.policies),
                "yes" if self._differs(i) else "",
            )
            for i, first in enumerate(self.policies[0].probes)
        )
        differing = [r[0] for r in rows if r[-1]]
        note = f"{len(differing)} of {len(rows)} ops differ between devices: {', '.join(differing)}"
        return Table(("op", "family", *self.labels, "differs"), rows, self.caption, (note,))

    def differences(self) -> Table:
        """Only the ops whose class differs between devices."""
        t = self.table()
        return t.where(differs="yes")

    def differing(self, a: str, b: str) -> list[str]:
        """The ops whose class differs between devices ``a`` and ``b``, both decided."""
        pa, pb = self[a], self[b]
        return [
            x.op
            for x, y in zip(pa.probes, pb.probes, strict=True)
            if x.kind != y.kind and NEEDS_HARDWARE not in (x.kind, y.kind)
        ]

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def across(
    dtype: torch.dtype | str = torch.bfloat16,
    devices: Sequence[str] | None = None,
    ops: Sequence[Op] | None = None,
    simulate: bool = False,
) -> Devices:
    """Probe ``dtype`` on each of ``devices`` (default: every device type this build's
    autocast can simulate), live where present, simulated elsewhere."""
    dtype = dtypes.autocast_dtype(dtype)
    names = _device.simulated_types() if devices is None else devices
    return Devices(dtype, tuple(probe(d, dtype, ops, simulate=simulate) for d in names))

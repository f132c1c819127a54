"""The fp32 precision switches: set them for a block, see what each call writes, and check
whether a setting changes any result on this hardware.

A setting maps a dotted path under ``torch.backends`` (``"cuda.matmul.fp32_precision"``,
``"cudnn.allow_tf32"``, ...) or :data:`MATMUL_PRECISION` (the legacy
:func:`torch.set_float32_matmul_precision`) to a value. The switch list itself lives in
:mod:`mpguide.core.state`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from html import escape
from typing import Any

import torch
import torch.nn.functional as F

from mpguide import MPGuideError
from mpguide.core import device as _device
from mpguide.core import state
from mpguide.core.table import Table

MATMUL_PRECISION = "float32_matmul_precision"
_MATMUL_PRECISIONS = ("highest", "high", "medium")
LEGACY_READS = (
    "torch.get_float32_matmul_precision()",
    "cuda.matmul.allow_tf32",
    "cudnn.allow_tf32",
)


def tree() -> dict[str, str]:
    """The ``fp32_precision`` tree as stored (``none`` means: inherit from the parent)."""
    return {p: state.get(p) for p in state.PRECISION_SWITCHES if state.available(p)}


def legacy() -> dict[str, str]:
    """What the legacy getters return, or ``raises RuntimeError`` where torch refuses to read
    them because the tree disagrees with the legacy value."""
    out = {}
    for name in LEGACY_READS:
        try:
            value = (
                torch.get_float32_matmul_precision() if name == LEGACY_READS[0] else state.get(name)
            )
            out[name] = str(value)
        except RuntimeError:
            out[name] = "raises RuntimeError"
    return out


def describe(path: str, value: Any) -> str:
    """The Python statement that applies one setting."""
    if path == MATMUL_PRECISION:
        return f"torch.set_float32_matmul_precision({value!r})"
    return f"torch.backends.{path} = {value!r}"


def apply(path: str, value: Any) -> None:
    """Apply one setting, or raise ``MPGuideError`` naming the bad path or value."""
    if path == MATMUL_PRECISION:
        if value not in _MATMUL_PRECISIONS:
            raise MPGuideError(
                f"{MATMUL_PRECISION} must be one of {', '.join(_MATMUL_PRECISIONS)}, got {value!r}"
            )
        torch.set_float32_matmul_precision(value)
        return
    if not state.available(path):
        raise MPGuideError(f"torch {torch.__version__} has no switch torch.backends.{path}")
    try:
        state.put(path, value)
    except RuntimeError as err:
        raise MPGuideError(f"{describe(path, value)}: {err}") from None


@contextmanager
def precision(settings: Mapping[str, Any]) -> Iterator[None]:
    """Apply ``settings`` in order for the block; every switch :mod:`mpguide.core.state` knows is
    restored on exit, even when the body (or a bad setting) raises."""
    with state.preserved():
        for path, value in settings.items():
            apply(path, value)
        yield


def inheriting() -> dict[str, str]:
    """Settings that put every switch back to plain IEEE fp32 with children inheriting from
    their parents: the legacy precision ``highest``, then ``none`` all over the tree."""
    out: dict[str, str] = {MATMUL_PRECISION: "highest"}
    out.update({p: "none" for p in tree()})
    return out


@dataclass(frozen=True)
class Change:
    """What one call did to the tree, what the legacy getters read afterwards, and the
    warnings the call and the reads raised."""

    call: str
    changed: tuple[tuple[str, str, str], ...]
    legacy: tuple[tuple[str, str], ...]
    warnings: tuple[str, ...]

    def wrote(self, path: str) -> str | None:
        """The new value of ``path``, or None when the call left it alone."""
        return next((new for p, _, new in self.changed if p == path), None)


def change(path: str, value: Any) -> Change:
    """Apply one setting from the current state, record what changed, and restore."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with state.preserved():
            before = tree()
            apply(path, value)
            after = tree()
            reads = legacy()
            raised = tuple(str(w.message) for w in caught)
    changed = tuple((p, before[p], after[p]) for p in before if before[p] != after[p])
    return Change(describe(path, value), changed, tuple(reads.items()), raised)


def _short(call: str) -> str:
    return call.removeprefix("torch.backends.").removeprefix("torch.")


@dataclass(frozen=True)
class Changes:
    """Several :class:`Change` records, shown as two tables: what each call wrote into the
    tree, and what the legacy getters read afterwards."""

    items: tuple[Change, ...]

    def __getitem__(self, call: str) -> Change:
        for item in self.items:
            if item.call == call:
                return item
        raise KeyError(call)

    def writes(self) -> Table:
        """One row per switch a call changed (a call that changed nothing gets one row)."""
        rows = tuple(
            (_short(item.call), path, f"{before} -> {after}" if before else "")
            for item in self.items
            for path, before, after in (item.changed or (("nothing", "", ""),))
        )
        return Table(
            ("call", "switch", "change"),
            rows,
            f"What each call writes into torch.backends, torch {torch.__version__}",
        )

    def reads(self) -> Table:
        """What the legacy getters read after each call, and the warnings raised."""
        rows = tuple(
            (_short(item.call), *(v for _, v in item.legacy), "; ".join(item.warnings) or "none")
            for item in self.items
        )
        return Table(
            ("call", *LEGACY_READS, "warnings"),
            rows,
            f"The legacy getters after each call, torch {torch.__version__}",
        )

    def __repr__(self) -> str:
        return f"{self.writes().to_text()}\n\n{self.reads().to_text()}"

    def _repr_html_(self) -> str:
        return self.writes().to_html() + self.reads().to_html()


def changes(settings: Sequence[tuple[str, Any]]) -> Changes:
    """One :func:`change` per setting, each from the current state."""
    return Changes(tuple(change(p, v) for p, v in settings))


def _probes(dev: torch.device) -> dict[str, Any]:
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    a, b = randn(128, 512), randn(512, 128)
    x, w = randn(2, 32, 16, 16), randn(32, 32, 3, 3)
    return {"matmul": lambda: a @ b, "conv2d": lambda: F.conv2d(x, w, padding=1)}


@dataclass(frozen=True)
class Effect:
    """Whether a setting changed any probe's result against plain IEEE fp32 on one device."""

    settings: tuple[tuple[str, Any], ...]
    device: str
    differences: tuple[tuple[str, float], ...]
    reproducible: bool

    @property
    def changed(self) -> tuple[str, ...]:
        """The probes whose results differ from IEEE fp32."""
        return tuple(name for name, diff in self.differences if diff > 0)

    @property
    def call(self) -> str:
        """The statements that applied the settings."""
        return "; ".join(describe(p, v) for p, v in self.settings)

    @property
    def verdict(self) -> str:
        if not self.reproducible:
            return "undetermined: IEEE results differ between two identical runs"
        if not self.changed:
            return (
                "no effect on this hardware: "
                + ", ".join(n for n, _ in self.differences)
                + " bit-identical to IEEE fp32"
            )
        return "changes " + ", ".join(
            f"{n} (max relative difference {d:.2g})" for n, d in self.differences if d > 0
        )

    def __repr__(self) -> str:
        return f"{self.call} on {self.device}: {self.verdict}"

    def _repr_html_(self) -> str:
        return f"<p><code>{escape(self.call)}</code> on {escape(self.device)}: {escape(self.verdict)}</p>"


def effect(settings: Mapping[str, Any], dev: torch.device | str | None = None) -> Effect:
    """Run a matmul and a convolution on ``dev`` in plain IEEE fp32 and with ``settings``
    applied on top of :func:`inheriting`, and compare the results bit for bit."""
    dev = _device.pick() if dev is None else torch.device(dev)
    probes = _probes(dev)
    with precision(inheriting()):
        ieee = {name: run() for name, run in probes.items()}
        again = {name: run() for name, run in probes.items()}
        with precision(settings):
            switched = {name: run() for name, run in probes.items()}
    differences = tuple(
        (name, ((switched[name] - ieee[name]).abs().max() / ieee[name].abs().max()).item())
        for name in probes
    )
    reproducible = all(torch.equal(ieee[n], again[n]) for n in probes)
    return Effect(tuple(settings.items()), dev.type, differences, reproducible)

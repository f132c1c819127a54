"""The backends ``torch.compile`` runs a function with, and each one's output measured
against a float64 reference.

- :data:`BACKENDS`: ``eager``, ``aot_eager``, ``inductor`` and
  ``inductor+emulate_precision_casts`` (:data:`EMULATE`), inductor with its config switch
  that rounds intermediates as eager does.
- :func:`run` calls a function under one backend; :func:`compare` under several, with each
  output's dtype, error against the reference, and whether it equals eager bit for bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from mpguide import MPGuideError, error_line
from mpguide.core import device as _device
from mpguide.core import dtypes
from mpguide.core.table import Table
from mpguide.precision.numerics import ErrorStats, errors

EAGER, AOT_EAGER, INDUCTOR = "eager", "aot_eager", "inductor"
EMULATE = "inductor+emulate_precision_casts"
BACKENDS = (EAGER, AOT_EAGER, INDUCTOR, EMULATE)
COMPILED = (AOT_EAGER, INDUCTOR, EMULATE)
"""The backends that compile."""


def check(backend: str, allowed: Sequence[str] = BACKENDS) -> None:
    """``MPGuideError`` naming the choices unless ``backend`` is one of ``allowed``."""
    if backend not in allowed:
        raise MPGuideError(f"unknown backend {backend!r}; choose one of {', '.join(allowed)}")


def settings(backend: str):
    """The inductor config patch a backend name stands for (a null context for the rest)."""
    if backend == EMULATE:
        import torch._inductor.config

        return torch._inductor.config.patch(emulate_precision_casts=True)
    return nullcontext()


def import_inductor() -> None:
    """Import inductor's compiler, silencing the deprecation warning its import chain raises
    (``torch.utils.mkldnn`` uses ``torch.jit.script_method``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*torch\.jit\.script_method", category=DeprecationWarning
        )
        import torch._inductor.compile_fx  # noqa: F401


def _floats(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def run(fn: Callable[..., Any], args: Sequence[Any], backend: str) -> Any:
    """Call ``fn(*args)`` eagerly (``eager``) or compiled with ``backend`` from a fresh dynamo
    state, without gradients."""
    check(backend, BACKENDS)
    if backend == EAGER:
        with torch.no_grad():
            return fn(*args)
    import_inductor()
    torch._dynamo.reset()
    try:
        with settings(backend), torch.no_grad():
            name = INDUCTOR if backend == EMULATE else backend
            return torch.compile(fn, backend=name, fullgraph=True, dynamic=False)(*args)
    finally:
        torch._dynamo.reset()


@dataclass(frozen=True)
class Outcome:
    """One backend's output, measured against the reference, or the error it raised: the
    largest absolute error and that over the mean absolute reference value, as in
    :class:`mpguide.precision.numerics.ErrorStats`."""

    backend: str
    dtype: str
    max_abs: float | None
    max_rel: float | None
    equals_eager: bool | None
    error: str | None = None
    output: Any = field(default=None, repr=False, compare=False)


def _errors(out: Any, ref: Any) -> ErrorStats:
    """:func:`mpguide.precision.numerics.errors` over all floating outputs, flattened into one."""
    got, want = _floats(out), _floats(ref)
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want, strict=False)):
        raise MPGuideError("the output and the reference differ in number or shape of tensors")

    def flat(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in ts])

    return errors(flat(got), flat(want))


def _bitwise(a: Any, b: Any) -> bool:
    la, lb = _floats(a), _floats(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        for x, y in zip(la, lb, strict=False)
    )


@dataclass(frozen=True)
class Comparison:
    """Each backend's output against a float64 reference."""

    outcomes: tuple[Outcome, ...]
    reference: str
    machine: _device.Machine

    def __getitem__(self, backend: str) -> Outcome:
        for o in self.outcomes:
            if o.backend == backend:
                return o
        raise KeyError(backend)

    def table(self) -> Table:
        rows = tuple(
            (
                o.backend,
                o.dtype,
                o.max_abs,
                o.max_rel,
                "" if o.equals_eager is None else "yes" if o.equals_eager else "no",
                o.error,
            )
            for o in self.outcomes
        )
        return Table(
            (
                "backend",
                "output dtype",
                "max |error|",
                "max |error| / mean |ref|",
                "bitwise equal to eager",
                "error",
            ),
            rows,
            f"against {self.reference}, {self.machine.caption()}",
        )

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def _reference(
    fn: Callable[..., Any], args: Sequence[Any], reference: torch.dtype | Callable[..., Any]
) -> tuple[Any, str]:
    if callable(reference) and not isinstance(reference, torch.dtype):
        call, name = reference, getattr(reference, "__name__", "the reference")
    else:
        dt = dtypes.parse(reference)

        def cast(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                return x.detach().to(dt)
            return x

        def call(*a):
            return fn(*tree_map(cast, tuple(a)))

        name = f"{dtypes.name(dt)} eager"
    try:
        with torch.no_grad():
            return call(*args), name
    except Exception as err:  # noqa: BLE001 -- named in one line for the reader
        raise MPGuideError(
            f"the reference ({name}) raised {error_line(err)}; pass reference= a function"
        ) from None


def compare(
    fn: Callable[..., Any],
    args: Sequence[Any],
    backends: Sequence[str] = BACKENDS,
    reference: torch.dtype | Callable[..., Any] = torch.float64,
) -> Comparison:
    """Run ``fn(*args)`` under each backend and measure it against ``reference``: a dtype
    (``fn`` run eagerly on the floating inputs cast to it) or a callable taking ``args``.

    A backend that raises gets a row with its error instead of numbers.
    """
    for b in backends:
        check(b, BACKENDS)
    ref, ref_name = _reference(fn, args, reference)
    try:
        eager, eager_error = run(fn, args, EAGER), None
    except Exception as err:  # noqa: BLE001 -- eager raising is a finding: its row says so
        eager, eager_error = None, err
    outcomes = []
    for b in backends:
        try:
            if b == EAGER and eager_error is not None:
                raise eager_error
            out = eager if b == EAGER else run(fn, args, b)
        except Exception as err:  # noqa: BLE001 -- a backend that raises is a finding, not a failure
            outcomes.append(Outcome(b, "", None, None, None, error_line(err)))
            continue
        stats = _errors(out, ref)
        names = ", ".join(dict.fromkeys(dtypes.name(t.dtype) for t in _floats(out)))
        same = None if eager is None or b == EAGER else _bitwise(out, eager)
        outcomes.append(Outcome(b, names, stats.max_abs, stats.max_rel, same, output=out))
    dev = next((t.device for t in tree_leaves(args) if isinstance(t, torch.Tensor)), None)
    return Comparison(tuple(outcomes), ref_name, _device.describe(dev))

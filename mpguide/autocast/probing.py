"""One op under autocast: run it on float32, low-precision and mixed inputs, record what
autocast inserted, and classify it (the classes are described in
:mod:`mpguide.autocast.policy`); on a simulated device, check each run against the real and
the simulated CPU."""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from mpguide import error_line
from mpguide.autocast.calls import Inputs, Op
from mpguide.core import device as _device
from mpguide.core import dtypes

LOWER, FLOAT32, PROMOTE, UNCHANGED, UNSUPPORTED, NEEDS_HARDWARE = (
    "lower precision",
    "float32",
    "promote",
    "unchanged",
    "unsupported",
    _device.NEEDS_HARDWARE,
)
CLASSES = (LOWER, FLOAT32, PROMOTE, UNCHANGED, UNSUPPORTED, NEEDS_HARDWARE)
DIED = "probe died"
"""The start of the note of an op whose probe ended its process (:mod:`.isolated`)."""


@dataclass(frozen=True)
class Run:
    """What one call gave: the output dtype, the casts autocast inserted, or the error, and
    every op that reached the dispatcher under autocast."""

    out: torch.dtype | None
    casts: tuple[tuple[torch.dtype, torch.dtype], ...]
    error: str | None = None
    warning: str | None = None
    calls: tuple[dtypes.Call, ...] = field(default=(), repr=False, compare=False)
    error_outside: str | None = None


def _first_float(value: Any) -> torch.dtype | None:
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex()):
            return leaf.dtype
    return None


def _error(err: BaseException) -> str:
    """:func:`mpguide.error_line`, cut after its first sentence when that line is long (the
    dispatcher's "Could not run" lists every backend)."""
    line = error_line(err)
    if len(line) <= 160:
        return line
    end = line.find(". ", 40)
    return line[: end + 1] if 0 < end < 200 else line[:159] + "…"


def _call(op: Op, args: tuple, dev: _device.Target, dtype: torch.dtype | None) -> Run:
    log = dtypes.Log()
    warn_always = torch.is_warn_always_enabled()
    # Warnings torch gives once per process come every time, whatever ran before.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.set_warn_always(True)
        try:
            with _device.autocast(dev, dtype), log:
                out = op.call(*args)
        except Exception as err:  # noqa: BLE001 - an op that raises is a finding, not a failure
            return Run(None, tuple(log.conversions()), _error(err), calls=tuple(log.calls))
        finally:
            torch.set_warn_always(warn_always)
    warning = f"{caught[0].category.__name__}: {caught[0].message}" if caught else None
    return Run(_first_float(out), tuple(log.conversions()), None, warning, tuple(log.calls))


def run(op: Op, args: tuple, dev: _device.Target, dtype: torch.dtype) -> Run:
    """Call ``op`` on ``args`` under autocast for ``dev`` and ``dtype``.

    The casts kept are those autocast inserted: the ones the same call makes outside autocast
    (an op's own decomposition may cast) are taken away, and so are casts from or to another
    dtype than ``dtype`` and float32 (a kernel's own, such as quantile's float64 since 2.14,
    where the same call outside autocast raises and shows none).
    """
    inside = _call(op, args, dev, dtype)
    outside = _call(op, args, dev, None)
    own = Counter(outside.casts)
    added = []
    for c in inside.casts:
        if own[c]:
            own[c] -= 1
        elif set(c) <= {dtype, torch.float32}:  # autocast casts between these two only here
            added.append(c)
    return Run(inside.out, tuple(added), inside.error, inside.warning, inside.calls, outside.error)


def observe(
    fn: Callable[[torch.device], Any],
    dev: _device.Target | torch.device | str | None = None,
    dtype: torch.dtype | str = torch.bfloat16,
    simulate: bool = False,
) -> Run:
    """Call ``fn(device)`` under autocast on ``dev`` (live, or simulated where this machine
    lacks it; tensors ``fn`` makes are then fake) and return what came out: the output dtype,
    every op that reached the dispatcher, and the casts autocast added."""
    target = dev if isinstance(dev, _device.Target) else _device.target(dev, simulate)
    op = Op(getattr(fn, "__name__", "fn"), "", lambda t: (t.dev,), fn)
    with _device.tensors(target):
        return run(op, (target.device,), target, dtypes.autocast_dtype(dtype))


def _cast_floats(args: tuple, kinds: Sequence[torch.dtype]) -> tuple:
    it = iter(kinds)

    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(next(it))
        return x

    return tree_map(cast, args)


def _n_floats(args: tuple) -> int:
    return sum(isinstance(x, torch.Tensor) and x.is_floating_point() for x in tree_leaves(args))


@dataclass(frozen=True)
class Probe:
    """One op's behaviour under autocast, and the class it falls in."""

    op: str
    family: str
    kind: str
    fp32_in: Run
    low_in: Run
    mixed_in: Run | None
    reason: str = ""
    undecided: tuple[str, ...] = ()

    @property
    def error(self) -> str | None:
        """The first error of the three runs."""
        runs = (self.fp32_in, self.low_in, self.mixed_in)
        return next((r.error for r in runs if r is not None and r.error), None)

    @property
    def died(self) -> str | None:
        """Why the process probing this op died (a signal, a broken device), or ``None``."""
        return self.reason if self.reason.startswith(DIED) else None

    @property
    def note(self) -> str:
        """Why the op needs hardware, else the first error, else the first warning."""
        runs = [r for r in (self.fp32_in, self.low_in, self.mixed_in) if r is not None]
        return self.reason or self.error or next((r.warning for r in runs if r.warning), "")

    @property
    def casts(self) -> tuple[str, ...]:
        """The distinct casts autocast inserted, as ``src->dst``, over all three runs."""
        seen: dict[str, None] = {}
        for r in (self.fp32_in, self.low_in, self.mixed_in):
            for src, dst in r.casts if r else ():
                seen[f"{dtypes.name(src)}->{dtypes.name(dst)}"] = None
        return tuple(seen)


def _real(dt: torch.dtype | None) -> torch.dtype | None:
    return dt.to_real() if dt is not None and dt.is_complex else dt


def classify(fp32_in: Run, low_in: Run, mixed_in: Run | None, dtype: torch.dtype) -> str:
    """The class of an op from its three runs (see :mod:`mpguide.autocast.policy`).

    An op that raises only on mixed inputs keeps the class its uniform runs give: autocast
    did not reconcile the dtypes, and the probe's error column says so.
    """
    if fp32_in.error or low_in.error:
        return UNSUPPORTED
    if _real(fp32_in.out) == dtype:
        return LOWER
    if _real(low_in.out) == torch.float32:
        return FLOAT32
    if mixed_in is not None and (dtype, torch.float32) in mixed_in.casts:
        return PROMOTE
    return UNCHANGED


RUNS = ("fp32_in", "low_in", "mixed_in")


def _run_all(op: Op, dev: _device.Target, dtype: torch.dtype, seed: int) -> tuple:
    """The three runs of one op: float32, low-precision and (two or more floating inputs) mixed
    inputs. Inputs that cannot be made on the device count as an error of every run."""
    with _device.tensors(dev):
        try:
            args = op.inputs(Inputs(dev.device, seed, fake=dev.simulated))
        except Exception as err:  # noqa: BLE001 - reported in the probe
            failed = Run(None, (), f"inputs: {_error(err)}", error_outside=_error(err))
            return failed, failed, None
        n = _n_floats(args)
        fp32_in = run(op, _cast_floats(args, [torch.float32] * n), dev, dtype)
        low_in = run(op, _cast_floats(args, [dtype] * n), dev, dtype)
        mixed_in = (
            run(op, _cast_floats(args, [dtype] + [torch.float32] * (n - 1)), dev, dtype)
            if n >= 2
            else None
        )
    return fp32_in, low_in, mixed_in


@dataclass(frozen=True)
class Reference:
    """One op on the CPU, run for real and simulated: what a simulated device's run of the same
    op is checked against."""

    real: tuple
    fake: tuple


def _gap(i: int, sim: Run, ref: Reference) -> str | None:
    """Why run ``i`` of a simulated device cannot be trusted, or ``None``. The CPU tells: where
    this device's autocast treats the inputs as the CPU's does (the same casts), the meta kernel
    gets what the CPU kernel got; where it casts nothing, the kernel gets the inputs as given,
    as the CPU kernel does outside autocast. A cell is undecided only where, for those inputs,
    the real CPU kernel raises or returns another dtype while the meta kernel does not."""
    real, fake = ref.real[i], ref.fake[i]
    if real is None or fake is None or sim.error:
        return None
    if sim.casts == real.casts:
        if real.error and not fake.error:
            return f"the CPU kernel raises ({real.error}) where the meta kernel runs"
        if not real.error and not fake.error and real.out != fake.out:
            return f"the CPU kernel returns {real.out} where the meta kernel returns {fake.out}"
    elif not sim.casts and real.error_outside and not fake.error_outside:
        return (
            f"the CPU kernel refuses these inputs outside autocast ({real.error_outside}) where "
            "the meta kernel takes them; this device's kernel may refuse them too"
        )
    return None


def _decided_by_casts(i: int, r: Run, dtype: torch.dtype) -> str | None:
    """The class that the casts autocast inserted before the kernel raised settle, if any:
    float32 inputs cast to ``dtype`` (lower precision), ``dtype`` ones cast to float32."""
    if i == 0 and (torch.float32, dtype) in r.casts:
        return LOWER
    if i == 1 and (dtype, torch.float32) in r.casts:
        return FLOAT32
    return None


def _same_error(real: Run | None, fake: Run) -> bool:
    """Whether the real CPU kernel, outside autocast, raised the exception type the simulated
    run raised (torch words the meta and CPU checks differently)."""
    if real is None or not real.error_outside or not fake.error:
        return False
    return real.error_outside.split(":", 1)[0] == fake.error.split(":", 1)[0]


def probe_op(
    op: Op,
    dev: _device.Target,
    dtype: torch.dtype,
    seed: int = 0,
    ref: Reference | None = None,
) -> Probe:
    """Run one op the three ways and classify it.

    On a simulated device, checked against the CPU (``ref``):

    - a run whose meta kernel may differ from a real kernel (see :func:`_gap`) is undecided;
      the class stands where the decided runs settle it (``lower precision`` from the float32
      run, and so on), else the op ``needs hardware``;
    - an op that raises with autocast off as well has no meta kernel for these inputs: the
      casts autocast inserted before it raised settle the class where they can; where
      autocast cast nothing and the real CPU kernel raises the same error, the kernel refuses
      the dtype (``unsupported``); else it ``needs hardware``.

    An op that raises only under autocast is refused by autocast itself, a rule of this build.
    """
    runs = _run_all(op, dev, dtype, seed)
    fp32_in, low_in, mixed_in = runs
    kind = classify(fp32_in, low_in, mixed_in, dtype)
    if not dev.simulated or ref is None:
        return Probe(op.name, op.family, kind, *runs)
    gaps = {RUNS[i]: why for i, r in enumerate(runs) if r and (why := _gap(i, r, ref))}
    if kind in (LOWER, FLOAT32, PROMOTE) and mixed_in is not None and mixed_in.casts:
        gaps.pop("mixed_in", None)  # autocast made the inputs one dtype before the kernel
    reason = ""
    if kind == UNSUPPORTED:
        i = 0 if fp32_in.error else 1
        failed = runs[i]
        real = ref.real[i]
        if failed.error_outside:
            settled = _decided_by_casts(i, failed, dtype) or (
                i == 0 and _decided_by_casts(1, low_in, dtype)
            )
            if settled:
                kind = settled
                reason = (
                    f"from the casts autocast inserted; the meta kernel then raised: "
                    f"{failed.error_outside}"
                )
            elif (
                i == 1
                and not failed.casts
                and _same_error(real, failed)
                and not ref.real[0].error_outside
            ):
                reason = (
                    f"the kernel refuses the dtype; the real CPU kernel too: {real.error_outside}"
                )
            else:
                kind, reason = NEEDS_HARDWARE, f"the meta kernel raises: {failed.error_outside}"
    if kind not in (UNSUPPORTED, NEEDS_HARDWARE):
        settles = {LOWER: "fp32_in", FLOAT32: "low_in", PROMOTE: "mixed_in"}.get(kind)
        if settles in gaps or (kind == UNCHANGED and {"fp32_in", "low_in"} & set(gaps)):
            kind, reason = NEEDS_HARDWARE, gaps[settles or next(r for r in RUNS if r in gaps)]
        elif gaps:
            reason = "; ".join(f"{r.replace('_in', ' in')}: {why}" for r, why in gaps.items())
    return Probe(op.name, op.family, kind, *runs, reason, tuple(sorted(gaps)))


@functools.cache
def references(dtype: torch.dtype, ops: tuple[Op, ...]) -> dict[str, Reference]:
    """Every op of ``ops`` run on the CPU for real and simulated, under ``dtype`` autocast."""
    live, fake = _device.target("cpu"), _device.target("cpu", simulate=True)
    return {
        op.name: Reference(_run_all(op, live, dtype, 0), _run_all(op, fake, dtype, 0)) for op in ops
    }


def meta_gaps(dtype: torch.dtype, ops: tuple[Op, ...]) -> dict[str, dict[str, str]]:
    """Where the simulated CPU cannot be trusted: the runs (of :data:`RUNS`) whose real CPU
    kernel raises under CPU autocast, or returns another dtype, while the meta kernel runs;
    maps op name to ``{run: reason}``."""
    gaps: dict[str, dict[str, str]] = {}
    for name, ref in references(dtype, ops).items():
        for i, run_name in enumerate(RUNS):
            if ref.fake[i] is not None and (why := _gap(i, ref.fake[i], ref)):
                gaps.setdefault(name, {})[run_name] = why
    return gaps

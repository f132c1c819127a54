"""Your own model, module by module: dtypes, casts, and error against a float64 run.

:func:`report` runs a model on its inputs under autocast (or cast wholesale to one dtype) with
hooks on every module and a :class:`mpguide.core.dtypes.Log` below them. Each op is counted in the
innermost module being run; a backward op in the module whose forward op made its autograd
node (autograd's sequence numbers say which). For every call of every module, in call order:

- the dtypes of its tensor inputs and outputs, and of its own parameters;
- the ops it ran itself (not in its submodules) and the dtype conversions among them, forward
  and, with ``backward=True``, backward; under autocast, how many of those conversions autocast
  added: those the same module call does not make in a run with autocast off (the definition
  :mod:`mpguide.autocast.policy` uses for one op);
- on a live device, against a float64 copy of the model run with autocast off on the same
  inputs (floating inputs cast to float64), matched by module name and call index: the error
  of its first floating input and of its output (``max |error| / mean |ref|``, the statistic of
  :func:`mpguide.precision.numerics.errors`, over every floating tensor of the output), the infinities
  and NaNs it returned where the reference is finite, the values it returned as zero where
  the reference is not, and the reference values beyond the largest finite value of the
  low-precision format.

:attr:`Report.first_nonfinite` is where a non-finite value first appears: the first module
call to finish with an infinity or NaN where the reference has none, from a finite first
input; :attr:`Report.largest_jump` the call whose output error grew most over its input error,
when it grew :data:`JUMP` times or more (an error below the format's unit roundoff counts as
the unit roundoff). "To zero" counts the values the format flushed: zero where the reference
is not, and smaller than the format's smallest normal number (a value that only rounding or
cancellation made zero, a ReLU's sign flip, is error, not a flush). Modules run in eval mode, so dropout is off and both runs see the same
function. On a simulated device (:func:`mpguide.core.device.target`) no kernel runs: the report has
dtypes, ops and casts only, and says so.
"""

from __future__ import annotations

import copy
import json
import math
import re
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from mpguide import MPGuideError, error_line
from mpguide.core import device as _device
from mpguide.core import dtypes
from mpguide.core.table import Table
from mpguide.models import compare, memory, recorder
from mpguide.models.recorder import Key, Say
from mpguide.precision import numerics
from mpguide.training.autograd import BACKWARD, FORWARD

SHOWN = ("module", "in", "out", "casts", "bwd casts", "out err", "inf", "nan", "to zero", "type")
"""The columns a table shows by default, in this order: where each module's dtypes change and
its error; the module's type last, the first a narrow terminal leaves out (the name tells)."""
BEYOND = "|ref| > max"
"""The column of reference values beyond the low-precision format's largest finite value."""
JUMP = 10.0
"""How many times its input's error a module's output error must be to count as a jump."""

TRANSFORMERS_PATH = (
    "a simulated transformers model takes another path than a live one: transformers counts "
    "fake tensors as tracing (is_tracing in transformers.utils.import_utils, through "
    "is_fake_tensor), so its mask code (masking_utils' find_packed_sequence_indices and "
    "_ignore_causal_mask_sdpa), which cannot read their values, builds an explicit attention "
    "mask where a live run leaves it to sdpa's is_causal: more ops there, and a mask input to "
    "attention"
)
"""Why a simulated transformers model runs ops a live run does not."""


@dataclass(frozen=True)
class ModuleCall:
    """One call of one module: its dtypes, the ops and casts it ran, and (live) its error."""

    name: str
    kind: str
    index: int
    depth: int
    inputs: tuple[torch.dtype, ...]
    outputs: tuple[torch.dtype, ...]
    params: tuple[torch.dtype, ...]
    ops: int
    casts: int
    autocast_casts: int | None = None
    backward_ops: int | None = None
    backward_casts: int | None = None
    backward_autocast_casts: int | None = None
    input_error: numerics.ErrorStats | None = None
    error: numerics.ErrorStats | None = None
    inf: int | None = None
    nan: int | None = None
    to_zero: int | None = None
    beyond_range: int | None = None
    finished: int = 0
    input_nonfinite: int | None = None

    @property
    def key(self) -> Key:
        return self.name, self.index

    @property
    def label(self) -> str:
        """The qualified name (``(root)`` for the model itself), with the call when not the
        first (``layers.0.mlp, call 2``)."""
        return recorder.label(self.key)

    @property
    def nonfinite(self) -> int | None:
        """Infinities and NaNs returned where the reference is finite (``None``: unknown)."""
        return None if self.inf is None else self.inf + (self.nan or 0)


def arguments(inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` from what a factory returned as inputs: one tensor, a tuple or list
    of arguments, or a dict of keyword arguments."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    elif isinstance(inputs, dict) and all(isinstance(k, str) for k in inputs):
        args, kwargs = (), dict(inputs)
    else:
        raise MPGuideError(
            "inputs must be a tensor, a tuple or list of arguments, or a dict of keyword "
            f"arguments, not {type(inputs).__name__}"
        )
    if not any(isinstance(t, torch.Tensor) for t in tree_leaves((args, kwargs))):
        raise MPGuideError("the inputs hold no tensor")
    return args, kwargs


def _cast_floats(value: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return value
    return tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        value,
    )


@dataclass(frozen=True)
class Report:
    """Every module call of one model run, in call order, with its dtypes, casts and error."""

    model: str
    calls: tuple[ModuleCall, ...] = field(repr=False)
    target: _device.Target
    autocast: torch.dtype | None
    dtype: torch.dtype | None
    backward: bool
    machine: _device.Machine
    narrowed: tuple[Key, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def low(self) -> torch.dtype:
        """The low-precision dtype of the run: autocast's, or the one the model was cast to."""
        return self.autocast or self.dtype

    @property
    def simulated(self) -> bool:
        return self.target.simulated

    @property
    def how(self) -> str:
        return self.target.how

    def __getitem__(self, key: str | Key) -> ModuleCall:
        """The call of a module by qualified name (its first call) or ``(name, index)``."""
        name, index = (key, 0) if isinstance(key, str) else key
        for c in self.calls:
            if c.name == name and c.index == index:
                return c
        raise KeyError(key)

    def _finished(self) -> list[ModuleCall]:
        return sorted(self.calls, key=lambda c: c.finished)

    @property
    def first_nonfinite(self) -> ModuleCall | None:
        """Where a non-finite value first appears: the first module call to finish with an
        infinity or NaN where the reference has none, its first floating input finite."""
        return next((c for c in self._finished() if c.nonfinite and not c.input_nonfinite), None)

    def growth(self, call: ModuleCall) -> float | None:
        """How many times its input's error a call's output error is, each at least the
        format's unit roundoff; None where either is unknown or the output is not finite."""
        if call.error is None or call.input_error is None or call.nonfinite:
            return None
        floor = torch.finfo(self.low).eps / 2
        return max(call.error.max_rel, floor) / max(call.input_error.max_rel, floor)

    @property
    def largest_jump(self) -> ModuleCall | None:
        """The module call whose error grew most from its input to its output, when it grew
        :data:`JUMP` times or more. A module that holds it grows as much: of the calls within
        half the largest growth, the first to finish (the innermost) is named."""
        grown = [(g, c) for c in self._finished() if (g := self.growth(c)) is not None]
        top = max((g for g, _ in grown), default=0.0)
        if top < JUMP:
            return None
        return next(c for g, c in grown if g >= top / 2)

    @property
    def run(self) -> str:
        """``autocast(cpu, bfloat16)`` or ``cast to float16``."""
        if self.autocast is not None:
            return f"autocast({self.target.device.type}, {dtypes.name(self.autocast)})"
        return _run_name(None, self.dtype)

    @property
    def caption(self) -> str:
        how = "simulated: " + self.how if self.simulated else self.how
        return (
            f"{self.model} module by module, {self.run}, {len(self.calls)} module calls, "
            f"{self.machine.caption()}; {how}"
        )

    def findings(self) -> list[str]:
        """Sentences on what the report found: the first non-finite value, the largest growth
        in error, where the reference itself ran narrower than float64."""
        if self.simulated:
            return [f"simulated ({self.how}): dtypes, ops and casts only, no errors"]
        out = []
        bad = self.first_nonfinite
        if bad is not None:
            out.append(
                f"first non-finite output: {bad.label} ({bad.kind}): {bad.inf} inf and "
                f"{bad.nan} NaN where the float64 reference is finite"
            )
        else:
            out.append("no module returned inf or NaN where the float64 reference is finite")
        jump = self.largest_jump
        if jump is not None:
            came, floor = jump.input_error.max_rel, torch.finfo(self.low).eps / 2
            counted = (
                f" (counted as {dtypes.name(self.low)}'s unit roundoff {floor:.3g}, the floor "
                "of a growth)"
                if came < floor
                else ""
            )
            out.append(
                f"largest growth in error: {jump.label} ({jump.kind}), {self.growth(jump):.3g} "
                f"times: max |error| / mean |ref| {came:.3g} in{counted}, "
                f"{jump.error.max_rel:.3g} out"
            )
        else:
            out.append(f"no module's error grew {JUMP:g} times or more from input to output")
        if self.narrowed:
            names = [recorder.label(key) for key in self.narrowed[:3]]
            out.append(
                f"the float64 reference itself converted to a narrower dtype in "
                f"{len(self.narrowed)} module calls ({', '.join(names)}"
                f"{', ...' if len(self.narrowed) > 3 else ''}): there it is as precise as that "
                "dtype only"
            )
        return out

    def columns(self) -> list[str]:
        """Every column this report has, in order."""
        columns = ["module", "type", "in", "out", "params", "ops", "casts"]
        if self.autocast is not None:
            columns.append("autocast casts")
        if self.backward:
            columns += ["bwd ops", "bwd casts"]
            if self.autocast is not None:
                columns.append("bwd autocast casts")
        if not self.simulated:
            columns += ["in err", "out err", "inf", "nan", "to zero", BEYOND]
        return columns

    def table(
        self,
        limit: int | None = None,
        columns: str | list[str] | None = None,
        nested: bool = False,
    ) -> Table:
        """One row per module call in call order (the first ``limit`` of them); the notes
        say what the columns mean, what the report found and how many rows are left out.
        ``columns``: None for those that matter most (:data:`SHOWN`), ``"all"``, or a list
        of names from :meth:`columns`. ``nested``: each module named within the call that
        runs it, indented by depth (``    q_proj``), as a terminal reads it; else by its
        qualified name."""
        every = self.columns()
        if columns is None:
            columns = [c for c in SHOWN if c in every]
        elif columns == "all":
            columns = every
        else:
            unknown = [c for c in columns if c not in every]
            if unknown:
                raise MPGuideError(
                    f"no column {unknown[0]!r} in this report; it has {', '.join(every)}"
                )
        shown = self.calls if limit is None else self.calls[:limit]
        rows = tuple(tuple(_cells(c, columns)) for c in shown)
        if nested and "module" in columns:
            at = columns.index("module")
            rows = tuple(
                (*r[:at], label, *r[at + 1 :])
                for r, label in zip(rows, _nested(shown), strict=True)
            )
        notes = [*self.findings(), *self.notes, _legend(self, columns)]
        if len(shown) < len(self.calls):
            notes.append(
                f"... {len(self.calls) - len(shown)} more module calls not shown "
                f"({len(shown)} of {len(self.calls)})"
            )
        return Table(tuple(columns), rows, self.caption, tuple(notes))

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def _finding(report: Report, call: ModuleCall | None) -> dict | None:
    if call is None:
        return None
    return {
        "module": call.name,
        "call": call.index,
        "type": call.kind,
        "inf": call.inf,
        "nan": call.nan,
        "in err": _json_number(_err(call.input_error)),
        "out err": _json_number(_err(call.error)),
        "growth": _json_number(report.growth(call)),
    }


def _json_number(x: float | None) -> float | str | None:
    """A number as JSON holds it: an infinity or NaN by name (``"inf"``), null for unknown."""
    return x if x is None or math.isfinite(x) else str(x)


def json_document(report: Report, table: Table) -> str:
    """The report as one JSON document: the table's caption, notes and rows, where an
    infinite or NaN error is the string ``"inf"`` or ``"nan"`` (null is unknown), and the
    findings as fields: ``first_nonfinite`` and ``largest_jump`` (null when none) and
    ``simulated``."""
    doc = json.loads(table.to_json())
    calls = {c.label: c for c in report.calls}
    for row in doc["rows"]:
        call = calls.get(row.get("module"))
        for key, stats in (("in err", "input_error"), ("out err", "error")):
            if call is not None and key in row:
                row[key] = _json_number(_err(getattr(call, stats)))
    doc |= {
        "simulated": report.simulated,
        "first_nonfinite": _finding(report, report.first_nonfinite),
        "largest_jump": _finding(report, report.largest_jump),
    }
    return json.dumps(doc, indent=2, allow_nan=False)


def differences(a: Report, b: Report) -> Table:
    """The module calls whose input or output dtypes, ops or autocast casts differ between two
    reports of one model (on two devices, say), matched by name and call; a call only one
    report has is listed with blanks for the other."""
    labels = [f"{_device.label(r.target.device.type, r.how)} {r.run}" for r in (a, b)]
    if labels[0] == labels[1]:
        labels = [f"{lab} ({i})" for i, lab in enumerate(labels, 1)]

    def cells(c: ModuleCall | None) -> tuple:
        if c is None:
            return (None,) * 4
        return _short(c.inputs), _short(c.outputs), c.ops, c.autocast_casts

    mine, theirs = ({c.key: c for c in r.calls} for r in (a, b))
    rows = []
    for key in dict.fromkeys([*mine, *theirs]):
        here, there = cells(mine.get(key)), cells(theirs.get(key))
        if here != there:
            label = (mine.get(key) or theirs[key]).label
            rows.append((label, *here, *there))
    columns = ("module", *(f"{k}, {lab}" for lab in labels for k in _COMPARED))
    return Table(columns, tuple(rows), f"module calls that differ: {labels[0]} and {labels[1]}")


_COMPARED = ("in", "out", "ops", "autocast casts")


def _short(dts: tuple[torch.dtype, ...]) -> str:
    return "+".join(dtypes.short(d) for d in dts)


def _err(stats: numerics.ErrorStats | None) -> float | None:
    return None if stats is None else stats.max_rel


def _cells(c: ModuleCall, columns: list[str]) -> Iterator[Any]:
    values = {
        "module": c.label,
        "type": c.kind,
        "in": _short(c.inputs),
        "out": _short(c.outputs),
        "params": _short(c.params),
        "ops": c.ops,
        "casts": c.casts,
        "autocast casts": c.autocast_casts,
        "bwd ops": c.backward_ops,
        "bwd casts": c.backward_casts,
        "bwd autocast casts": c.backward_autocast_casts,
        "in err": _err(c.input_error),
        "out err": _err(c.error),
        "inf": c.inf,
        "nan": c.nan,
        "to zero": c.to_zero,
    }
    for col in columns:
        yield c.beyond_range if col == BEYOND else values[col]


def _nested(calls) -> Iterator[str]:
    """Each call's name within the call that runs it (its full name where it is not a
    submodule of that one), indented two spaces per level."""
    stack: list[str] = []
    for c in calls:
        del stack[c.depth :]
        parent = stack[-1] if stack else ""
        name = c.name[len(parent) + 1 :] if parent and c.name.startswith(parent + ".") else None
        stack.append(c.name)
        label = recorder.label((name or c.name, c.index)) if c.depth else c.label
        yield "  " * c.depth + label


def _legend(r: Report, columns: list[str]) -> str:
    said = set(columns)
    parts = ["casts: dtype conversions the module ran itself, not its submodules"]
    if said & {"ops", "bwd ops"}:
        parts.append("ops: the ops it ran itself")
    if said & {"autocast casts", "bwd autocast casts"}:
        parts.append("autocast casts: those the same call does not make with autocast off")
    if r.backward:
        parts.append("bwd: the backward pass, with ones as output gradients")
    if said & {"in err", "out err"}:
        parts.append(
            "err: max |error| / mean |ref| of the "
            + ("first floating input and of the " if "in err" in said else "")
            + "output, against a float64 copy of the model on the same inputs"
        )
    if said & {"inf", "nan"}:
        parts.append("inf, nan: returned where the reference is finite")
    if "to zero" in said:
        parts.append("to zero: flushed, zero where the reference is below the smallest normal")
    if BEYOND in said:
        parts.append(f"{BEYOND}: reference values beyond the largest finite {dtypes.name(r.low)}")
    if set(r.columns()) - said:
        parts.append("--columns all shows every column")
    return "; ".join(parts)


def precision(model, autocast, dtype) -> tuple[torch.dtype | None, torch.dtype | None]:
    """The run's precision as ``(autocast dtype, cast dtype)``, one of them None, checked: a
    module, and autocast or a cast, not both (autocast to bf16 by default)."""
    if not isinstance(model, torch.nn.Module):
        raise MPGuideError(f"the model must be a torch.nn.Module, not {type(model).__name__}")
    if autocast is not None and dtype is not None:
        raise MPGuideError("give autocast or dtype, not both")
    if dtype is None:
        return dtypes.autocast_dtype(torch.bfloat16 if autocast is None else autocast), None
    return None, dtypes.parse(dtype)


def report(
    model: torch.nn.Module,
    inputs: Any,
    *,
    autocast: torch.dtype | str | None = None,
    dtype: torch.dtype | str | None = None,
    device: _device.Target | torch.device | str | None = None,
    simulate: bool = False,
    backward: bool = False,
    progress: Say | None = None,
) -> Report:
    """Run ``model`` on ``inputs`` (a tensor, a tuple or list of arguments, or a dict of
    keyword arguments) under ``autocast`` (bfloat16 or float16; the default when no
    ``dtype`` is given is bfloat16), or cast wholesale to ``dtype`` with its floating inputs,
    on ``device`` (default :func:`mpguide.core.device.pick`; live where this machine has it,
    simulated where it does not or ``simulate`` is true), and report every module call (see
    the module's docstring). The model itself is left as it was: it is copied where it must be
    cast or moved, and its modules' training flags are restored. Before a live run, the
    copies it keeps are checked against the memory the device has
    (:func:`mpguide.models.memory.check`). ``progress`` is told each module call done."""
    autocast, dtype = precision(model, autocast, dtype)
    if dtype == torch.float64:
        raise MPGuideError("the reference is float64 already; cast to a narrower dtype")
    target = device if isinstance(device, _device.Target) else _device.target(device, simulate)
    if backward and target.simulated and not _device.simulates_autograd(target.device.type):
        raise MPGuideError(f"no backward pass: {_device.no_autograd_reason(target.device.type)}")
    args, kwargs = arguments(inputs)
    low_model = model
    copied = dtype is not None or (not target.simulated and _on_other_device(model, target))
    if not target.simulated:
        memory.check(memory.report_needs(model, dtype, copied, backward), target.device)
    if copied:
        low_model = copy.deepcopy(model).to(device=_live(target), dtype=dtype)
    low_inputs = _cast_floats((args, kwargs), dtype)
    params = {
        n: recorder.dtypes_of(list(m.parameters(recurse=False)))
        for n, m in low_model.named_modules()
    }

    kept = None if target.simulated else compare.Kept()
    with _device.tensors(target, [low_model]), _simulation_limits(target):
        a, k = _device.move(low_inputs, target)
        run, ran_backward = recorder.run(
            low_model,
            a,
            k,
            target,
            autocast,
            backward,
            kept and kept.on_input,
            kept and kept.on_output,
            progress and (progress, "run " + _run_name(autocast, dtype), None),
        )
        if kept is not None:
            kept.close()
        plain = None
        total = len(run.seen)
        if autocast is not None:
            stage = "run with autocast off"
            plain, _ = recorder.run(
                low_model,
                a,
                k,
                target,
                None,
                backward,
                progress=progress and (progress, stage, total),
            )
    notes = []
    if target.simulated and type(model).__module__.startswith("transformers."):
        notes.append(TRANSFORMERS_PATH)
    if backward and not ran_backward:
        notes.append("no backward pass: nothing the output depends on requires grad")

    numbers: dict[Key, compare.Numbers] = {}
    narrowed: tuple[Key, ...] = ()
    if kept is not None:
        reference = copy.deepcopy(model).to(device=target.device, dtype=torch.float64)
        a, k = _device.move(_cast_floats((args, kwargs), torch.float64), target)
        low = torch.finfo(autocast or dtype)
        comparing = compare.Compare(kept, low.max, low.tiny)
        try:
            ref, _ = recorder.run(
                reference,
                a,
                k,
                target,
                None,
                False,
                comparing.on_input,
                comparing.on_output,
                progress and (progress, "float64 reference", total),
            )
        except Exception as err:
            raise MPGuideError(
                f"the float64 copy of the model raised {error_line(err)}: the reference needs "
                "a model that runs in float64"
            ) from err
        numbers = comparing.numbers
        narrowed = tuple(
            s.key
            for s in ref.seen
            if any(a == torch.float64 != b and b.is_floating_point for a, b in s.casts[FORWARD])
        )
    plain_seen = plain.by_key() if plain is not None else {}
    calls = tuple(
        _module_call(
            s, plain_seen.get(s.key), numbers.get(s.key, compare.Numbers()), params, backward
        )
        for s in run.seen
    )
    return Report(
        type(model).__name__,
        calls,
        target,
        autocast,
        dtype,
        backward,
        target.describe(),
        narrowed,
        tuple(notes),
    )


def _run_name(autocast: torch.dtype | None, dtype: torch.dtype | None) -> str:
    if autocast is not None:
        return f"under autocast to {dtypes.name(autocast)}"
    return f"cast to {dtypes.name(dtype)}"


@contextmanager
def _simulation_limits(target: _device.Target) -> Iterator[None]:
    """An op that this torch build cannot run on a simulated device fails inside torch with
    an INTERNAL ASSERT (a kernel stub with no entry for the device, as
    ``scaled_dot_product_attention`` picks its kernel): said in one line, naming the line of
    the model that called it, as a limit of the simulation, not an error of the model."""
    try:
        yield
    except RuntimeError as err:
        if not (target.simulated and "INTERNAL ASSERT" in str(err)):
            raise
        dev = target.device.type
        raise MPGuideError(
            f"the simulated {dev} cannot run an op this model calls at {_caller(err)}: torch "
            f"{torch.__version__} picks its kernel through a dispatch stub that has no {dev} "
            f"entry in this build (an INTERNAL ASSERT inside torch, not the model's error); a "
            f"build with {dev}, or --device cpu or cuda, runs it"
        ) from None


def _caller(err: BaseException) -> str:
    """``file.py:LINE (code)`` of the innermost frame of ``err``'s traceback outside torch
    and mpguide: the model's line that called into torch."""
    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if not re.search(r"[/\\](torch|mpguide)[/\\]", f.filename)
    ]
    if not frames:
        return "an unknown line"
    f = frames[-1]
    return f"{Path(f.filename).name}:{f.lineno} ({(f.line or '').strip()})"


def _module_call(
    s: recorder.Seen,
    plain: recorder.Seen | None,
    num: compare.Numbers,
    params: dict[str, tuple[torch.dtype, ...]],
    backward: bool,
) -> ModuleCall:
    """One row of the report: a call of the autocast (or cast) run, with the plain run's
    call of the same key to tell autocast's casts (``None`` in a run without autocast)."""

    def casts(phase: str) -> int:
        return sum(s.casts[phase].values())

    def added(phase: str) -> int | None:
        if plain is None:
            return None
        return sum((s.casts[phase] - plain.casts[phase]).values())

    return ModuleCall(
        name=s.name,
        kind=s.kind,
        index=s.index,
        depth=s.depth,
        inputs=s.inputs,
        outputs=s.outputs,
        params=params.get(s.name, ()),
        ops=s.ops[FORWARD],
        casts=casts(FORWARD),
        autocast_casts=added(FORWARD),
        backward_ops=s.ops[BACKWARD] if backward else None,
        backward_casts=casts(BACKWARD) if backward else None,
        backward_autocast_casts=added(BACKWARD) if backward else None,
        input_error=num.input_error,
        error=num.error,
        inf=num.inf,
        nan=num.nan,
        to_zero=num.to_zero,
        beyond_range=num.beyond_range,
        finished=s.finished,
        input_nonfinite=num.input_nonfinite,
    )


def _live(target: _device.Target) -> torch.device | None:
    """Where a copy of the model goes: the target's device when live; a simulated run takes
    the copy as it is (:func:`mpguide.core.device.tensors` fakes it)."""
    return None if target.simulated else target.device


def _on_other_device(model: torch.nn.Module, target: _device.Target) -> bool:
    want = target.device
    return any(
        t.device.type != want.type or want.index not in (None, t.device.index)
        for t in [*model.parameters(), *model.buffers()]
    )

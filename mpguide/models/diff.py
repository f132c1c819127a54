"""Where your model's error comes from: op by op against a float64 shadow, forward and back.

:func:`diff` runs the model once in the target precision (under autocast, cast whole to a dtype
with its floating inputs, or with its linear layers quantized to a low-bit target by
:mod:`mpguide.models.quantizing`, each quantization an op of its own) inside
:class:`mpguide.models.shadow.Shadow`, which carries a float64 run of the same model beside it,
op by op, and splits each op's error into what the op adds itself (*local*) and what it received
(*inherited*); see :mod:`mpguide.models.shadow` for the definitions and the check that they
bound the total. Each op is placed in the innermost module running it (a backward op in the
module whose forward op made its autograd node, as ``mpguide model`` places it) and at the
reader's line that called it (a backward op at the line of its forward op). A *source* is one
module call's line: the ops that line ran there (autocast's casts included); sources rank by the
sum of their ops' local errors, the error they create. With ``backward=True`` the backward pass
runs and every parameter's gradient is compared with the shadow's. The output gradients are
standard normal from a seeded generator: ones would make a softmax's input gradient zero.

The model's final output is compared too: its first floating tensor (``logits`` where the
output has them), and for a language model's logits (``logprobs=True``, or an output named
``logits``) the log-probability error in nats: the mean over positions of ``|Δ log p|`` of the
token the reference ranks first. :mod:`mpguide.models.fixes` re-runs the worst sources kept in
float32 and reports what that buys.
"""

from __future__ import annotations

import contextlib
import copy
import time
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from mpguide import MPGuideError
from mpguide.core import device as _device
from mpguide.core import dtypes
from mpguide.core.table import Table
from mpguide.models import lowbit_report, memory, per_module, quantizing, recorder
from mpguide.models.recorder import Say
from mpguide.models.shadow import CAST, QUANTIZE, TOLERANCE, OpError, Shadow, bounded, upcast
from mpguide.precision import lowbit_errors
from mpguide.training.autograd import BACKWARD, FORWARD

VIEWS = ("sources", "ops", "modules", "grads")
_PASS = {FORWARD: "fwd", BACKWARD: "bwd", CAST: "cast"}
"""How the tables name a pass: the forward, the backward, or the rounding before the run."""
"""What :meth:`Diff.table` ranks: sources (module and line), ops, module calls, gradients."""


@dataclass(frozen=True)
class ModuleError:
    """One module call: the error its ops create, the error it receives and returns, and its
    output's error split as an op's is (see :mod:`mpguide.models.rerun`): *local*
    ``‖t − b‖ / ‖a‖``, what the call adds itself, and *inherited* ``‖b − a‖ / ‖a‖``, what it
    received, with ``t`` its first floating output, ``a`` the shadow's and ``b`` the same call
    run in the reference dtype on the run's own inputs (``None`` where it could not be re-run:
    :attr:`why` says why)."""

    name: str
    call: int
    kind: str
    depth: int
    created: float
    worst: float
    input: float | None
    output: float | None
    """Its output's error against the shadow: the *total*."""
    ops: int
    local: float | None = None
    inherited: float | None = None
    why: str = ""

    @property
    def label(self) -> str:
        return recorder.label((self.name, self.call))

    @property
    def closes(self) -> bool | None:
        """Whether ``|local − inherited| ≤ total ≤ local + inherited`` holds, within
        :data:`~mpguide.models.shadow.TOLERANCE` (``None`` where an error is unknown)."""
        return bounded(self.local, self.inherited, self.output)


@dataclass(frozen=True)
class Source:
    """One line of the reader's code in one module call, and the ops it ran there."""

    module: str
    line: str
    phase: str
    ops: tuple[OpError, ...]

    @property
    def local(self) -> float:
        """The sum of its ops' local errors: the error it creates."""
        return sum(o.local or 0.0 for o in self.ops)

    @property
    def names(self) -> str:
        """Its ops by name, with counts: ``_to_copy×2, mm``."""
        counts: dict[str, int] = defaultdict(int)
        for o in self.ops:
            if o.phase == CAST:
                base = o.op
            elif o.op.startswith(QUANTIZE):  # its input and its weight: one name
                base = o.op.split(" (")[0]
            else:
                base = o.op.split(" (")[0].split(".")[1]
            counts[base] += 1
        return ", ".join(f"{k}×{n}" if n > 1 else k for k, n in counts.items())


@dataclass(frozen=True)
class GradError:
    """One parameter's gradient against the shadow's."""

    name: str
    dtype: torch.dtype
    error: float | None


@dataclass(frozen=True)
class Output:
    """The model's final output against the reference: the relative error of its first
    floating tensor, and for logits the log-probability error in nats."""

    error: float
    logprob: float | None


@dataclass(frozen=True)
class Diff:
    """Every op of one run with its local, inherited and total error; module calls, sources,
    gradients and the final output's error."""

    model: str
    run: str
    reference: torch.dtype
    ops: tuple[OpError, ...] = field(repr=False)
    modules: tuple[ModuleError, ...] = field(repr=False)
    grads: tuple[GradError, ...] = field(repr=False)
    output: Output
    machine: _device.Machine
    seconds: float
    notes: tuple[str, ...] = ()
    reference_output: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """The reference's final output (the tensor :attr:`output` is measured on)."""

    def sources(self, phase: str = FORWARD) -> list[Source]:
        """Sources of ``phase`` (forward, backward, or cast for what was rounded before the
        run), the one that creates most error first."""
        grouped: dict[tuple[str, str], list[OpError]] = defaultdict(list)
        for o in self.ops:
            if o.phase == phase and o.local is not None:
                grouped[o.source].append(o)
        found = [Source(m, line, phase, tuple(ops)) for (m, line), ops in grouped.items()]
        return sorted(found, key=lambda s: -s.local)

    def ranked(self, phase: str = FORWARD) -> list[OpError]:
        """The ops of ``phase`` with an error, largest local error first."""
        return sorted(
            (o for o in self.ops if o.phase == phase and o.local is not None),
            key=lambda o: -o.local,
        )

    @property
    def closure(self) -> tuple[int, int]:
        """How many ops hold ``|local − inherited| ≤ total ≤ local + inherited`` within
        :data:`~mpguide.models.shadow.TOLERANCE`, of how many with finite errors."""
        checked = [o.closes for o in self.ops if o.closes is not None]
        return sum(checked), len(checked)

    @property
    def module_closure(self) -> tuple[int, int]:
        """:attr:`closure` for the module calls with a local and inherited error."""
        checked = [m.closes for m in self.modules if m.closes is not None]
        return sum(checked), len(checked)

    @property
    def tightness(self) -> float | None:
        """The median of ``total / (local + inherited)`` over the ops with an error: 1 where
        the two add up as vectors do in a line, ``1/√2`` where they are orthogonal."""
        ratios = sorted(
            o.total / (o.local + o.inherited)
            for o in self.ops
            if o.closes and (o.local + o.inherited) > 0
        )
        return ratios[len(ratios) // 2] if ratios else None

    @property
    def caption(self) -> str:
        return (
            f"{self.model} op by op, {self.run}, against a {dtypes.name(self.reference)} "
            f"shadow: {len(self.ops)} ops, {self.machine.caption()}"
        )

    def findings(self) -> list[str]:
        """What the run found, in sentences: the worst source, the final error, the check."""
        out = [f"final output error {self.output.error:.3g} (‖error‖ / ‖ref‖)"]
        if self.output.logprob is not None:
            out[0] += f", log-probability error {self.output.logprob:.3g} nats"
        top = self.sources()
        if top:
            s = top[0]
            out.append(
                f"largest source: {s.module or '(root)'} at {s.line} ({s.names}), local "
                f"error {s.local:.3g}"
            )
        flipped = [o for o in self.ops if o.changed]
        if flipped:
            o = flipped[0]
            out.append(
                f"{len(flipped)} ops returned integers or booleans that differ from the "
                f"shadow's; the first: {o.op.removeprefix('aten.')} in {o.module or '(root)'} "
                f"at {o.line}, {o.changed} of {o.whole} values (top-k indices, masks)"
            )
        held, of = self.closure
        out.append(
            f"|local - inherited| <= total <= local + inherited held for {held} of {of} ops "
            f"(tolerance {TOLERANCE:g} relative)"
            + (
                f"; median total / (local + inherited) {self.tightness:.3g}"
                if self.tightness
                else ""
            )
        )
        held, of = self.module_closure
        unsplit = [m for m in self.modules if m.local is None and m.why]
        if of or unsplit:
            out.append(
                f"for module calls (each re-run in {dtypes.name(self.reference)} on the run's "
                f"inputs) it held for {held} of {of}"
                + (
                    f"; {len(unsplit)} calls not split, the first {unsplit[0].label}: "
                    f"{unsplit[0].why}"
                    if unsplit
                    else ""
                )
            )
        return out

    def table(self, view: str = "sources", limit: int | None = 20) -> Table:
        """One ranking as a table: ``sources`` (module and line, forward then the model's
        rounded parameters, then backward), ``ops``, ``modules`` (module calls by the error
        they create) or ``grads`` (parameters by gradient error); the first ``limit`` rows."""
        if view not in VIEWS:
            raise MPGuideError(f"no view {view!r}; choose one of {', '.join(VIEWS)}")
        columns, rows, legend = getattr(self, "_" + view)()
        shown = rows if limit is None else rows[:limit]
        notes = [*self.findings(), *self.notes, legend]
        if len(shown) < len(rows):
            notes.append(
                f"... {len(rows) - len(shown)} more rows not shown ({len(shown)} of {len(rows)})"
            )
        return Table(columns, tuple(shown), f"{view}: {self.caption}", tuple(notes))

    def _sources(self):
        rows = []
        for phase in (FORWARD, CAST, BACKWARD):
            for s in self.sources(phase):
                last = s.ops[-1]
                rows.append(
                    (
                        _PASS[phase],
                        s.module or "(root)",
                        s.line,
                        s.names,
                        s.local,
                        max(o.local for o in s.ops),
                        last.inherited,
                        last.total,
                    )
                )
        rows.sort(key=lambda r: -r[4])
        return (
            ("#", "pass", "module", "line", "ops", "local", "worst op", "inherited", "total"),
            [(i, *r) for i, r in enumerate(rows, 1)],
            (
                "local: the sum of its ops' local errors (what each adds itself); worst "
                "op: the largest; inherited and total: of its last op's output; errors are "
                "‖error‖ / ‖ref‖ against the shadow"
            ),
        )

    def _ops(self):
        ranked = sorted((o for o in self.ops if o.local is not None), key=lambda o: -o.local)
        return (
            ("op", "pass", "module", "line", "local", "inherited", "total"),
            [
                (
                    o.op.removeprefix("aten."),
                    _PASS[o.phase],
                    recorder.label((o.module, o.call)),
                    o.line,
                    o.local,
                    o.inherited,
                    o.total,
                )
                for o in ranked
            ],
            (
                "local: ‖t - b‖ / ‖a‖, what the op adds itself; inherited: ‖b - a‖ / "
                "‖a‖; total: ‖t - a‖ / ‖a‖ (t: the run's output, a: the shadow's, b: the op in "
                f"{dtypes.name(self.reference)} on the run's inputs)"
            ),
        )

    def _modules(self):
        ranked = sorted(
            self.modules,
            key=lambda m: (m.local is None, -(m.local or 0.0), -m.created),
        )
        return (
            ("module", "type", "ops", "local", "inherited", "total", "in err", "created"),
            [
                (m.label, m.kind, m.ops, m.local, m.inherited, m.output, m.input, m.created)
                for m in ranked
            ],
            (
                "local: ‖t - b‖ / ‖a‖, what the call adds itself; inherited: ‖b - a‖ / ‖a‖; "
                "total: ‖t - a‖ / ‖a‖ (t: its first floating output, a: the shadow's, b: the "
                f"call re-run in {dtypes.name(self.reference)} on the run's inputs; empty where "
                "it could not be re-run); in err: its first floating input against the shadow; "
                "created: the sum of the local errors of the forward ops it ran (its "
                "submodules' too)"
            ),
        )

    def _grads(self):
        ranked = sorted(self.grads, key=lambda g: -(g.error if g.error is not None else -1))
        return (
            ("parameter", "dtype", "grad err"),
            [(g.name, g.dtype, g.error) for g in ranked],
            "grad err: ‖grad - shadow's grad‖ / ‖shadow's grad‖ (standard-normal output gradients drawn from seed 0); "
            + ("" if self.grads else "no gradients: run with backward"),
        )

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def logits_of(out: Any) -> torch.Tensor | None:
    """The output's logits, where it names them (a transformers output, a dict)."""
    found = out.get("logits") if isinstance(out, dict) else getattr(out, "logits", None)
    return found if isinstance(found, torch.Tensor) else None


def final_tensor(out: Any) -> torch.Tensor:
    """The tensor the final error is measured on: the logits, else the first floating one."""
    found = logits_of(out)
    if found is None:
        found = next(
            (t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()),
            None,
        )
    if found is None:
        raise MPGuideError("the model's output holds no floating tensor to compare")
    return found


def output_error(low: torch.Tensor, ref: torch.Tensor, logprobs: bool) -> Output:
    """The final output's error against the reference (see the module's docstring)."""
    with torch.no_grad():
        t, a = upcast(low.detach(), ref.dtype), ref.detach()
        norm = torch.linalg.vector_norm(a).item()
        diff = torch.linalg.vector_norm(t - a).item()
        error = diff / norm if norm else (0.0 if diff == 0 else float("inf"))
        nats = None
        if logprobs:
            lt, la = t.log_softmax(-1), a.log_softmax(-1)
            top = la.argmax(-1, keepdim=True)
            nats = (lt.gather(-1, top) - la.gather(-1, top)).abs().mean().item()
    return Output(error, nats)


NO_TARGET_BACKWARD = (
    "a low-bit target has no backward here: its quantization is emulated, with no gradient of "
    "its own (no straight-through estimator is built)"
)


def prepare(model, inputs, autocast, dtype, device, backward, lowbit=None):
    """What a run needs, checked: ``(on, autocast, dtype, args, kwargs, low_model, low_args,
    low_kwargs)``, ``on`` the device it runs on, the model copied where it must be cast or
    moved. ``lowbit``: a low-bit target, for which the model runs in its own dtype."""
    checked = per_module.precision(model, autocast, dtype)
    if lowbit is not None:
        _check_lowbit(model, lowbit, autocast, dtype, backward)
    autocast, dtype = (None, None) if lowbit is not None else checked
    if dtype is not None and (not dtype.is_floating_point or dtype == torch.float64):
        raise MPGuideError(f"cast to a floating dtype narrower than float64, not {dtype}")
    on = device if isinstance(device, _device.Target) else _device.target(device)
    if on.simulated:
        raise MPGuideError(
            f"diff runs kernels: {on.device.type} is simulated here (no values to compare)"
        )
    args, kwargs = per_module.arguments(inputs)
    copied = dtype is not None or per_module._on_other_device(model, on)
    memory.check(memory.report_needs(model, dtype, copied, backward), on.device)
    low_model = copy.deepcopy(model).to(device=on.device, dtype=dtype) if copied else model
    low_args, low_kwargs = _device.move(per_module._cast_floats((args, kwargs), dtype), on)
    args, kwargs = _device.move((args, kwargs), on)
    return on, autocast, dtype, args, kwargs, low_model, low_args, low_kwargs


def _check_lowbit(model, lowbit, autocast, dtype, backward) -> None:
    lowbit_errors.check_target(lowbit)
    if autocast is not None or dtype is not None:
        raise MPGuideError(
            f"the target {lowbit} runs the model in its own dtype: give no autocast or dtype"
        )
    if backward:
        raise MPGuideError(NO_TARGET_BACKWARD)
    if not any(lowbit_report.quantized(m) for m in model.modules()):
        raise MPGuideError(
            "the model has no linear layer (torch.nn.Linear or transformers' Conv1D): nothing "
            f"to quantize to {lowbit}"
        )


def run_name(autocast, dtype, lowbit=None) -> str:
    """The run's precision in words: ``under autocast to bfloat16``, ``cast to float16``,
    ``linear layers quantized to nvfp4``."""
    if lowbit is not None:
        return f"linear layers quantized to {lowbit}"
    return per_module._run_name(autocast, dtype)


def rounded(model, low_model, inputs, low_inputs) -> list[tuple[str, str, Any, Any]]:
    """The tensors a cast changed: ``(name, module, low, exact)`` for each parameter, buffer
    and floating input whose dtype the cast changed."""
    found = []
    for kind in ("named_parameters", "named_buffers"):
        for (name, low), (_, exact) in zip(
            getattr(low_model, kind)(), getattr(model, kind)(), strict=True
        ):
            if low.dtype != exact.dtype and exact.is_floating_point():
                found.append((name, name.rpartition(".")[0], low, exact))
    for i, (low, exact) in enumerate(
        zip(tree_leaves(low_inputs), tree_leaves(inputs), strict=True)
    ):
        if isinstance(low, torch.Tensor) and low.dtype != exact.dtype:
            found.append((f"input {i}", "", low, exact))
    return found


def diff(
    model: torch.nn.Module,
    inputs: Any,
    *,
    autocast: torch.dtype | str | None = None,
    dtype: torch.dtype | str | None = None,
    target: str | None = None,
    device: _device.Target | torch.device | str | None = None,
    backward: bool = False,
    reference: torch.dtype | str = torch.float64,
    logprobs: bool | None = None,
    seed: int = 0,
    progress: Say | None = None,
) -> Diff:
    """Run ``model`` on ``inputs`` (a tensor, a tuple or list of arguments, or a dict of
    keyword arguments) under ``autocast`` (bfloat16 by default), cast whole to ``dtype``, or
    in its own dtype with every linear layer computing on its input and weight quantized to
    ``target`` (a target of ``mpguide model --target``: a recipe such as ``nvfp4``, or a
    format cast without a scale; forward only), with a ``reference`` shadow (float64; float32
    where an op has no float64 kernel), and report where the error comes from (see the
    module's docstring). ``logprobs``: whether the
    output's last dimension is a vocabulary (default: where the output names ``logits``).
    The model is left as it was: it is copied where it must be cast or moved."""
    reference = dtypes.parse(reference)
    if reference not in (torch.float64, torch.float32):
        raise MPGuideError(f"the reference is float64 or float32, not {reference}")
    on, autocast, dtype, args, kwargs, low_model, low_args, low_kwargs = prepare(
        model, inputs, autocast, dtype, device, backward, target
    )
    run = run_name(autocast, dtype, target)
    shadow = Shadow(low_model, reference, progress and (progress, "run " + run, None))
    shadow.rounded(rounded(model, low_model, (args, kwargs), (low_args, low_kwargs)))
    shadow.split_modules(model, on.device)
    params = [(n, p) for n, p in low_model.named_parameters() if p.requires_grad]
    notes = [] if target is None else _lowbit_notes(model, target)
    quantized = (
        quantizing.layers_quantized(low_model, shadow.quantizer(target))
        if target is not None
        else contextlib.nullcontext()
    )
    start = time.perf_counter()
    with recorder.eval_mode(low_model), shadow.hooked(), quantized:
        with torch.set_grad_enabled(backward), _device.autocast(on, autocast):
            out = low_model(*low_args, **low_kwargs)
        final = final_tensor(out)
        ref_final = shadow.shadow_of(final)
        grads: list[torch.Tensor | None] = []
        if backward:
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs and params:
                gen = torch.Generator(device=on.device).manual_seed(seed)
                seeds = [
                    torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype)
                    for o in outs
                ]
                grads = list(
                    torch.autograd.grad(outs, [p for _, p in params], seeds, allow_unused=True)
                )
            else:
                notes.append("no backward pass: nothing the output depends on requires grad")
    seconds = time.perf_counter() - start
    found = [g for g in grads if g is not None]
    errors = iter(shadow.errors_of(found))
    grad_errors = tuple(
        GradError(n, p.dtype, None if g is None else next(errors))
        for (n, p), g in zip(params, grads, strict=False)
    )
    ops = tuple(shadow.errors())
    if logprobs is None:
        logprobs = logits_of(out) is not None
    if reference != torch.float64:
        notes.append(
            f"the reference is {dtypes.name(reference)}: errors below its rounding are not seen"
        )
    return Diff(
        type(model).__name__,
        run.removeprefix("under "),
        reference,
        ops,
        _module_errors(shadow, ops),
        grad_errors,
        output_error(final, ref_final, logprobs),
        on.describe(),
        seconds,
        tuple(notes),
        ref_final.detach(),
    )


def _lowbit_notes(model: torch.nn.Module, lowbit: str) -> list[str]:
    """What a low-bit run quantized and what it left out."""
    notes = [
        (
            f"quantize {lowbit}: a linear layer's input or weight quantized (emulated, the "
            "values in the model's dtype); its GEMM inherits that error"
        )
    ]
    others = lowbit_report.left_out(model)
    if others:
        notes.append(lowbit_report.left_out_note(others))
    return notes


def _module_errors(shadow: Shadow, ops: tuple[OpError, ...]) -> tuple[ModuleError, ...]:
    """Each module call's created error, from the forward ops within its span."""
    forward = [o for o in ops if o.phase == FORWARD]
    index = [o.index for o in forward]
    found = []
    for s in shadow.seen:
        first, end, into, out, before, why = shadow.spans[s.key]
        inside = forward[bisect_left(index, first) : bisect_left(index, end)]
        local = [o.local for o in inside if o.local is not None]
        split = _split(out)
        found.append(
            ModuleError(
                s.name,
                s.index,
                s.kind,
                s.depth,
                sum(local),
                max(local, default=0.0),
                _split(into)[2],
                split[2],
                len(inside),
                *((None, None) if before is None or why else split[:2]),
                why,
            )
        )
    return tuple(found)


def _split(norms: torch.Tensor | None) -> tuple[float | None, float | None, float | None]:
    """``local, inherited, total`` from :class:`~mpguide.models.shadow._Norms`' four norms."""
    if norms is None:
        return None, None, None
    norm, *errors = norms.tolist()
    if norm:
        return tuple(e / norm for e in errors)
    return tuple(0.0 if e == 0 else float("inf") for e in errors)

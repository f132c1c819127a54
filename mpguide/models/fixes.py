"""What keeping a source of error in float32 buys, and what it costs: an ordered fix list.

:func:`fix_list` takes the ``k`` forward sources of a :class:`mpguide.models.diff.Diff` that
create the most error (a source is a module call's line of the reader's code) and re-runs the
model with the ops of each kept in float32 (:class:`Keep`): their low-precision floating
inputs are upcast to float32 and a narrower floating ``dtype`` argument (autocast's casts) becomes
float32; under autocast the result stays float32, in a model cast whole it is cast back to the
dtype the op returns unkept (found on meta tensors; the model's dtype where that is narrower) so
the next op sees the dtypes it expects,
and the parameters and buffers the op reads (and views of them, ``weight.t()``) are the model's
own, before the cast. An op that writes to its input is left as it is.

In a model cast whole, the ``k`` parameters, buffers and inputs whose rounding before the run
errs most (the diff's sources of phase ``cast``) are tried too. Keeping one in float32 means:
every forward op that reads it, or a view of it, runs kept as above, reading that tensor's value
before the cast (its other inputs upcast as the run has them, other rounded parameters
included), and its result is cast back as above. The tensor is stored once in its float32 value
beside the run's; the ops that read it pay an upcast of their other inputs and a cast back.

Each source is tried alone, then they are applied one after another, the one that
buys most first. For each step: the final output's error against the diff's reference (and the
log-probability error in nats for a language model), the share of the first error removed, and
the cost: the extra casts, the bytes they write, and the run's time against the same run with
nothing kept (both in the same dispatch mode, the median of ``repeat`` runs after
one untimed).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

from mpguide import MPGuideError, error_line
from mpguide.core import device as _device
from mpguide.core import dtypes, timing
from mpguide.core.dtypes import IGNORED_NAMESPACES
from mpguide.core.table import Table
from mpguide.models import attention_reference, quantizing, recorder
from mpguide.models import diff as _diff
from mpguide.models.memory import size_text
from mpguide.models.shadow import QUANTIZE, readers_line


def _narrow(dt: torch.dtype) -> bool:
    """A floating dtype narrower than float32: what a kept op's inputs are upcast from."""
    return dt.is_floating_point and dt.itemsize < 4


class Keep(recorder.Recorder):
    """A run with the ops of some sources (``(module, line)`` pairs) kept in float32; counts
    the floating-point conversions it runs (autocast's, the model's and those keeping adds)
    and the bytes they write."""

    def __init__(
        self,
        model: torch.nn.Module,
        kept: set[tuple[str, str]],
        back: torch.dtype | None,
        exact: WeakTensorKeyDictionary | None = None,
        tensors: WeakTensorKeyDictionary | None = None,
    ):
        super().__init__(model, None, None)
        self.kept, self.back = kept, back
        self.exact = WeakTensorKeyDictionary() if exact is None else exact
        self.tensors = WeakTensorKeyDictionary() if tensors is None else tensors
        """The rounded tensors kept (parameters, buffers, inputs), each with its exact value:
        an op that reads one (or a view of one) is kept, reading that one exact."""
        self.casts = 0
        self.bytes = 0

    def _wrote(self, out: torch.Tensor) -> None:
        self.casts += 1
        self.bytes += out.numel() * out.element_size()

    def _up(self, v: Any, exact: WeakTensorKeyDictionary) -> Any:
        if isinstance(v, torch.Tensor) and _narrow(v.dtype):
            found = exact.get(v)
            if found is None:
                found = self.tensors.get(v)
            v = v.float() if found is None else found.float()
            self._wrote(v)
        elif isinstance(v, torch.dtype) and _narrow(v):
            return torch.float32
        return v

    def _view(self, func, args: tuple, kwargs: dict) -> Any:
        """A view of a rounded tensor, and the same view of its exact value beside it (a kept
        op reads ``weight.t()``, not ``weight``)."""
        out = func(*args, **kwargs)
        for exact in (self.exact, self.tensors):
            found = exact.get(args[0])
            if found is not None and isinstance(out, torch.Tensor):
                exact[out] = func(found, *args[1:], **kwargs)
        return out

    def _down(self, v: Any, dtype: Any) -> Any:
        """``v`` in the dtype the op returns unkept, or the model's where that is narrower
        (an op that casts to a narrower format is what is kept)."""
        if not isinstance(dtype, torch.dtype) or self.back is None:
            return v
        if dtype.is_floating_point and dtype.itemsize < self.back.itemsize:
            dtype = self.back
        if isinstance(v, torch.Tensor) and v.dtype != dtype:
            v = v.to(dtype)
            self._wrote(v)
        return v

    def quantizer(self, target: str, kept: set[tuple[str, str]]) -> quantizing.Quantize:
        """A low-bit run's quantization (:mod:`mpguide.models.quantizing`), but for the layers
        of the ``kept`` sources: each quantized tensor counted as a conversion that writes its
        values at the target's bits per value."""

        def quantize(layer: str, what: str, x: torch.Tensor, transposed: bool) -> torch.Tensor:
            if (layer, readers_line(self.entry)) in kept:
                return x
            with self._aside(), torch.no_grad():
                q, bits = quantizing.values(x, target, transposed)
            self.casts += 1
            self.bytes += round(q.numel() * bits / 8)
            return q

        return quantize

    def _expected(self, func, args: tuple, kwargs: dict) -> Any:
        """The dtypes ``func`` returns on these arguments, from its meta kernel; where it has
        none, the model's dtype for every floating output."""
        meta = tree_map(_on_meta, (args, kwargs))
        try:
            return tree_map(_dtype, func(*meta[0], **meta[1]))
        except (RuntimeError, NotImplementedError):
            return self.back

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused or func.namespace in IGNORED_NAMESPACES:
            return func(*args, **kwargs)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func.is_view and first is not None and (first in self.exact or first in self.tensors):
            return self._view(func, args, kwargs)
        forward = not func._schema.is_mutable and torch._C._current_autograd_node() is None
        keep = (
            forward
            and self.kept
            and ((self.stack[-1].name if self.stack else ""), readers_line(self.entry)) in self.kept
        )
        exact = self.exact
        if forward and not keep and self.tensors:
            keep = any(isinstance(v, torch.Tensor) and v in self.tensors for v in tree_leaves(args))
            exact = self.tensors
        expected = None
        given = args, kwargs
        if keep:
            if self.back is not None:  # the dtypes the op returns unkept, for the next op
                expected = self._expected(func, args, kwargs)
            args, kwargs = tree_map(lambda v: self._up(v, exact), (args, kwargs))
        out = _in_float32(func, args, kwargs, given) if keep else func(*args, **kwargs)
        i = dtypes.source_index(str(func))
        if i is not None and isinstance(out, torch.Tensor) and len(args) > i:
            src = args[i]
            if src.dtype != out.dtype and src.is_floating_point() and out.is_floating_point():
                self._wrote(out)
        if expected is None:
            return out
        if isinstance(expected, torch.dtype):
            return tree_map(lambda v: self._down(v, expected if _floating(v) else None), out)
        return tree_map(self._down, out, expected)


def _in_float32(func, args: tuple, kwargs: dict, given: tuple[tuple, dict]) -> Any:
    """A kept op on its upcast arguments; a fused attention kernel that has no float32 kernel
    (flash attention on a GPU) is computed from its definition
    (:mod:`mpguide.models.attention_reference`), its other outputs from the kernel run on the
    arguments as ``given``."""
    try:
        return attention_reference.kernel(func, args, kwargs)
    except (RuntimeError, NotImplementedError) as err:
        if attention_reference.compared(func) is None:
            raise
        ran = func(*given[0], **given[1])
        flat, spec = tree_flatten(ran)
        tensors = [v for v in flat if isinstance(v, torch.Tensor)]
        found = attention_reference.reference(func, args, kwargs, tensors)
        if found is None:
            raise MPGuideError(
                f"{str(func).removesuffix('.default')} cannot be kept in float32 here "
                f"({error_line(err)})"
            ) from None
        results = iter(found)
        return tree_unflatten(
            [next(results) if isinstance(v, torch.Tensor) else v for v in flat], spec
        )


_KEPT_TENSOR = "\0tensor"
"""The module part of a kept rounded tensor's key: ``(_KEPT_TENSOR, name)``."""


def _key(s: _diff.Source) -> tuple[str, str]:
    """What ``run`` keeps for a source: its module call's line, or a rounded tensor's name."""
    return (_KEPT_TENSOR, s.line) if s.phase == _diff.CAST else (s.module, s.line)


def _kind(name: str, model: torch.nn.Module) -> str:
    """What a rounded tensor of the run is: a parameter, a buffer or an input."""
    if name in dict(model.named_parameters()):
        return "parameter"
    return "buffer" if name in dict(model.named_buffers()) else "input"


def _on_meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.to("meta")
    return torch.device("meta") if isinstance(v, torch.device) else v


def _floating(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _dtype(v: Any) -> Any:
    return v.dtype if isinstance(v, torch.Tensor) else None


@dataclass(frozen=True)
class Step:
    """One source kept in float32, with those before it in the list."""

    module: str
    line: str
    ops: str
    alone: float
    error: float
    logprob: float | None
    casts: int
    bytes: int
    slowdown: float


@dataclass(frozen=True)
class FixList:
    """The sources to keep in float32, in order, with what each buys and costs."""

    model: str
    run: str
    error: float
    logprob: float | None
    steps: tuple[Step, ...] = field(default=())
    notes: tuple[str, ...] = ()

    def _measure(self, error: float, logprob: float | None) -> float:
        return error if self.logprob is None else logprob

    def drop(self, i: int) -> float:
        """The share of the first error (the log-probability error for a language model)
        that step ``i`` removes, after the steps before it."""
        first = self._measure(self.error, self.logprob)
        prev = self.steps[i - 1] if i else None
        before = first if prev is None else self._measure(prev.error, prev.logprob)
        after = self._measure(self.steps[i].error, self.steps[i].logprob)
        return (before - after) / first if first else 0.0

    def sentence(self) -> str:
        """``keep a.b (model.py:12) in float32: -83 % of the error; then ...``."""
        parts = [
            f"{'keep' if i == 0 else 'then'} {s.module or '(root)'} ({s.line}): "
            f"{-100 * self.drop(i):+.0f} %"
            for i, s in enumerate(self.steps)
        ]
        what = "log-probability error" if self.logprob is not None else "output error"
        return f"in float32, of the {what}: " + "; ".join(parts) if parts else "nothing to fix"

    def table(self) -> Table:
        unit = "logprob nats" if self.logprob is not None else None
        columns = ["#", "keep in float32", "line", "ops", "error", "drop", "alone"]
        if unit:
            columns.insert(5, unit)
        columns += ["casts +", "bytes +", "time ×"]
        rows = []
        for i, s in enumerate(self.steps):
            row = [
                i + 1,
                s.module or "(root)",
                s.line,
                s.ops,
                s.error,
                f"{100 * self.drop(i):.1f} %",
                f"{100 * s.alone:.1f} %",
            ]
            if unit:
                row.insert(5, s.logprob)
            written = ("-" if s.bytes < 0 else "") + size_text(abs(s.bytes))
            rows.append((*row, s.casts, written, f"{s.slowdown:.2f}"))
        before = f"before: output error {self.error:.4g}"
        if self.logprob is not None:
            before += f", log-probability error {self.logprob:.4g} nats"
        notes = (
            before,
            self.sentence(),
            *self.notes,
            (
                "error: the final output's ‖error‖ / ‖ref‖ with this and every earlier row kept; "
                "drop: the share of the first error this row removes; alone: with only this row "
                "kept; casts +, bytes +: the floating-point conversions it adds to the run (fewer where "
                "keeping drops autocast's casts) and the bytes they write; time ×: "
                "the run's time against the same run with nothing kept"
            ),
        )
        return Table(tuple(columns), tuple(rows), f"fix list: {self.model}, {self.run}", notes)

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def fix_list(
    model: torch.nn.Module,
    inputs: Any,
    found: _diff.Diff,
    k: int = 3,
    *,
    sources: tuple[tuple[str, str], ...] = (),
    autocast: torch.dtype | str | None = None,
    dtype: torch.dtype | str | None = None,
    target: str | None = None,
    device: _device.Target | torch.device | str | None = None,
    repeat: int = 3,
    progress: recorder.Say | None = None,
) -> FixList:
    """The fix list of the ``k`` worst forward sources of ``found`` (a diff of the same model,
    inputs and precision), of its ``k`` worst tensors rounded before the run (a model cast
    whole), and of the ``sources`` named (``(module, line)`` pairs, as
    :class:`mpguide.models.diff.Source` names them, a rounded tensor's line its name); see the
    module's docstring. With a low-bit ``target``, the sources are the quantized layers' calls,
    and a kept one runs unquantized."""
    on, autocast, dtype, xargs, xkwargs, low_model, args, kwargs = _diff.prepare(
        model, inputs, autocast, dtype, device, False, target
    )
    logprobs = found.output.logprob is not None
    exact = WeakTensorKeyDictionary()
    rounded = {}  # each rounded tensor by name: the run's and its exact value
    for name, _, low, original in _diff.rounded(model, low_model, (xargs, xkwargs), (args, kwargs)):
        if not name.startswith("input "):  # a kept op reads the model's own parameters
            exact[low] = original.detach()
        rounded[name] = (low, original.detach())
    sync = timing.synchronizer(on.device)

    def run(kept: set[tuple[str, str]]) -> tuple[_diff.Output, int, int, float]:
        tensors = WeakTensorKeyDictionary()
        for name in (line for module, line in kept if module == _KEPT_TENSOR):
            low, original = rounded[name]
            tensors[low] = original
        keep = Keep(low_model, set() if target else kept, dtype, exact, tensors)
        quantize = keep.quantizer(target, kept) if target else None
        times = []
        for _ in range(max(repeat, 1) + 1):  # the first run warms up, untimed
            keep.casts = keep.bytes = 0
            sync()
            start = time.perf_counter()
            with (
                recorder.eval_mode(low_model),
                keep.hooked(),
                quantizing.layers_quantized(low_model, quantize)
                if quantize
                else contextlib.nullcontext(),
                torch.no_grad(),
                _device.autocast(on, autocast),
            ):
                out = low_model(*args, **kwargs)
            sync()
            times.append(time.perf_counter() - start)
        times = times[1:]
        final = _diff.output_error(_diff.final_tensor(out), found.reference_output, logprobs)
        return final, keep.casts, keep.bytes, statistics.median(times)

    base, base_casts, base_bytes, base_time = run(set())
    first = base.logprob if logprobs else base.error
    every = found.sources()
    if target:
        every = [s for s in every if any(o.op.startswith(QUANTIZE) for o in s.ops)]
    cast = [s for s in found.sources(_diff.CAST) if s.line in rounded]
    candidates = [s for s in every if s.local > 0][:k] + [s for s in cast if s.local > 0][:k]
    for where in sources:
        named = [s for s in every + cast if (s.module, s.line) == tuple(where)]
        if not named:
            raise MPGuideError(
                f"no {'quantized layer' if target else 'forward or cast source'} "
                f"{where[0] or '(root)'} at {where[1]} in the diff"
            )
        if named[0] not in candidates:
            candidates.append(named[0])
    alone = {}
    for s in candidates:
        out = run({_key(s)})[0]
        after = out.logprob if logprobs else out.error
        alone[_key(s)] = (first - after) / first if first else 0.0
    if progress is not None:
        progress(f"fix list: {len(candidates)} sources tried alone")
    order = sorted(candidates, key=lambda s: -alone[_key(s)])
    steps, kept = [], set()
    for s in order:
        kept.add(_key(s))
        out, casts, size, seconds = run(set(kept))
        rounded_tensor = s.phase == _diff.CAST
        steps.append(
            Step(
                s.line if rounded_tensor else s.module,
                "cast " + s.names if rounded_tensor else s.line,
                _kind(s.line, low_model) if rounded_tensor else s.names,
                alone[_key(s)],
                out.error,
                out.logprob,
                casts - base_casts,
                size - base_bytes,
                seconds / base_time,
            )
        )
    notes = [
        "errors against the diff's float64 shadow; times of this run, noisy on a shared machine"
    ]
    if target:
        notes.append(
            f"kept: the layer's input and weight not quantized to {target}, its GEMM in the "
            "model's dtype; casts +, bytes +: the quantizations it no longer runs, each "
            "counted as a conversion writing its values at the target's bits; time ×: of "
            "this emulation"
        )
    if found.sources(_diff.CAST):
        notes.append(
            "a kept op reads the parameters and buffers as they were before the cast to the "
            "model's dtype; a kept parameter, buffer or input (cast ...): the ops that read it "
            "run in float32 on its value before the cast, their results cast back"
        )
    return FixList(found.model, found.run, base.error, base.logprob, tuple(steps), tuple(notes))

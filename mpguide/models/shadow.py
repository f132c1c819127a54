"""A float64 shadow carried op by op beside a low-precision run, and each op's error split.

:class:`Shadow` is a dispatch mode (a :class:`mpguide.models.recorder.Recorder`, so module
calls, ops and casts are counted as ``mpguide model`` counts them). For every aten op of the
run in the target precision it also runs the op in the reference dtype (float64) twice:

- (a) on the shadow's own inputs: the values of the same model run in float64 throughout,
  carried tensor by tensor, so (a) is the exact reference;
- (b) on the run's own inputs, upcast: what the op would return if it did not round.

With ``t`` the op's output in the run and norms the Euclidean norm over every floating output
value, the errors are relative to the reference's norm ``‖a‖``:

- *local* ``‖t − b‖ / ‖a‖``: what this op adds itself, its rounding of the exact result on
  the inputs it was given;
- *inherited* ``‖b − a‖ / ‖a‖``: what it received from its inputs, carried through it;
- *total* ``‖t − a‖ / ‖a‖``.

Since ``t − a = (t − b) + (b − a)``, the triangle inequality bounds the total on both sides:
``|local − inherited| ≤ total ≤ local + inherited``; :data:`TOLERANCE` is the float64 rounding
allowed in the check. Where every input of an op is exactly the shadow's (parameters under
autocast, the model's inputs, views of them), (b) is (a) and is not run again; where the op is
a cast to a dtype that holds every value of its input (bf16 to float32), (b) is ``t`` itself:
its local error is 0, and (b) is not run either.

Views (``t``, ``view``, ``expand``) compute nothing and are not recorded: the shadow carries
them. Ops whose result is random (dropout's mask, ``randn``) give the shadow the run's own
values; attention and dropout asked for no dropout are not random. Integers and booleans an op
returns (top-k indices, masks) are counted where they differ from the shadow's.

After :meth:`Shadow.split_modules`, each forward module call's first floating output is split
the same way, one level up: its (b) is the call run again in the reference dtype on the run's
own inputs (:mod:`mpguide.models.rerun`); where every input of the call is the shadow's, (b) is
(a), and where the call ran no op and returned (a view of) its input, (b) is ``t``. A fused
attention kernel that the reference dtype has no kernel for (flash attention on a GPU) is
computed from its definition (:mod:`mpguide.models.attention_reference`); any other such op ends
the run with one line naming it (:class:`NoReferenceKernel`). Under a low-bit target, a linear
layer's input or weight quantized is an op of its own (:meth:`Shadow.quantizer`).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

from mpguide import MPGuideError, error_line
from mpguide.core import dtypes
from mpguide.core.dtypes import IGNORED_NAMESPACES
from mpguide.models import attention_reference, quantizing
from mpguide.models.recorder import Recorder, Say
from mpguide.models.rerun import Rerun, first_floating
from mpguide.training.autograd import BACKWARD, FORWARD

TOLERANCE = 1e-9
"""Relative slack of the check ``total ≤ local + inherited`` (float64 rounding of the norms)."""

CAST = "cast"
"""The phase of the model's parameters, buffers and inputs rounded before the run
(``--pure``): each is a source of error with no op of its own."""

QUANTIZE = "quantize "
"""How a layer's input or weight quantized to a low-bit target is named (``quantize nvfp4
(weight)``): emulation, recorded as one op of its own."""

_EMPTY = ("aten.empty", "aten.new_empty", "aten.empty_like", "aten.empty_strided")
"""Ops that return memory unwritten: no error of their own."""


class NoReferenceKernel(MPGuideError):
    """An op of the model that the reference dtype cannot run."""


@dataclass(frozen=True)
class OpError:
    """One op of the run, where it ran, and its error against the shadow."""

    index: int
    op: str
    phase: str
    module: str
    call: int
    line: str
    local: float | None
    inherited: float | None
    total: float | None
    values: int
    """How many floating values its errors are over (0: it returned none)."""
    changed: int | None = None
    """How many of the integers or booleans it returned (top-k indices, a mask) differ from
    the shadow's, of :attr:`whole` (``None`` where its inputs were the shadow's)."""
    whole: int = 0

    @property
    def source(self) -> tuple[str, str]:
        """Where a reader fixes it: the module and the line of the reader's code."""
        return self.module, self.line

    @property
    def closes(self) -> bool | None:
        """Whether ``|local − inherited| ≤ total ≤ local + inherited`` holds, within
        :data:`TOLERANCE` (``None`` where an error is unknown or not finite)."""
        return bounded(self.local, self.inherited, self.total)


def bounded(local: float | None, inherited: float | None, total: float | None) -> bool | None:
    """Whether ``|local − inherited| ≤ total ≤ local + inherited`` holds, within
    :data:`TOLERANCE` (``None`` where an error is unknown or not finite)."""
    if any(x is None or not math.isfinite(x) for x in (local, inherited, total)):
        return None
    slack = TOLERANCE * (local + inherited) + 1e-300
    return abs(local - inherited) - slack <= total <= local + inherited + slack


def upcast(t: Any, ref: torch.dtype) -> Any:
    """A floating tensor in ``ref`` (a complex one in ``ref``'s complex dtype); anything else
    as it is."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point():
        return t.to(ref)
    if t.is_complex():
        return t.to(torch.complex128 if ref == torch.float64 else torch.complex64)
    return t


def _ref_dtype(v: Any, ref: torch.dtype) -> Any:
    if isinstance(v, torch.dtype) and v.is_floating_point and v != ref:
        return ref
    return v


_INTERNAL = ("torch", "mpguide")
_internal: dict[Any, bool] = {}


def _is_internal(code) -> bool:
    found = _internal.get(code)
    if found is None:
        parts = Path(code.co_filename).parts
        found = _internal[code] = any(
            p in _INTERNAL for p in parts[-4:-1]
        ) or code.co_filename.startswith("<frozen")
    return found


def readers_line(stop: Any = None) -> str:
    """``file.py:LINE`` of the innermost frame outside torch and mpguide: the reader's line.
    ``unknown`` where there is none below ``stop``, the frame that called the model
    (:attr:`Recorder.entry`): a model of torch's modules alone (``nn.Sequential``) has no line
    of the reader's, and the code that called the tool is not one."""
    f = sys._getframe(1)
    while f is not None and f is not stop and _is_internal(f.f_code):
        f = f.f_back
    if f is None or f is stop:
        return "unknown"
    return f"{Path(f.f_code.co_filename).name}:{f.f_lineno}"


class Shadow(Recorder):
    """The run in the target precision with its float64 shadow, op by op (see the module's
    docstring). ``rounded``: tensors of the run (parameters, buffers, inputs cast before it)
    with their exact values and a name, each recorded as a source of error of its own."""

    def __init__(
        self,
        model: torch.nn.Module,
        reference: torch.dtype = torch.float64,
        progress: tuple[Say, str, int | None] | None = None,
    ):
        super().__init__(model, None, None, progress)
        self.reference = reference
        self.shadows: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self._pending: list[tuple[int, str, str, str, int, str, Any, int]] = []
        self._lines: dict[int, str] = {}
        self._index = 0
        self._norms = _Norms(reference)
        self.spans: dict[tuple[str, int], list] = {}
        """Each module call: its first op's index, the index after its last, the norms of its
        first floating input, the norms of its output (with its (b) where :attr:`rerun` gave
        one), what re-running it needs unchanged, and why it got no (b) (empty where it did)."""
        self.rerun: Rerun | None = None
        self._entered: dict[tuple[str, int], tuple[tuple, dict]] = {}
        self._random = 0

    def shadow_of(self, t: torch.Tensor) -> torch.Tensor:
        """The shadow's value of a tensor of the run (its upcast where the run made it
        outside the shadow's sight: then it is exact)."""
        return self._of(t)[0]

    def _of(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        found = self.shadows.get(t)
        if found is None:
            up = upcast(t, self.reference)
            found = (up.clone() if up is t and t.is_floating_point() else up, True)
            self.shadows[t] = found
        return found

    def errors_of(self, tensors: list[torch.Tensor]) -> list[float]:
        """``‖t − a‖ / ‖a‖`` of each tensor of the run against its shadow's value."""
        if not tensors:
            return []
        with torch.no_grad():
            shadows = [self._of(t)[0] for t in tensors]
            norms = [self._norms(t.detach(), a, a) for t, a in zip(tensors, shadows, strict=True)]
            rows = torch.stack(norms).cpu().tolist()
        return [_relative(row[0], row[3])[0] for row in rows]

    def rounded(self, pairs: list[tuple[str, str, torch.Tensor, torch.Tensor]]) -> None:
        """Tensors of the run rounded before it: ``(name, module, low, exact)`` each."""
        with torch.no_grad():
            for name, module, low, exact in pairs:
                ref = upcast(exact.detach(), self.reference)
                self.shadows[low] = (ref, False)
                stats = torch.cat([self._norms(low.detach(), ref, ref), ref.new_zeros(2)])
                to = "to " + str(low.dtype).removeprefix("torch.")
                self._add(CAST, module, 0, name, to, stats, low.numel())

    def split_modules(self, model: torch.nn.Module, device: torch.device) -> None:
        """Split each forward module call's error too, with (b) from a copy of ``model`` (the
        model as the reader gave it) in the reference dtype (:class:`Rerun`), whose parameters
        and buffers become the shadow's values of the run's."""
        self.rerun = Rerun(model, self.reference, device)
        for kind in ("named_parameters", "named_buffers"):
            copies = dict(getattr(self.rerun.copy, kind)())
            for name, low in getattr(self.model, kind)():
                ref = copies.get(name)
                if ref is None or not ref.is_floating_point() or ref.shape != low.shape:
                    continue
                found = self.shadows.get(low)
                self.shadows[low] = (ref, True if found is None else found[1])

    def quantizer(self, target: str) -> quantizing.Quantize:
        """Quantizing a linear layer's input or weight to ``target``
        (:func:`mpguide.models.quantizing.layers_quantized`): emulation, not the model's ops, so
        computed aside and recorded as one op, ``quantize TARGET (input)`` or ``(weight)``, in
        the layer's call at the reader's line. With ``x`` the run's tensor, ``q`` its quantized
        values and ``a`` the shadow's: local ``‖q − x‖ / ‖a‖`` (what quantizing adds),
        inherited ``‖x − a‖ / ‖a‖``, total ``‖q − a‖ / ‖a‖``. ``q``'s shadow is ``x``'s, the
        exact value: the GEMM that follows inherits the quantization's error."""

        def quantize(layer: str, what: str, x: torch.Tensor, transposed: bool) -> torch.Tensor:
            with self._aside(), torch.no_grad():
                q = quantizing.values(x, target, transposed)[0]
                a, exact = self._of(x)
                b = a if exact else upcast(x.detach(), self.reference)
                stats = self._norms(q, b, a)
                phase, module, call, line, _ = self._where()
                self.shadows[q] = (a, False)
                self._add(
                    phase,
                    module,
                    call,
                    line,
                    f"{QUANTIZE}{target} ({what})",
                    torch.cat([stats, stats.new_zeros(2)]),
                    q.numel(),
                )
            return q

        return quantize

    def _pre(self, module, args, kwargs, name) -> None:
        super()._pre(module, args, kwargs, name)
        with self._aside():
            seen = self.stack[-1]
            why, before = "", None
            if self.rerun is not None and torch._C._current_autograd_node() is not None:
                why = "called in the backward pass (a recompute)"
            elif self.rerun is not None:
                before = (self.rerun.state(module, args, kwargs), self._random)
                # the call as entered: later pre-hooks may replace its arguments (a quantized
                # layer's input); it is checked and re-run on these, kept until it returns
                self._entered[seen.key] = (args, kwargs)
            self.spans[seen.key] = [
                self._index,
                None,
                self._value((args, kwargs)),
                None,
                before,
                why,
            ]

    def _post(self, module, args, kwargs, output) -> None:
        key = self.stack[-1].key
        with self._aside():
            span = self.spans[key]
            span[1] = self._index
            if span[4] is None:
                span[3] = self._value(output)
            else:
                args, kwargs = self._entered.pop(key)
                span[3], span[5] = self._split(module, key[0], args, kwargs, output, span)
        super()._post(module, args, kwargs, output)

    def _split(self, module, name, args, kwargs, output, span) -> tuple[Any, str]:
        """A module call's norms with its (b), and why there is none where there is not (its
        norms then as :meth:`_value` gives them)."""
        state, random = span[4]
        if self._random != random:
            return self._value(output), "it drew random numbers (a re-run draws others)"
        if self.rerun.state(module, args, kwargs) != state:
            return self._value(output), "its forward changed its inputs or its own state"
        t = first_floating(output)
        if t is None or not t.numel():
            return None, "it returned no floating tensor"
        with torch.no_grad():
            a, t = self._of(t)[0], t.detach()
            if t.shape != a.shape:
                return None, "its output's shadow has another shape"
            tensors = [v for v in tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
            if span[0] == span[1] and any(
                v.is_floating_point()
                and t.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
                for v in tensors
            ):  # no op ran: it returned (a view of) its input, exactly
                b = None
            elif all(self._of(v)[1] for v in tensors):  # fed exact inputs: (b) is (a)
                b = a
            else:
                b, why = self.rerun.output(name, args, kwargs)
                if b is None:
                    return self._value(output), why
                if b.shape != a.shape:
                    return self._value(output), "its re-run returned another shape"
            if t.element_size() == 1:
                t = upcast(t, self.reference)
            return self._norms(t, b, a), ""

    def _value(self, value: Any) -> Any:
        """The error of the first floating tensor of ``value``: ``‖a‖, 0, 0, ‖t − a‖``."""
        first = first_floating(value)
        if first is None or not first.numel():
            return None
        with torch.no_grad():
            a = self._of(first)[0]
            return self._norms(first.detach(), a, a) if first.shape == a.shape else None

    def _add(self, phase, module, call, line, op, stats, values) -> None:
        """Record one op: ``stats`` as :class:`_Norms` gives them, then how many integer or
        boolean values differ and of how many; ``values`` the floating values compared."""
        self._pending.append((self._index, op, phase, module, call, line, stats, values))
        self._index += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused or func.namespace in IGNORED_NAMESPACES:
            return func(*args, **kwargs)
        before = None
        if func._schema.is_mutable:  # the run's inputs upcast before the op writes to them
            with torch.no_grad():
                before = [_fresh(v, self.reference) for v in tree_leaves((args, kwargs))]
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        with torch.no_grad():
            self._shadow(func, args, kwargs, out, before)
        return out

    def _where(self) -> tuple[str, str, int, str, str]:
        """The phase, module, call and reader's line of the op running now, and its autograd
        node's name in the backward pass (the line is its forward op's)."""
        node = torch._C._current_autograd_node()
        if node is None:
            seen = self.stack[-1] if self.stack else None
            line, node_name = readers_line(self.entry), ""
            self._lines.setdefault(torch._C._autograd._get_sequence_nr() - 1, line)
            phase = FORWARD
        else:
            nr = node._sequence_nr()
            seen = self._owner(nr)
            line = self._lines.get(nr, "unknown")
            node_name = node.name()
            phase = BACKWARD
        if seen is None:
            return phase, "", 0, line, node_name
        return phase, seen.name, seen.index, line, node_name

    def _shadow(self, func, args: tuple, kwargs: dict, out: Any, before: list | None) -> None:
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs:
            return
        ref = self.reference
        name = str(func)
        if _draws(func, args, kwargs):
            self._random += 1
            for t in outs:
                self.shadows[t] = (upcast(t, ref), True)
            return
        flat, spec = tree_flatten((args, kwargs))
        mutable = func._schema.is_mutable
        a_flat, exact = [], True
        for v in flat:
            if isinstance(v, torch.Tensor):
                s, e = self._of(v)
                if mutable and s is v:  # shared with the run (an integer tensor): not twice
                    s = v.clone()
                    self.shadows[v] = (s, e)
                a_flat.append(s)
                exact = exact and e
            else:
                a_flat.append(_ref_dtype(v, ref))
        a_args, a_kwargs = tree_unflatten(a_flat, spec)
        a_outs = _in_reference(func, a_args, a_kwargs, outs, ref)
        if len(a_outs) != len(outs):
            return
        for t, s in zip(outs, a_outs, strict=True):
            self.shadows[t] = (s, exact and func.is_view)
        if func.is_view or name.startswith(_EMPTY):
            return  # a view computes nothing, unwritten memory has no error
        pairs = list(zip(outs, a_outs, strict=True))
        kept = attention_reference.compared(func)  # a fused attention kernel's result only
        compared = [
            i for i, t in enumerate(outs) if t.is_floating_point() and (kept is None or i in kept)
        ]
        floating = [pairs[i] for i in compared]
        whole = [(t, s) for t, s in pairs if not t.is_floating_point() and t.shape == s.shape]
        phase, module, call, line, node = self._where()
        op = name.removesuffix(".default") + (f" ({node})" if node else "")
        counted = torch.zeros(2, dtype=torch.float64, device=outs[0].device)
        if whole and not exact:  # integers or booleans: how many differ, of how many
            changed = sum((t != s).sum() for t, s in whole)
            counted = torch.stack(
                [changed.double(), counted.new_tensor(sum(t.numel() for t, _ in whole))]
            )
        if not floating:
            if whole and not exact:
                self._add(
                    phase, module, call, line, op, torch.cat([counted.new_zeros(4), counted]), 0
                )
            return
        t = _cat([t if t.element_size() > 1 else upcast(t, ref) for t, _ in floating])
        a = _cat([s for _, s in floating])
        if t.shape != a.shape:
            return
        if exact:
            b = a
        elif _widens(func, flat, floating):
            b = None
        else:
            b_flat = (
                before
                if mutable
                else [
                    upcast(v, ref) if isinstance(v, torch.Tensor) else _ref_dtype(v, ref)
                    for v in flat
                ]
            )
            b_args, b_kwargs = tree_unflatten(b_flat, spec)
            b_outs = _in_reference(func, b_args, b_kwargs, outs, ref)
            b = _cat([b_outs[i] for i in compared])
        self._add(
            phase, module, call, line, op, torch.cat([self._norms(t, b, a), counted]), t.numel()
        )

    def errors(self) -> list[OpError]:
        """Every op recorded, with its errors (one transfer from the device for all)."""
        if not self._pending:
            return []
        rows = torch.stack([p[6].double().cpu() for p in self._pending]).tolist()
        out = []
        for (index, op, phase, module, call, line, _, n), row in zip(
            self._pending, rows, strict=True
        ):
            errors = _relative(*row[:4]) if n else (None, None, None)
            changed = int(row[4]) if row[5] else None
            out.append(
                OpError(index, op, phase, module, call, line, *errors, n, changed, int(row[5]))
            )
        return out


def _draws(func, args: tuple, kwargs: dict) -> bool:
    """Whether the op draws random numbers: a seeded op (dropout, ``randn``, attention with
    dropout) unless asked for none (``dropout_p`` or ``p`` 0, ``train`` false), as attention in
    eval mode is."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    given = dtypes.arguments(func, args, kwargs)
    return not (
        any(given.get(name, 1) == 0 for name in ("dropout_p", "p"))
        or ("train" in given and not given["train"])
    )


def _in_reference(
    func, args: tuple, kwargs: dict, outs: list[torch.Tensor], ref: torch.dtype
) -> list:
    """The tensor outputs of ``func`` on ``args`` in the reference dtype: its own kernel, else
    for a fused attention kernel its definition (:mod:`mpguide.models.attention_reference`)."""
    try:
        found = attention_reference.kernel(func, args, kwargs)
    except (RuntimeError, NotImplementedError, TypeError) as err:
        found = attention_reference.reference(func, args, kwargs, outs)
        if found is None:
            raise NoReferenceKernel(
                f"{str(func).removesuffix('.default')} has no "
                f"{str(ref).removeprefix('torch.')} kernel on {outs[0].device.type} here "
                f"({error_line(err)}); --reference float32 compares against float32 instead"
            ) from None
        return found
    return [t for t in tree_leaves(found) if isinstance(t, torch.Tensor)]


def _fresh(v: Any, ref: torch.dtype) -> Any:
    """An argument for the op on the run's inputs upcast, never the run's own tensor (the op
    may write to it)."""
    if not isinstance(v, torch.Tensor):
        return _ref_dtype(v, ref)
    up = upcast(v, ref)
    return up.clone() if up is v else up


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    """One tensor as it is (a copy of a strided view costs its size), several flattened."""
    return ts[0] if len(ts) == 1 else torch.cat([t.reshape(-1) for t in ts])


def holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Whether every value of floating dtype ``narrow`` is one of ``wide``'s (bf16 in float32,
    fp16 in float32, float8 in bf16), its subnormals included."""
    w, n = torch.finfo(wide), torch.finfo(narrow)
    return (
        w.eps <= n.eps
        and w.max >= n.max
        and w.smallest_normal * w.eps <= (n.smallest_normal * n.eps)
    )


def _widens(func, flat: list, floating: list) -> bool:
    """Whether the op is a cast of one floating tensor to a dtype that holds its every value:
    it computes its result exactly, so its local error is 0 and (b) need not run."""
    if func is not torch.ops.aten._to_copy.default or len(floating) != 1:
        return False
    src = flat[0]
    dst = floating[0][0].dtype
    return isinstance(src, torch.Tensor) and src.is_floating_point() and holds(dst, src.dtype)


class _Norms:
    """``‖a‖, ‖t − b‖, ‖b − a‖, ‖t − a‖`` as one tensor in the reference's dtype (read once,
    after the run). ``t``, the run's own, is upcast once into a scratch buffer and each
    difference is written into another: both are kept at the size of the largest output seen,
    so an op's norms allocate nothing. (A fresh float64 temporary per difference cost 4× as much
    on the CPU, mostly in page faults; torch also promotes no float8 dtype in a subtraction.)
    Where the exact result holds infinities (a mask's ``-inf``), ``‖a‖`` is over its finite
    values and two equal values, infinities included, differ by nothing: the run computing the
    same ``-inf`` has no error there, and one computing a finite value has an infinite one."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._up = self._diff = None

    def __call__(self, t: torch.Tensor, b: torch.Tensor | None, a: torch.Tensor) -> torch.Tensor:
        """``b`` is ``None`` where the op computed ``t`` exactly from its inputs: ``t = b``."""
        n = a.numel()
        if self._up is None or self._up.numel() < n or self._up.device != a.device:
            self._up = torch.empty(n, dtype=self.dtype, device=a.device)
            self._diff = torch.empty_like(self._up)
        up, flat = self._up[:n].view(a.shape), self._diff[:n]
        diff = flat.view(a.shape)
        up.copy_(t)
        squares = a.new_zeros(4, dtype=self.dtype)

        whole = a.reshape(-1)
        torch.dot(whole, whole, out=squares[0])
        infinite = not bool(torch.isfinite(squares[0]))  # one read of the device per op
        if infinite:  # the exact result holds ±inf or NaN (a mask's -inf)
            whole = torch.where(torch.isfinite(whole), whole, 0)
            torch.dot(whole, whole, out=squares[0])

        def distance(x: torch.Tensor, y: torch.Tensor, i: int) -> None:
            torch.sub(x, y, out=diff)
            if infinite:  # equal infinities are no error (inf - inf is NaN)
                diff.masked_fill_(x == y, 0)
            torch.dot(flat, flat, out=squares[i])

        if b is None:
            distance(up, a, 2)
            squares[3] = squares[2]
        elif b is a:
            distance(up, a, 1)
            squares[3] = squares[1]
        else:
            distance(up, b, 1)
            distance(b, a, 2)
            distance(up, a, 3)
        return squares.sqrt_()


def _relative(norm: float, *errors: float) -> tuple[float, ...]:
    if norm > 0:
        return tuple(e / norm for e in errors)
    return tuple(0.0 if e == 0 else float("inf") for e in errors)

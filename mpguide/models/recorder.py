"""One recorded run of a model: its module calls in call order, with their dtypes, ops and
casts, forward and backward (see :mod:`mpguide.models.per_module`)."""

from __future__ import annotations

import sys
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _python_dispatch
from torch.utils._pytree import tree_leaves

from mpguide.compiled import graphs
from mpguide.core import device as _device
from mpguide.core import dtypes
from mpguide.training.autograd import BACKWARD, FORWARD

Key = tuple[str, int]
"""A module call: the module's qualified name and which of its calls (0 for the first)."""


def label(key: Key) -> str:
    name, index = key
    return (name or "(root)") + (f", call {index + 1}" if index else "")


def floats(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def dtypes_of(value: Any) -> tuple[torch.dtype, ...]:
    return tuple(dict.fromkeys(t.dtype for t in tree_leaves(value) if isinstance(t, torch.Tensor)))


@dataclass
class Seen:
    """A module call while a run records it."""

    name: str
    index: int
    kind: str
    depth: int
    inputs: tuple[torch.dtype, ...]
    outputs: tuple[torch.dtype, ...] = ()
    finished: int = 0
    ops: Counter = field(default_factory=Counter)
    casts: dict[str, Counter] = field(
        default_factory=lambda: {FORWARD: Counter(), BACKWARD: Counter()}
    )

    @property
    def key(self) -> Key:
        return self.name, self.index


Hook = Callable[[Seen, Any], None]
Say = Callable[[str], None]
"""Where a run says how far it is (:class:`mpguide.models.progress.Progress`)."""


class Recorder(dtypes.Log):
    """One run of a model: its module calls in call order, each with its dtypes and, per
    phase, its ops and conversions; ``on_input`` and ``on_output`` see each call's arguments
    and output."""

    def __init__(
        self,
        model: torch.nn.Module,
        on_input: Hook | None,
        on_output: Hook | None,
        progress: tuple[Say, str, int | None] | None = None,
    ):
        super().__init__()
        self.model, self.on_input, self.on_output = model, on_input, on_output
        self.progress = progress
        self.seen: list[Seen] = []
        self.stack: list[Seen] = []
        self.entry: Any = None
        """The frame that called the model, while the model runs (:func:`caller`)."""
        self._calls: Counter[str] = Counter()
        self._finished = 0
        self._paused = False
        # Autograd numbers its nodes as the forward makes them: where each number range began,
        # and the module call innermost then.
        self._starts: list[int] = []
        self._owners: list[Seen | None] = []

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if self._paused:
            return
        super().record(func, args, kwargs, out)
        node = torch._C._current_autograd_node()
        if node is None:
            phase, owner = FORWARD, self.stack[-1] if self.stack else None
        else:
            phase, owner = BACKWARD, self._owner(node._sequence_nr())
        if owner is not None:
            owner.ops[phase] += 1
            pair = self.calls[-1].cast
            if pair is not None:
                owner.casts[phase][pair] += 1

    def _owner(self, sequence_nr: int) -> Seen | None:
        i = bisect_right(self._starts, sequence_nr) - 1
        return self._owners[i] if i >= 0 else None

    def _mark(self) -> None:
        self._starts.append(torch._C._autograd._get_sequence_nr())
        self._owners.append(self.stack[-1] if self.stack else None)

    @contextmanager
    def _aside(self) -> Iterator[None]:
        """The hooks' own ops kept out of the log: run below it where it is the innermost
        dispatch mode, so they do not pay a trip through Python each (modes below it, a
        simulation's fake tensors, stay on); else run through it, paused."""
        if _python_dispatch._get_current_dispatch_mode() is self:
            with _python_dispatch._pop_mode_temporarily():
                yield
            return
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict, name: str) -> None:
        if not self.stack:
            self.entry = caller(sys._getframe())
        with self._aside():
            seen = Seen(
                name,
                self._calls[name],
                type(module).__name__,
                len(self.stack),
                dtypes_of((args, kwargs)),
            )
            self._calls[name] += 1
            self.seen.append(seen)
            self.stack.append(seen)
            self._mark()
            if self.on_input is not None:
                self.on_input(seen, (args, kwargs))

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        with self._aside():
            seen = self.stack.pop()
            if not self.stack:
                self.entry = None
            self._mark()
            seen.outputs = dtypes_of(output)
            self._finished += 1
            seen.finished = self._finished
            if self.on_output is not None:
                self.on_output(seen, output)
            if self.progress is not None:
                say, stage, total = self.progress
                of = f" of {total}" if total else ""
                say(f"{stage}: module call {self._finished}{of} done ({label(seen.key)})")

    @contextmanager
    def hooked(self) -> Iterator[Recorder]:
        """Hooks on every module of the model and this log active, inside the block."""
        handles = []
        try:
            for name, module in self.model.named_modules():
                handles.append(
                    module.register_forward_pre_hook(
                        lambda m, a, k, name=name: self._pre(m, a, k, name), with_kwargs=True
                    )
                )
                handles.append(module.register_forward_hook(self._post, with_kwargs=True))
            with self:
                yield self
        finally:
            for h in handles:
                h.remove()

    def by_key(self) -> dict[Key, Seen]:
        return {s.key: s for s in self.seen}


_MODULE_FILE = torch.nn.modules.module.__file__


def caller(frame: Any) -> Any:
    """The frame that called the module whose hook runs in ``frame``: the first one beyond
    torch's module-call frames."""
    while frame is not None and frame.f_code.co_filename != _MODULE_FILE:
        frame = frame.f_back
    while frame is not None and frame.f_code.co_filename == _MODULE_FILE:
        frame = frame.f_back
    return frame


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Every module of ``model`` in eval mode inside the block, each restored after."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for m, training in modes:
            m.training = training


def run(
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    target: _device.Target,
    autocast: torch.dtype | None,
    backward: bool,
    on_input: Hook | None = None,
    on_output: Hook | None = None,
    progress: tuple[Say, str, int | None] | None = None,
) -> tuple[Recorder, bool]:
    """Run ``model`` once, recorded; returns the record and whether a backward pass ran."""
    recorder = Recorder(model, on_input, on_output, progress)
    ran_backward = False
    with eval_mode(model), recorder.hooked():
        with torch.set_grad_enabled(backward), _device.autocast(target, autocast):
            out = model(*args, **kwargs)
        if backward:
            ran_backward = graphs.backward_once(out)
    return recorder, ran_backward

"""The float64 reference against the low-precision run, module call by module call: the
values the run keeps (:class:`Kept`) and the reference run's hooks that compare them
(:class:`Compare`)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from mpguide.models.recorder import Key, Seen, floats
from mpguide.precision import numerics


class Kept:
    """The low-precision run's values kept for the reference run: each call's output and
    first floating input (an input that is an earlier output, unchanged, is kept once)."""

    def __init__(self):
        self.outputs: dict[Key, list[torch.Tensor]] = {}
        self.inputs: dict[Key, torch.Tensor] = {}
        self._kept: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        seen = self._kept.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return seen[2]
        copy_ = t.detach().clone()
        self._kept[id(t)] = (weakref.ref(t), t._version, copy_)
        return copy_

    def on_input(self, seen: Seen, value: Any) -> None:
        first = floats(value)[:1]
        if first:
            self.inputs[seen.key] = self._keep(first[0])

    def on_output(self, seen: Seen, value: Any) -> None:
        self.outputs[seen.key] = [self._keep(t) for t in floats(value)]

    def close(self) -> None:
        """The run is over: each kept value is held only until it is compared."""
        self._kept.clear()


@dataclass
class Numbers:
    input_error: numerics.ErrorStats | None = None
    input_nonfinite: int | None = None
    error: numerics.ErrorStats | None = None
    inf: int | None = None
    nan: int | None = None
    to_zero: int | None = None
    beyond_range: int | None = None


def _flat(low: list[torch.Tensor], ref: list[torch.Tensor]):
    """Both lists of tensors flattened into one float64 vector each; ``None`` where they do
    not pair up (a different number or shapes of tensors) or hold no value."""
    if [t.shape for t in low] != [t.shape for t in ref] or not sum(t.numel() for t in low):
        return None

    def one(ts: list[torch.Tensor]) -> torch.Tensor:
        flat = [t.detach().reshape(-1).double() for t in ts]
        return flat[0] if len(flat) == 1 else torch.cat(flat)

    return one(low), one(ref)


def _mismatched_nonfinite(low: torch.Tensor, ref: torch.Tensor) -> tuple[int, int]:
    """How many infinities and NaNs ``low`` holds where ``ref`` is finite."""
    bad = ~torch.isfinite(low)
    if not bad.any():
        return 0, 0
    bad &= torch.isfinite(ref)
    return int((bad & torch.isinf(low)).sum()), int((bad & torch.isnan(low)).sum())


class Compare:
    """The reference run's hooks: each call's input and output against the kept values. A
    pair of tensors already compared (a module's input that is an earlier call's output, or
    an output its parent returns as its own) is not compared again."""

    def __init__(self, kept: Kept, largest: float, tiny: float):
        self.kept, self.largest, self.tiny = kept, largest, tiny
        self.numbers: dict[Key, Numbers] = {}
        self._done: dict[tuple[int, int], tuple[weakref.ref, weakref.ref, int, Numbers]] = {}

    def _compared(self, low: list[torch.Tensor], ref: list[torch.Tensor]) -> Numbers | None:
        """The output numbers of ``low`` against ``ref``, computed once per pair of single
        tensors (``ref`` unchanged since); ``None`` where they do not pair up."""
        one = len(low) == len(ref) == 1
        if one:
            done = self._done.get((id(low[0]), id(ref[0])))
            if done and done[0]() is low[0] and done[1]() is ref[0] and done[2] == ref[0]._version:
                return done[3]
        pair = _flat(low, ref)
        if pair is None:
            return None
        a, r = pair
        n = Numbers(error=numerics.errors(a, r))
        n.inf, n.nan = _mismatched_nonfinite(a, r)
        # Each count over a mask of the few values it can hold: most outputs have none.
        zero = a == 0
        if zero.any():
            r0 = r[zero].abs()
            n.to_zero = int(((r0 != 0) & (r0 < self.tiny)).sum())
        else:
            n.to_zero = 0
        magnitude = r.abs()
        n.beyond_range = (
            int((torch.isfinite(r) & (magnitude > self.largest)).sum())
            if magnitude.max() > self.largest
            else 0
        )
        if one:
            key = (id(low[0]), id(ref[0]))
            self._done[key] = (weakref.ref(low[0]), weakref.ref(ref[0]), ref[0]._version, n)
        return n

    def on_input(self, seen: Seen, value: Any) -> None:
        low = self.kept.inputs.pop(seen.key, None)
        out = self._compared([low], floats(value)[:1]) if low is not None else None
        if out is not None:
            n = self.numbers.setdefault(seen.key, Numbers())
            n.input_error, n.input_nonfinite = out.error, out.inf + out.nan

    def on_output(self, seen: Seen, value: Any) -> None:
        out = self._compared(self.kept.outputs.pop(seen.key, []), floats(value))
        if out is not None:
            n = self.numbers.setdefault(seen.key, Numbers())
            n.error, n.inf, n.nan = out.error, out.inf, out.nan
            n.to_zero, n.beyond_range = out.to_zero, out.beyond_range

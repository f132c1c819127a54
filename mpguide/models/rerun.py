"""A module call run again in the reference dtype on the run's own inputs: a module's (b).

:class:`mpguide.models.shadow.Shadow` splits each op's error with (b), the op run in float64 on
the run's own inputs. :class:`Rerun` gives a module call's (b): the call run again, after it
returned, by the same module of one float64 copy of the model (made once, before the run, from
the model as the reader gave it: under ``--pure`` its exact parameters, not the rounded ones),
on the run's inputs of that call upcast, without grad, autocast off, and every floating dtype an
op is asked for (``.float()``, a softmax in float32) read as the reference, as the shadow reads
it. The copy's parameters and buffers are the shadow's own (one float64 copy, not two).

A call gets no (b), with the reason, where re-running it would not be the call that ran: its
forward changed its inputs or its own state (an in-place write to an input or a buffer, a
cache or counter it reassigns), drew random numbers, ran in the backward pass (a recompute), or
took an argument that is neither a tensor nor a plain value (a cache object it could change).
"""

from __future__ import annotations

import copy
from contextlib import ExitStack
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from mpguide import error_line

_PLAIN = (torch.Tensor, int, float, bool, str, type(None), torch.dtype, torch.device, slice)
"""What a call's arguments may hold for it to be re-run: tensors and values nothing changes."""


def upcast(v: Any, ref: torch.dtype) -> Any:
    """A floating tensor in ``ref``, any other tensor copied (the re-run may write to it)."""
    if not isinstance(v, torch.Tensor):
        return v
    if v.is_floating_point():
        return v.detach().to(ref)
    return v.detach().clone()


def first_floating(value: Any) -> torch.Tensor | None:
    """The first floating tensor of ``value`` (a module's output), if any."""
    return next(
        (t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()),
        None,
    )


class _Reference(TorchDispatchMode):
    """Every floating dtype an op is asked for read as the reference, as the shadow reads it
    (so ``x.float()`` in the reader's code does not round a float64 re-run to float32)."""

    def __init__(self, ref: torch.dtype):
        super().__init__()
        self.ref = ref

    def _dtype(self, v: Any) -> Any:
        if isinstance(v, torch.dtype) and v.is_floating_point and v != self.ref:
            return self.ref
        return v

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        args, kwargs = tree_map(self._dtype, (args, kwargs or {}))
        return func(*args, **kwargs)


class Rerun:
    """One copy of ``model`` in ``reference`` on ``device``; :meth:`output` runs one of its
    modules, by name, on a call's inputs."""

    def __init__(self, model: torch.nn.Module, reference: torch.dtype, device: torch.device):
        self.reference = reference
        # Each floating parameter and buffer straight into the reference dtype (a deep copy
        # first would copy it in its own dtype once more); ties stay tied.
        memo: dict[int, Any] = {}
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point() and id(t) not in memo:
                up = t.detach().to(device=device, dtype=reference, copy=True)
                memo[id(t)] = (
                    torch.nn.Parameter(up, False) if isinstance(t, torch.nn.Parameter) else up
                )
        self.copy = copy.deepcopy(model, memo).to(device=device).eval()
        self.copy.requires_grad_(False)
        self.modules = dict(self.copy.named_modules())

    @staticmethod
    def state(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        """What re-running the call needs unchanged: each tensor of its arguments, and each
        parameter, buffer and tensor attribute of the module and its submodules, by identity
        and version (an in-place write bumps the version, a reassignment the identity)."""
        found = []
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                found.append((id(t), t._version))
        for m in module.modules():
            for t in (*m._parameters.values(), *m._buffers.values(), *vars(m).values()):
                if isinstance(t, torch.Tensor):
                    found.append((id(t), t._version))
        return tuple(found)

    def output(self, name: str, args: tuple, kwargs: dict) -> tuple[Any, str]:
        """The first floating output of module ``name`` of the copy on ``args`` and ``kwargs``
        upcast, or ``None`` and why it was not run."""
        module = self.modules.get(name)
        if module is None:
            return None, "no module of that name in the reference copy"
        flat, spec = tree_flatten((args, kwargs))
        odd = next((v for v in flat if not isinstance(v, _PLAIN)), None)
        if odd is not None:
            return None, f"an argument of type {type(odd).__name__} the re-run could change"
        up_args, up_kwargs = tree_unflatten([upcast(v, self.reference) for v in flat], spec)
        devices = {t.device.type for t in flat if isinstance(t, torch.Tensor)} or {"cpu"}
        try:
            with ExitStack() as stack:
                for dev in devices:
                    stack.enter_context(torch.autocast(dev, enabled=False))
                stack.enter_context(torch.no_grad())
                stack.enter_context(_Reference(self.reference))
                out = module(*up_args, **up_kwargs)
        except Exception as err:  # noqa: BLE001 -- the reader's forward: any failure is a reason
            return None, f"its re-run failed ({error_line(err)})"
        found = first_floating(out)
        if found is None:
            return None, "its re-run returned no floating tensor"
        return found, ""

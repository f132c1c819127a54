"""A model's linear layers computing on their quantized inputs and weights, during a run.

:func:`layers_quantized` hooks every layer that ``mpguide model --target`` quantizes
(:func:`mpguide.models.lowbit_report.quantized`: :class:`torch.nn.Linear` and transformers'
``Conv1D``): before each call, the layer's input and weight are replaced by what a
:data:`Quantize` returns for them (the bias is left as it is); the weight is put back after the
call, and at the end of the block whatever happened. :func:`values` is the quantization that
``model --target`` measures, along the GEMM's inner dimension: the last of the input and of a
Linear's ``(out, in)`` weight, the first of a ``Conv1D``'s ``(in, out)`` one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.utils import parametrize

from mpguide import MPGuideError
from mpguide.models.lowbit_report import quantized
from mpguide.precision import lowbit_errors

Quantize = Callable[[str, str, torch.Tensor, bool], torch.Tensor]
"""``(layer, what, tensor, transposed)`` to the tensor the layer computes on instead: ``what``
is ``input`` or ``weight``, ``transposed`` where the GEMM's inner dimension is the tensor's
first (a ``Conv1D``'s weight)."""


def values(x: torch.Tensor, target: str, transposed: bool = False) -> tuple[torch.Tensor, float]:
    """``x`` quantized under ``target`` (dequantized, in ``x``'s dtype) and the bits per value
    the target stores it in."""
    x = x.detach()
    q = lowbit_errors.quantize(x.t() if transposed else x, target)
    return (q.values.t() if transposed else q.values).to(x.dtype), q.bits_per_value


@contextmanager
def layers_quantized(model: nn.Module, quantize: Quantize) -> Iterator[None]:
    """Inside the block, each call of a linear layer of ``model`` computes on
    ``quantize(name, "input", input, False)`` and ``quantize(name, "weight", weight,
    transposed)``. Register it
    after a recorder's hooks, so that the recorder has entered the layer's call first."""
    handles = []
    swapped: dict[nn.Module, list[torch.Tensor]] = {}

    def quantized_in(name: str, what: str, x: torch.Tensor, transposed: bool) -> torch.Tensor:
        try:
            return quantize(name, what, x, transposed)
        except MPGuideError as err:  # a block that does not divide the layer's dimension
            raise MPGuideError(f"{name}: {err}") from None

    def before(name: str):
        def hook(module, args, kwargs):
            if args and torch.is_tensor(args[0]):
                args = (quantized_in(name, "input", args[0], False), *args[1:])
            else:
                key = next((k for k in ("input", "x") if torch.is_tensor(kwargs.get(k))), None)
                if key is None:
                    raise MPGuideError(f"{name}: called without a tensor input to quantize")
                kwargs = {**kwargs, key: quantized_in(name, "input", kwargs[key], False)}
            if "weight" in module._parameters:  # a parametrized weight is quantized as it is made
                weight = module._parameters["weight"]
                swapped.setdefault(module, []).append(weight)
                module._parameters["weight"] = quantized_in(
                    name, "weight", weight, _transposed(module)
                )
            return args, kwargs

        return hook

    def after(module, args, kwargs, output):
        if swapped.get(module):
            module._parameters["weight"] = swapped[module].pop()

    def made(name: str, layer: nn.Module):
        def hook(module, args, output):
            return quantized_in(name, "weight", output, _transposed(layer))

        return hook

    try:
        for name, module in model.named_modules():
            if not quantized(module):
                continue
            handles.append(module.register_forward_pre_hook(before(name), with_kwargs=True))
            # first of the layer's forward hooks: a recorder's, which checks the layer's state
            # after the call, sees its own weight back
            handles.append(module.register_forward_hook(after, with_kwargs=True, prepend=True))
            if parametrize.is_parametrized(module, "weight"):
                making = module.parametrizations["weight"]
                handles.append(making.register_forward_hook(made(name, module)))
            elif "weight" not in module._parameters:
                raise MPGuideError(
                    f"{name}: its weight is neither a parameter nor parametrized: not quantized"
                )
        yield
    finally:
        for h in handles:
            h.remove()
        for module, weights in swapped.items():
            if weights:
                module._parameters["weight"] = weights[0]


def _transposed(module: nn.Module) -> bool:
    """A ``Conv1D``'s weight is ``(in, out)``: its inner dimension is its first."""
    return not isinstance(module, nn.Linear)

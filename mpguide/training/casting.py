"""The ways torch casts a module's parameters to another dtype, and what each does to the
parameter's identity, its gradient and the backward pass.

:func:`convert` casts a fresh ``Linear`` one of the :data:`METHODS` ways and reports;
:func:`conversions` tabulates every way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mpguide import MPGuideError
from mpguide.core import device as _device
from mpguide.core import dtypes, state
from mpguide.core.table import Table
from mpguide.training.autograd import BACKWARD, DtypeLog, grad_graph

METHODS = {
    "construct": "Linear(..., dtype=dtype)",
    "to": "module.to(dtype)",
    "data": "p.data = p.data.to(dtype)",
    "overwrite": ".to(dtype) + overwrite flag",
    "swap": ".to(dtype) + swap flag",
}


@dataclass(frozen=True)
class Conversion:
    """What one way of casting a ``Linear`` does to its weight, its gradient and backward.

    ``graph_before`` says whether the forward (and so the autograd graph) was recorded before
    the cast. ``grad`` is the dtype of the module's weight's gradient after backward, ``None``
    when it got none; ``old_grad`` that of the weight object the module had before the cast.
    ``recorded`` is the dtype the weight's ``AccumulateGrad`` node recorded.
    """

    method: str
    graph_before: bool
    same_object: bool
    dtype: torch.dtype
    recorded: torch.dtype
    grad: torch.dtype | None
    old_grad: torch.dtype | None
    backward_casts: int
    error: str = ""

    def row(self) -> tuple[Any, ...]:
        return (
            METHODS[self.method],
            self.same_object,
            self.dtype,
            self.recorded,
            self.grad or "none",
            self.old_grad or "none",
            "raised" if self.error else f"{self.backward_casts} casts",
        )


def _cast(lin: torch.nn.Linear, method: str, dtype: torch.dtype) -> None:
    with state.preserved():
        if method == "data":
            for p in lin.parameters():
                p.data = p.data.to(dtype)
            return
        if method == "overwrite":
            torch.__future__.set_overwrite_module_params_on_conversion(True)
        elif method == "swap":
            torch.__future__.set_swap_module_params_on_conversion(True)
        lin.to(dtype)


def _recorded_weight_dtype(loss: torch.Tensor, lin: torch.nn.Linear) -> torch.dtype:
    return grad_graph(loss, {"weight": lin.weight}).param("weight").grad_in[0].dtype


def convert(
    method: str,
    dtype: torch.dtype | str = torch.bfloat16,
    dev: torch.device | str | None = None,
    graph_before: bool = False,
) -> Conversion:
    """Cast a fresh ``nn.Linear(8, 8)`` one of the :data:`METHODS` ways, run backward, report.

    The overwrite and swap flags are ``torch.__future__``'s
    ``set_overwrite_module_params_on_conversion`` and ``set_swap_module_params_on_conversion``;
    they are set for the cast only and restored after it, even when it raises.
    """
    if method not in METHODS:
        raise MPGuideError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    dtype = dtypes.parse(dtype)
    dev = _device.pick() if dev is None else _device.resolve(str(dev))
    gen = torch.Generator(device=dev).manual_seed(0)
    made_in = dtype if method == "construct" else torch.float32
    lin = torch.nn.Linear(8, 8, device=dev, dtype=made_in)
    before = lin.weight
    x = torch.randn(4, 8, device=dev, generator=gen)
    if graph_before:
        loss = lin(x.to(made_in)).sum()
        recorded = _recorded_weight_dtype(loss, lin)
    if method != "construct":
        _cast(lin, method, dtype)
    if not graph_before:
        loss = lin(x.to(dtype)).sum()
        recorded = _recorded_weight_dtype(loss, lin)
    error = ""
    with DtypeLog(lin) as log:
        try:
            loss.backward()
        except RuntimeError as err:
            error = str(err).strip().split(".")[0]
    return Conversion(
        method,
        graph_before,
        lin.weight is before,
        lin.weight.dtype,
        recorded,
        lin.weight.grad.dtype if lin.weight.grad is not None else None,
        before.grad.dtype if before.grad is not None else None,
        len(log.select(BACKWARD, casts=True)),
        error,
    )


def conversions(
    dtype: torch.dtype | str = torch.bfloat16,
    dev: torch.device | str | None = None,
    graph_before: bool = False,
) -> Table:
    """:func:`convert` for every method (``construct`` only without ``graph_before``)."""
    methods = [m for m in METHODS if not (graph_before and m == "construct")]
    results = [convert(m, dtype, dev, graph_before) for m in methods]
    when = "forward before the cast" if graph_before else "forward after the cast"
    return Table(
        (
            "method",
            "same object",
            "dtype",
            "recorded",
            "weight.grad",
            "old weight.grad",
            "backward",
        ),
        tuple(r.row() for r in results),
        f"casting nn.Linear to {dtypes.name(dtypes.parse(dtype))}, {when}, "
        f"torch {torch.__version__}",
        tuple(f"{METHODS[r.method]}: backward raised: {r.error}" for r in results if r.error),
    )

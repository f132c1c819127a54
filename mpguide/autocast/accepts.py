"""What ``torch.autocast(device, dtype=...)`` itself does before any op runs: the Python-level
checks of :class:`torch.autocast` (which dtypes a device accepts, what it warns, what it falls
back to), per device type and dtype.

On this machine's devices the checks run as a reader's call runs them (live). For a device the
machine lacks, the same constructor runs with the device's availability queries answering as
on a machine that has it (``torch.cuda`` available, with bf16): simulated. The op-level rules
are :mod:`mpguide.autocast.policy`'s.
"""

from __future__ import annotations

import warnings
from contextlib import ExitStack
from dataclasses import dataclass
from unittest import mock

import torch

from mpguide import error_line
from mpguide.core import device as _device
from mpguide.core.table import Table

DTYPES = (None, torch.bfloat16, torch.float16, torch.float32, torch.float64)
"""The ``dtype=`` arguments tried; ``None`` is the device's default."""


@dataclass(frozen=True)
class Check:
    """One ``torch.autocast(device, dtype=dtype)``: whether it stays enabled, the dtype it would
    cast to, the first line of its warning, or the error it raised."""

    device: str
    dtype: torch.dtype | None
    enabled: bool
    casts_to: torch.dtype | None
    warning: str = ""
    error: str = ""
    how: str = _device.LIVE
    on: str = "this machine"

    @property
    def outcome(self) -> str:
        if self.error:
            return "raises"
        return "accepted" if self.enabled else "autocast disabled"


def _present_as_on_hardware(dev_type: str, bf16: bool) -> ExitStack:
    """Availability queries of ``dev_type`` answering as on a machine that has it (CUDA: a GPU
    with or without bf16)."""
    stack = ExitStack()
    if dev_type == "cuda":
        stack.enter_context(
            mock.patch("torch.cuda.amp.common.amp_definitely_not_available", return_value=False)
        )
        stack.enter_context(mock.patch("torch.cuda.is_bf16_supported", return_value=bf16))
    return stack


def check(
    dev_type: str, dtype: torch.dtype | None, simulate: bool | None = None, bf16: bool = True
) -> Check:
    """Construct ``torch.autocast(dev_type, dtype=dtype)`` (it is not entered) and keep what
    its checks did: simulated (as on a machine with the device; for CUDA, a GPU with bf16 or,
    ``bf16=False``, without) where this machine lacks ``dev_type`` or ``simulate`` is true."""
    simulated = not _device.present(dev_type) if simulate is None else simulate
    how = _device.SIMULATED if simulated else _device.LIVE
    on = "this machine"
    if simulated:
        on = f"a GPU {'with' if bf16 else 'without'} bf16" if dev_type == "cuda" else "the device"
    with ExitStack() as stack, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if simulated:
            stack.enter_context(_present_as_on_hardware(dev_type, bf16))
        try:
            ac = torch.autocast(dev_type, dtype=dtype)
        except Exception as err:  # noqa: BLE001 - a refusal is the finding
            return Check(dev_type, dtype, False, None, error=error_line(err), how=how, on=on)
    warning = str(caught[0].message).splitlines()[0] if caught else ""
    casts_to = ac.fast_dtype if ac._enabled else None
    return Check(dev_type, dtype, ac._enabled, casts_to, warning, how=how, on=on)


def checks(devices: tuple[str, ...] | None = None) -> tuple[Check, ...]:
    """:func:`check` for every device type this build's autocast knows and every dtype of
    :data:`DTYPES`."""
    devices = _device.simulated_types() if devices is None else devices
    return tuple(check(d, dt) for d in devices for dt in DTYPES)


def table(found: tuple[Check, ...]) -> Table:
    """One row per device and ``dtype=``: the outcome, the dtype autocast casts to, the
    warning or error, and how it was obtained."""

    def name(dt: torch.dtype | None) -> str:
        return "-" if dt is None else str(dt).removeprefix("torch.")

    return Table(
        ("device", "on", "dtype=", "outcome", "casts to", "warning or error", "obtained"),
        tuple(
            (
                c.device,
                c.on,
                "(default)" if c.dtype is None else name(c.dtype),
                c.outcome,
                name(c.casts_to),
                c.error or c.warning,
                "simulated" if c.how == _device.SIMULATED else "live",
            )
            for c in found
        ),
        f"torch.autocast's own checks, torch {torch.__version__}; simulated: the device's "
        "availability queries answer as on a machine that has it",
    )

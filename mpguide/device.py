"""Pick the device, resolve the names readers type, and describe the machine for captions."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

from mpguide import MPGuideError

_DTYPES = {
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_DEVICE_TYPES = ("cpu", "cuda")


def pick() -> torch.device:
    """The device examples run on: CUDA when present, else CPU; ``MPGUIDE_DEVICE`` overrides."""
    forced = os.environ.get("MPGUIDE_DEVICE")
    if forced:
        return resolve(forced)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve(name: str) -> torch.device:
    """Turn a device name into a ``torch.device`` this machine has, or raise ``MPGuideError``."""
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise MPGuideError(
            f"unknown device {name!r}; choose one of {', '.join(_DEVICE_TYPES)}"
        ) from None
    if dev.type not in _DEVICE_TYPES:
        raise MPGuideError(f"unknown device {name!r}; choose one of {', '.join(_DEVICE_TYPES)}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise MPGuideError(
                f"device {name!r} is not available: torch {torch.__version__} sees no CUDA GPU"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise MPGuideError(
                f"device {name!r} is not available: this machine has "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
    return dev


def dtype(name: str | torch.dtype) -> torch.dtype:
    """Turn a dtype name (``bfloat16``, ``bf16``, ``torch.float16``, ...) into a ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    key = name.lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise MPGuideError(
            f"unknown dtype {name!r}; choose one of "
            f"{', '.join(sorted(set(_DTYPES) - {'float', 'double', 'half'}))}"
        )
    return _DTYPES[key]


def dtype_name(dt: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``'bfloat16'``."""
    return str(dt).removeprefix("torch.")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class Machine:
    """The device and torch build a result was measured on."""

    device: str
    name: str
    torch: str
    detail: str

    def caption(self) -> str:
        return f"torch {self.torch} on {self.device} ({self.name})"

    def __repr__(self) -> str:
        return f"{self.caption()}\n{self.detail}"

    def _repr_html_(self) -> str:
        from html import escape

        return (
            f"<p><strong>{escape(self.caption())}</strong><br>"
            f"<small>{escape(self.detail)}</small></p>"
        )


def describe(dev: torch.device | str | None = None) -> Machine:
    """Describe ``dev`` (default: :func:`pick`) and the torch build, for captions."""
    dev = pick() if dev is None else torch.device(dev)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name = props.name
        detail = (
            f"compute capability {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"
        )
    else:
        name = _cpu_name()
        detail = (
            f"{torch.get_num_threads()} threads, {platform.machine()}, "
            f"{'no CUDA build' if torch.version.cuda is None else f'CUDA {torch.version.cuda} build'}"
        )
    return Machine(
        device=dev.type,
        name=name,
        torch=torch.__version__,
        detail=f"{detail}, Python {platform.python_version()}",
    )

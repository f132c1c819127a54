"""The global torch state that examples change: take a snapshot, restore it, reset it.

Switches covered: the ``fp32_precision`` tree of ``torch.backends`` (which the legacy TF32
flags and ``set_float32_matmul_precision`` write through to), the reduced-precision reduction
flags, the ``torch.__future__`` module-conversion flags, the default dtype, deterministic
algorithms, and inductor's configuration.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# Parents before children: setting a parent may rewrite its children.
PRECISION_SWITCHES = (
    "fp32_precision",
    "cuda.matmul.fp32_precision",
    "cudnn.fp32_precision",
    "cudnn.conv.fp32_precision",
    "cudnn.rnn.fp32_precision",
    "mkldnn.fp32_precision",
    "mkldnn.matmul.fp32_precision",
    "mkldnn.conv.fp32_precision",
    "mkldnn.rnn.fp32_precision",
)
LEGACY_SWITCHES = ("cuda.matmul.allow_tf32", "cudnn.allow_tf32")
# Set by the legacy calls and kept beside the tree; torch reads it back only when it agrees.
MIXED = "mixed legacy and new API"
REDUCTION_SWITCHES = (
    "cuda.matmul.allow_bf16_reduced_precision_reduction",
    "cuda.matmul.allow_fp16_reduced_precision_reduction",
)


def _split(path: str) -> tuple[Any, str]:
    obj: Any = torch.backends
    *parents, leaf = path.split(".")
    for p in parents:
        obj = getattr(obj, p)
    return obj, leaf


def get(path: str) -> Any:
    """Read a switch under ``torch.backends`` by dotted path, e.g. ``cuda.matmul.fp32_precision``."""
    obj, leaf = _split(path)
    return getattr(obj, leaf)


def put(path: str, value: Any) -> None:
    """Set a switch under ``torch.backends`` by dotted path."""
    obj, leaf = _split(path)
    setattr(obj, leaf, value)


def available(path: str) -> bool:
    """Whether the installed torch has this switch."""
    try:
        get(path)
    except AttributeError:
        return False
    return True


def _backend_switches() -> tuple[str, ...]:
    precision = tuple(p for p in PRECISION_SWITCHES if available(p)) or LEGACY_SWITCHES
    return precision + tuple(p for p in REDUCTION_SWITCHES if available(p))


def _inductor_config():
    import torch._inductor.config

    return torch._inductor.config


def _legacy() -> dict[str, Any]:
    """The legacy matmul precision and cuDNN TF32 flag, or :data:`MIXED` where torch refuses to
    read one because the new API set the tree differently."""
    out: dict[str, Any] = {}
    for key, read in (
        ("legacy.float32_matmul_precision", torch.get_float32_matmul_precision),
        ("legacy.cudnn.allow_tf32", lambda: torch.backends.cudnn.allow_tf32),
    ):
        try:
            out[key] = read()
        except RuntimeError:
            out[key] = MIXED
    return out


def snapshot() -> dict[str, Any]:
    """Every switch this module knows, as a plain dict."""
    snap: dict[str, Any] = _legacy()
    snap.update({f"backends.{p}": get(p) for p in _backend_switches()})
    snap["default_dtype"] = torch.get_default_dtype()
    snap["deterministic"] = torch.are_deterministic_algorithms_enabled()
    snap["future.overwrite_module_params_on_conversion"] = (
        torch.__future__.get_overwrite_module_params_on_conversion()
    )
    snap["future.swap_module_params_on_conversion"] = (
        torch.__future__.get_swap_module_params_on_conversion()
    )
    snap["inductor.config"] = _inductor_config().save_config()
    return snap


def restore(snap: dict[str, Any]) -> None:
    """Put every switch back as ``snap`` recorded it.

    The legacy values go first (they also write parts of the tree), then the tree itself.
    """
    if snap.get("legacy.float32_matmul_precision", MIXED) != MIXED:
        torch.set_float32_matmul_precision(snap["legacy.float32_matmul_precision"])
    if snap.get("legacy.cudnn.allow_tf32", MIXED) != MIXED:
        torch.backends.cudnn.allow_tf32 = snap["legacy.cudnn.allow_tf32"]
    for key, value in snap.items():
        if key.startswith("backends."):
            put(key.removeprefix("backends."), value)
    torch.set_default_dtype(snap["default_dtype"])
    torch.use_deterministic_algorithms(snap["deterministic"])
    torch.__future__.set_overwrite_module_params_on_conversion(
        snap["future.overwrite_module_params_on_conversion"]
    )
    torch.__future__.set_swap_module_params_on_conversion(
        snap["future.swap_module_params_on_conversion"]
    )
    _inductor_config().load_config(snap["inductor.config"])


@contextmanager
def preserved() -> Iterator[dict[str, Any]]:
    """Restore every switch on exit, even when the body raises."""
    snap = snapshot()
    try:
        yield snap
    finally:
        restore(snap)


def seed(value: int = 0) -> None:
    """Seed Python's, NumPy's and torch's generators."""
    import numpy as np

    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)


def reset(snap: dict[str, Any], value: int = 0) -> None:
    """Back to ``snap``: switches restored, dynamo's caches dropped, autocast's cache cleared,
    generators seeded."""
    restore(snap)
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    torch.clear_autocast_cache()
    seed(value)

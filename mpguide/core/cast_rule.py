"""What counts as a cast, one rule for every command (``model``'s casts, ``casts`` in a
trace). Free of torch at import, so reading a trace does not load it."""

from __future__ import annotations

from typing import Any


def is_cast(source: Any, target: Any) -> bool:
    """Whether converting ``source`` to ``target`` is a cast: the two dtypes differ, whatever
    their kind. ``int64 -> float32`` and ``bool -> float32`` are casts (a kernel reads one
    format and writes another); a copy into the same dtype is not. Dtypes or their names
    (``'float32'``)."""
    return _name(source) != _name(target)


def _name(dtype: Any) -> str:
    """``torch.bfloat16`` or ``'bfloat16'`` -> ``'bfloat16'``, as :func:`mpguide.core.dtypes.name`
    spells a dtype, without importing torch."""
    return str(dtype).removeprefix("torch.")

"""Dtype names, which ATen ops convert dtypes, and a dispatch-mode log of every op with its
dtypes.

- :func:`parse` turns what readers type (``bf16``, ``torch.float16``, ``half``) into a dtype;
  :func:`name` (``bfloat16``) and :func:`short` (``bf16``, the graphs' notation) write one.
- :class:`Log` sits below autograd and autocast, so it sees the ops autocast really calls: the
  casts it inserts and the ``dtype=`` arguments it adds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mpguide import MPGuideError
from mpguide.core.cast_rule import is_cast
from mpguide.core.table import Table

ALIASES = {
    "fp64": "float64",
    "double": "float64",
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
"""Other names readers type for a dtype, to its torch name."""

FLOATS = ("float64", "float32", "bfloat16", "float16")
"""The floating dtypes readers choose among, by torch name."""

SHORT = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
}
"""The graphs' short dtype names."""
_FROM_SHORT = {s: str(d).removeprefix("torch.") for d, s in SHORT.items()}


def canonical(text: str) -> str:
    """The torch name for what a reader typed: ``'BF16'``, ``'f16'`` (the graphs' short name)
    and ``'torch.bfloat16'`` -> the torch name; a name that is neither is returned lowercased."""
    key = text.lower().removeprefix("torch.")
    return ALIASES.get(key) or _FROM_SHORT.get(key, key)


def parse(text: str | torch.dtype) -> torch.dtype:
    """One of the four floating dtypes from its name or alias, or ``MPGuideError`` naming them."""
    if isinstance(text, torch.dtype):
        return text
    key = canonical(text)
    if key not in FLOATS:
        choices = sorted({*FLOATS, *(a for a, n in ALIASES.items() if len(a) == 4)})
        raise MPGuideError(f"unknown dtype {text!r}; choose one of {', '.join(choices)}")
    return getattr(torch, key)


def autocast_dtype(text: str | torch.dtype) -> torch.dtype:
    """A dtype autocast takes (bfloat16 or float16), or ``MPGuideError``."""
    try:
        dt = parse(text)
    except MPGuideError:
        raise MPGuideError(f"unknown dtype {text!r}; autocast takes bfloat16 or float16") from None
    if dt not in (torch.bfloat16, torch.float16):
        raise MPGuideError(f"autocast takes bfloat16 or float16, not {name(dt)}")
    return dt


def name(dt: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``'bfloat16'``."""
    return str(dt).removeprefix("torch.")


def short(dt: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``'bf16'``: the notation of graphs, ``bf16[32, 7]``."""
    return SHORT.get(dt, name(dt))


CONVERSIONS = frozenset(
    {
        "prims.convert_element_type.default",
        "aten._to_copy.default",
        "aten.to.dtype",
        "aten.to.dtype_layout",
        "aten.to.device",
        "aten.copy.default",
        "aten.copy_.default",
    }
)
"""The ATen overloads that convert a tensor to another dtype (``copy`` into a buffer of
another dtype included)."""

IGNORED_NAMESPACES = frozenset({"prim", "profiler"})
"""Ops no log records: metadata queries (``prim.device``) and profiler ranges."""


def source_index(op: str) -> int | None:
    """Which tensor argument of conversion ``op`` is converted: the second for ``copy``
    (``copy(dst, src)``), else the first; ``None`` when ``op`` is no conversion."""
    if op not in CONVERSIONS:
        return None
    return 1 if op.startswith("aten.copy") else 0


def arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """An op's arguments by the names of its schema, defaults filled in."""
    found = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            found[arg.name] = args[i]
        elif arg.name in kwargs:
            found[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            found[arg.name] = arg.default_value
    return found


@dataclass(frozen=True)
class Call:
    """One op that reached the dispatcher: its tensor input dtypes (keyword tensors such as
    ``out=`` last), the ``dtype`` argument it was given (``None`` when none), and its first
    output's dtype."""

    op: str
    ins: tuple[torch.dtype, ...]
    dtype_arg: torch.dtype | None
    out: torch.dtype | None

    @property
    def cast(self) -> tuple[torch.dtype, torch.dtype] | None:
        """``(source, target)`` when this call is a conversion op that casts (:func:`~mpguide.core.cast_rule.is_cast`),
        floating or not."""
        i = source_index(self.op)
        if i is None or self.out is None or len(self.ins) <= i:
            return None
        return (self.ins[i], self.out) if is_cast(self.ins[i], self.out) else None

    @property
    def conversion(self) -> tuple[torch.dtype, torch.dtype] | None:
        """``(source, target)`` when this call casts between two floating dtypes: the casts
        autocast makes, those its policy tables count."""
        i = source_index(self.op)
        if i is None or self.out is None or len(self.ins) <= i:
            return None
        src = self.ins[i]
        if src != self.out and src.is_floating_point and self.out.is_floating_point:
            return src, self.out
        return None

    def row(self) -> tuple[str, str, str, str]:
        return (
            self.op.removesuffix(".default"),
            " + ".join(name(d) for d in self.ins),
            name(self.dtype_arg) if self.dtype_arg is not None else "",
            name(self.out) if self.out is not None else "",
        )


def _scan(values: Any, ins: list[torch.dtype], given: list[torch.dtype]) -> None:
    """Append the dtype of every tensor among ``values`` (tuples, lists and dicts walked in
    order: what ATen passes holds no other container) to ``ins``, and the first ``torch.dtype``
    argument to ``given``. A loop that appends costs less per op than torch's pytree or
    nested generators."""
    for v in values:
        if isinstance(v, torch.Tensor):
            ins.append(v.dtype)
        elif isinstance(v, (tuple, list)):
            _scan(v, ins, given)
        elif isinstance(v, dict):
            _scan(v.values(), ins, given)
        elif not given and isinstance(v, torch.dtype):
            given.append(v)


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor of an op's output, walked as :func:`_scan` walks."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (tuple, list)):
        return None
    for v in value:
        if (found := _first_tensor(v)) is not None:
            return found
    return None


_NAMES: dict[Any, str] = {}
"""Op names by op: ``str(OpOverload)`` builds the name anew at each call."""


class Log(TorchDispatchMode):
    """Records every op that reaches the dispatcher inside it, as :class:`Call` objects.

    Subclasses keep other records by overriding :meth:`record`."""

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace not in IGNORED_NAMESPACES:
            self.record(func, args, kwargs, out)
        return out

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Keep one op that ran: ``func(*args, **kwargs)`` returned ``out``."""
        ins: list[torch.dtype] = []
        given: list[torch.dtype] = []
        _scan(args, ins, given)
        if kwargs:
            _scan(kwargs.values(), ins, given)
        first = _first_tensor(out)
        name = _NAMES.get(func) or _NAMES.setdefault(func, str(func))
        self.calls.append(
            Call(
                name,
                tuple(ins),
                given[0] if given else None,
                None if first is None else first.dtype,
            )
        )

    def conversions(self) -> list[tuple[torch.dtype, torch.dtype]]:
        """The floating-point conversions logged, in order."""
        return [pair for c in self.calls if (pair := c.conversion) is not None]

    def table(self, caption: str = "") -> Table:
        """The calls, one row each: op, input dtypes, ``dtype=`` argument, output dtype."""
        return Table(("op", "in", "dtype=", "out"), tuple(c.row() for c in self.calls), caption)

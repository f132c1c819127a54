"""What a cast is in a trace: the ops that convert, the dtype names and codes the profiler
writes for them, the ``args`` entries read, the kernels that convert inside (fused casts), and
:class:`Cast`, one conversion with what it cost. :mod:`mpguide.traces.casts` finds them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from operator import attrgetter
from typing import Any, NamedTuple

import msgspec

CAST_OPS = frozenset({"aten::to", "aten::_to_copy", "aten::copy_"})
BACKWARD_MARK = "autograd::engine::evaluate_function"
TO_COPY_BACKWARD = f"{BACKWARD_MARK}: ToCopyBackward"
TOP_LEVEL = "(top level)"
NO_MODULE = "(no module)"
NO_LAUNCH = "(launch not in the trace)"
FOLDED = "(0-d casts)"
FUSED_KINDS = {
    "compiled": re.compile(r"_to_copy|convert_element_type"),
    "copy kernel": re.compile(r"\w*float\w*_copy_kernel\w*"),
    "vendor": re.compile(r"type_?convert|cast_?tensor|cast_transpose|cast_kernel", re.IGNORECASE),
    "quantize": re.compile(r"(?<!un)quantize|fp8_quant|fp4_quant", re.IGNORECASE),
}
"""What names a fused cast: inductor's kernels, ATen's dtype-specific copy kernels, vendor
kernels that convert, and quantizing kernels (to fp8 or fp4, with scales); a kernel named
"unquantized" (vLLM's ``rocm_unquantized_gemm``, a plain GEMM) does not quantize."""

# c10::ScalarType codes (c10/core/ScalarType.h) of the types a cast can name.
SCALAR_TYPES = {
    0: "uint8",
    1: "int8",
    2: "int16",
    3: "int32",
    4: "int64",
    5: "float16",
    6: "float32",
    7: "float64",
    8: "complex32",
    9: "complex64",
    10: "complex128",
    11: "bool",
    15: "bfloat16",
    23: "float8_e5m2",
    24: "float8_e4m3fn",
    25: "float8_e5m2fnuz",
    26: "float8_e4m3fnuz",
    27: "uint16",
    28: "uint32",
    29: "uint64",
    44: "float8_e8m0fnu",
}
# The C++ type names the profiler writes in ``Input type`` (``long`` in older exports).
CPP_TYPES = {
    "unsigned char": "uint8",
    "signed char": "int8",
    "short int": "int16",
    "int": "int32",
    "long int": "int64",
    "long": "int64",
    "c10::Half": "float16",
    "float": "float32",
    "double": "float64",
    "c10::complex<c10::Half>": "complex32",
    "c10::complex<float>": "complex64",
    "c10::complex<double>": "complex128",
    "bool": "bool",
    "c10::BFloat16": "bfloat16",
    "c10::Float8_e5m2": "float8_e5m2",
    "c10::Float8_e4m3fn": "float8_e4m3fn",
    "c10::Float8_e5m2fnuz": "float8_e5m2fnuz",
    "c10::Float8_e4m3fnuz": "float8_e4m3fnuz",
    "unsigned short": "uint16",
    "unsigned int": "uint32",
    "unsigned long": "uint64",
    "c10::Float8_e8m0fnu": "float8_e8m0fnu",
}
ITEMSIZE = {
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "bool": 1,
    "bfloat16": 2,
    "float8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2fnuz": 1,
    "float8_e4m3fnuz": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float8_e8m0fnu": 1,
}
UNKNOWN = "?"
DOWN, UP, SIDEWAYS = "down-cast", "up-cast", "same width"
SUMMARY_KEYS = {
    "cause": ("cause",),
    "module": ("module",),
    "pair": ("source", "target"),
    "direction": ("direction",),
    "pass": ("pass",),
}


def dtype_of(type_name: str) -> str:
    """``'c10::BFloat16'`` -> ``'bfloat16'``; an unknown name is returned as it is."""
    return CPP_TYPES.get(type_name, type_name)


_SCALAR_CODES = {str(k): v for k, v in SCALAR_TYPES.items()}


def _scalar_type(code: str) -> str | None:
    if code in _SCALAR_CODES:
        return _SCALAR_CODES[code]
    return f"ScalarType {code}" if code.isdigit() else None


_NULL = msgspec.Raw(b"null")


class _CastArgs(msgspec.Struct, gc=False):
    """The ``args`` entries that name a cast's dtypes and shape, left undecoded, and its
    autograd sequence number."""

    types: msgspec.Raw = msgspec.field(default=_NULL, name="Input type")
    concrete: msgspec.Raw = msgspec.field(default=_NULL, name="Concrete Inputs")
    dims: msgspec.Raw = msgspec.field(default=_NULL, name="Input Dims")
    sequence: int = msgspec.field(default=-1, name="Sequence number")


_CAST_ARGS = msgspec.json.Decoder(_CastArgs)

_Described = tuple[tuple[str, str], tuple[int, ...] | None]
_ENTRIES = attrgetter("types", "concrete", "dims")


def _keys(names: Iterable[str], args: Iterable[_CastArgs]) -> Iterator[tuple[str, bytes]]:
    """Each op's name, and the JSON of its three entries joined by NUL (which JSON text
    cannot hold): hashed once per cast, by builtins only (a million casts in a trace)."""
    return zip(names, map(b"\0".join, map(_ENTRIES, args)), strict=True)


def _list(raw: bytes) -> list:
    value = msgspec.json.decode(raw)
    return value if isinstance(value, list) else []


def _at(items: list, i: int) -> Any:
    return items[i] if len(items) > i else None


def _describe(name: str, entries: bytes) -> _Described:
    """(source, target) dtype of a cast op, ``'?'`` where the trace does not say, and the
    first input's shape; ``entries`` as :func:`_keys` joins them."""
    types, concrete, dims = entries.split(b"\0")
    types_, first_dims = _list(types), _at(_list(dims), 0)
    if name == "aten::copy_":
        dst, src = _at(types_, 0), _at(types_, 1)
    else:
        code = _at(_list(concrete), 1)
        src, dst = _at(types_, 0), _scalar_type(code) if isinstance(code, str) and code else None
    pair = tuple(dtype_of(t) if t and isinstance(t, str) else UNKNOWN for t in (src, dst))
    try:
        shape = None if first_dims is None else msgspec.convert(first_dims, tuple[int, ...])
    except msgspec.ValidationError:
        shape = None
    if shape is not None and not _possible(shape):
        shape = None
    return pair, shape


_MAX_ELEMENTS = 2**63


def _possible(shape: tuple[int, ...]) -> bool:
    """Whether a tensor can have ``shape``: no negative size, and fewer elements than int64
    counts. The product stops once past that bound, so that its cost grows with the number of
    dims, never with their product's digits (``math.prod`` of five million dims of 2 takes
    hours)."""
    if min(shape, default=0) < 0:
        return False
    if 0 in shape:
        return True
    n = 1
    for d in shape:
        n *= d
        if n >= _MAX_ELEMENTS:
            return False
    return True


def _direction(source: str, target: str) -> str:
    a, b = ITEMSIZE.get(source), ITEMSIZE.get(target)
    if a is None or b is None:
        return UNKNOWN
    return DOWN if b < a else UP if b > a else SIDEWAYS


def fused_kind(name: str) -> str | None:
    """Which kind of fused cast a kernel of this name is (a key of :data:`FUSED_KINDS`), or
    None. ATen ops and Python frames are never fused casts."""
    if name.startswith("aten::"):
        return None
    return next((kind for kind, mark in FUSED_KINDS.items() if mark.search(name)), None)


def needs_args(name: str) -> bool:
    """Whether the report reads the ``args`` of events with this name: pass it to
    :func:`mpguide.traces.trace.load` as ``args_of`` to keep only those."""
    return name in CAST_OPS or name.startswith(TO_COPY_BACKWARD)


def _function(name: str) -> str:
    """The function a kernel's C++ name calls, without its return type, template arguments
    and parameters: ``'void ns::kernel<4, f>(int)'`` -> ``'ns::kernel'``."""
    angle = paren = 0
    kept = []
    for ch in name:
        if ch == "(":
            paren += 1
        elif ch == ")":
            paren -= 1
        elif paren == 0 and ch == "<":
            angle += 1
        elif paren == 0 and ch == ">":
            angle -= 1
        elif paren == angle == 0:
            kept.append(ch)
    words = "".join(kept).split()
    return words[-1] if words else name


def kernel_label(name: str) -> str:
    """A fused-cast kernel's name short enough to read: its function, and the part of the
    name that says it converts when the function does not (``'ns::f [ns::_typeConvert]'``)."""
    kind = fused_kind(name)
    function = _function(name)
    if kind is None or FUSED_KINDS[kind].search(function):
        return function
    word = re.search(rf"[\w:]*(?:{FUSED_KINDS[kind].pattern})[\w:]*", name, FUSED_KINDS[kind].flags)
    return f"{function} [{word[0] if word else kind}]"


class Cast(NamedTuple):
    """One dtype conversion and what it cost (times in microseconds)."""

    id: int
    op: str
    cause: str
    cause_id: int | None
    source: str
    target: str
    shape: tuple[int, ...] | None
    bytes_read: int | None
    bytes_written: int | None
    cpu_us: float
    gpu_us: float
    share: float | None
    backward: bool
    module: str | None = None
    forward_id: int | None = None

    @property
    def direction(self) -> str:
        return _direction(self.source, self.target)

    @property
    def pass_(self) -> str:
        return "backward" if self.backward else "forward"

    @property
    def scalar(self) -> bool:
        """Whether it converts a 0-d tensor (a few bytes)."""
        return self.shape == ()

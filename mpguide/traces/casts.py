"""Find every dtype conversion in a call tree, what caused it and what it cost.

A cast is a chain of ``aten::to`` / ``aten::_to_copy`` / ``aten::copy_`` nodes whose source
and target dtypes differ: ``copy_`` names both in its ``Input type`` (target first), and
``to`` / ``_to_copy`` name the target in ``Concrete Inputs`` as a ScalarType code. Each cast
is reported once, at the top of its chain.

Its cause is what the trace knows of who asked for it. With the Python stack in the trace
(``with_stack=True``, a tree built with ``python=True``): the innermost ``nn.Module`` and the
innermost Python frame outside torch (torch's own frames, such as ``__torch_function__`` of
``torch/utils/_device.py``, are how it ran the reader's line), as ``file:line`` (the line the profiler records, where the function
starts), and the enclosing op if there is one; without it, the enclosing op: the nearest
ancestor that is not a cast, a Python frame, a launch or a ``ProfilerStep#N`` range. A cast of
the backward pass inside ``ToCopyBackward0`` is the gradient of a forward cast: the autograd
sequence number of its node names that cast, whose cause it takes.

Casts fused into kernels are reported apart (:class:`FusedCasts`): compiled kernels that
convert (``_to_copy`` or ``convert_element_type`` in the name, as inductor names them),
ATen's dtype-specific copy kernels (``bfloat16_copy_kernel_cuda``) outside a cast op, as in
a CUDA graph's replay, and vendor kernels whose name says they convert
(``vllm::_typeConvert``, ``CastTensor``) or quantize (``scaled_fp8_quant``). Their dtypes
are not in the trace; their time is the whole kernel's.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from html import escape
from operator import attrgetter
from typing import Any, NamedTuple

import msgspec
import numpy as np

from mpguide import MPGuideError
from mpguide.core.table import Table
from mpguide.core.units import duration_text
from mpguide.traces.calltree import (
    MODULE_MARK,
    PYTHON,
    RUNTIME_CATEGORIES,
    Node,
    Tree,
    frame_place,
    module_class,
)
from mpguide.traces.columns import codes
from mpguide.traces.trace import paused_gc

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
    "quantize": re.compile(r"quantize|fp8_quant|fp4_quant", re.IGNORECASE),
}
"""What names a fused cast: inductor's kernels, ATen's dtype-specific copy kernels, vendor
kernels that convert, and quantizing kernels (to fp8 or fp4, with scales)."""

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
_CAST_ARGS_LIST = msgspec.json.Decoder(list[_CastArgs])

_Key = tuple[str, bytes]
_Described = tuple[tuple[str, str], tuple[int, ...] | None]
_ENTRIES = attrgetter("types", "concrete", "dims")


def _key(name: str, args: _CastArgs) -> _Key:
    """The op's name, and the JSON of its three entries joined by NUL (which JSON text
    cannot hold), hashed once."""
    return name, b"\0".join(_ENTRIES(args))


def _list(raw: bytes) -> list:
    value = msgspec.json.decode(raw)
    return value if isinstance(value, list) else []


def _at(items: list, i: int) -> Any:
    return items[i] if len(items) > i else None


def _describe(name: str, entries: bytes) -> _Described:
    """(source, target) dtype of a cast op, ``'?'`` where the trace does not say, and the
    first input's shape; ``entries`` as :func:`_key` joins them."""
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
    if shape is not None and not (min(shape, default=0) >= 0 and math.prod(shape) < 2**63):
        shape = None  # no tensor has it: a negative size, or more elements than int64 counts
    return pair, shape


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


COLUMNS = (
    "id",
    "op",
    "cause",
    "pass",
    "source",
    "target",
    "direction",
    "shape",
    "bytes read",
    "bytes written",
    "cpu us",
    "gpu us",
    "share of step",
    "gpu share of step",
)
_NAMED = ("cause", "module", "pass")
"""The summaries that name the dtype directions of each row's casts."""


_SHORT = {
    "float64": "f64",
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "bool": "b8",
}


def pair_label(source: str, target: str) -> str:
    """``('float32', 'bfloat16')`` -> ``'f32->bf16'``: a dtype direction in short names."""
    return f"{_SHORT.get(source, source)}->{_SHORT.get(target, target)}"


def percent_text(share: float | None) -> str | None:
    """A share as a percentage with the digits that tell it apart: ``'3.5%'``, ``'0.13%'``,
    ``'<0.01%'``."""
    if share is None:
        return None
    p = 100 * share
    if p == 0 or p >= 10:
        return f"{p:.0f}%" if p == 0 else f"{p:.1f}%"
    return f"{p:.2f}%" if p >= 0.01 else "<0.01%"


def bytes_text(n: int | None) -> str | None:
    """A size in decimal units: ``'2.69 GB'``, ``'145 kB'``, ``'768 B'``."""
    if n is None:
        return None
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


_TEXT = {
    "bytes read": ("read", bytes_text),
    "bytes written": ("written", bytes_text),
    "cpu us": ("CPU", duration_text),
    "gpu us": ("GPU", duration_text),
    "kernel us": ("GPU", duration_text),
    "share of step": ("CPU %", percent_text),
    "gpu share of step": ("GPU %", percent_text),
    "cause cpu us": (None, None),
    "cause gpu us": (None, None),
}
"""How the text output names and writes the columns: units a person reads; the cause's own
time only in the other formats."""

LEGEND = (
    "Columns of the text output: dtypes: the dtype directions of the row's casts, most casts "
    "first; casts: how many; written: the bytes they wrote; CPU: their time on the CPU (the "
    "cast ops themselves); GPU: the time of the kernels they launched; CPU %: CPU over the "
    "CPU time of the profiled steps (ProfilerStep#N ranges); GPU %: GPU over the time of the "
    "kernels launched in those steps (GPU columns only when the trace has kernels). json and "
    "csv keep the numbers in microseconds and fractions (cpu us, share of step, ...) and add, "
    "by cause, cause cpu us and cause gpu us: the time of the op, module or frame that "
    "caused the casts, less the casts inside it."
)
"""What the columns are: the epilog of ``casts --help``."""


def readable(table: Table) -> Table:
    """``table`` as a person reads it: times in ms or µs, shares in %, sizes in kB, MB or
    GB; the columns the text leaves out (the cause's own time) dropped (:data:`LEGEND`)."""
    if "source" in table.columns and "target" in table.columns:  # one cast per row
        i, j = table.columns.index("source"), table.columns.index("target")
        dropped = {"op", "direction", "bytes read", "target"}
        columns = tuple("dtypes" if c == "source" else c for c in table.columns)
        rows = tuple(
            tuple(pair_label(r[i], r[j]) if k == i and r[j] else v for k, v in enumerate(r))
            for r in table.rows
        )
        keep = [k for k, c in enumerate(columns) if c not in dropped]
        table = Table(
            tuple(columns[k] for k in keep),
            tuple(tuple(r[k] for k in keep) for r in rows),
            table.caption,
            table.notes,
        )
    keep = [i for i, c in enumerate(table.columns) if _TEXT.get(c, (c,))[0] is not None]
    columns = tuple(_TEXT.get(table.columns[i], (table.columns[i],))[0] for i in keep)
    shows = [_TEXT.get(table.columns[i], (None, None))[1] for i in keep]
    rows = tuple(
        tuple(
            v if show is None else show(v)
            for v, show in zip((r[i] for i in keep), shows, strict=True)
        )
        for r in table.rows
    )
    return Table(columns, rows, table.caption, table.notes)


def _significant(x: float) -> float:
    """``x`` to four significant digits: a small share stays visible, never 0."""
    return float(f"{x:.4g}")


def _limited(columns, rows: list, folded: list, limit: int | None, caption: str, notes: list):
    """A table of the first ``limit`` rows (all for None), then the folded rows; a note says
    how many rows were left out."""
    if limit is not None and limit < 1:
        raise MPGuideError(f"limit must be 1 or more (None for no limit), got {limit}")
    shown = rows if limit is None else rows[:limit]
    if len(shown) < len(rows):
        notes = [
            f"... {len(rows) - len(shown):,} more rows not shown ({len(shown):,} of {len(rows):,})",
            *notes,
        ]
    return Table(tuple(columns), tuple(shown + folded), caption, tuple(notes))


@dataclass(frozen=True, eq=False)
class FusedCasts:
    """Kernels that convert dtypes inside their own work, outside any cast op, one array per
    column: ``ids``, ``kind`` (index into :data:`FUSED_KINDS`' keys), ``kernel`` (index into
    ``kernels``, short names), ``cause`` (index into ``causes``), ``backward``, ``us`` (the
    kernel's own duration) and ``gpu`` (whether it ran on the device)."""

    ids: np.ndarray
    kind: np.ndarray
    kernel: np.ndarray
    cause: np.ndarray
    backward: np.ndarray
    us: np.ndarray
    gpu: np.ndarray
    kernels: list[str]
    causes: list[str]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def total_us(self) -> float:
        return float(self.us.sum())

    @property
    def unlaunched(self) -> np.ndarray:
        """Mask of the kernels whose launch is not in the trace."""
        if NO_LAUNCH not in self.causes:
            return np.zeros(len(self), bool)
        return self.cause == self.causes.index(NO_LAUNCH)

    def table(self, *, limit: int | None = None) -> Table:
        """One row per kernel, kind, cause and pass: how many ran and their time, most time
        first."""
        kinds = list(FUSED_KINDS)
        n_c = len(self.causes)
        group = ((self.kernel * len(kinds) + self.kind) * n_c + self.cause) * 2 + self.backward
        present, first, which = np.unique(group, return_index=True, return_inverse=True)
        k = len(present)
        count = np.bincount(which, minlength=k)
        us = np.bincount(which, self.us, k)
        on_gpu = np.bincount(which, self.gpu, k) > 0
        rows = []
        for key, n, t, g in zip(*(x.tolist() for x in (present, count, us, on_gpu)), strict=True):
            rest, backward = divmod(key, 2)
            rest, cause = divmod(rest, n_c)
            kernel, kind = divmod(rest, len(kinds))
            rows.append(
                (
                    self.kernels[kernel],
                    kinds[kind],
                    self.causes[cause],
                    ("forward", "backward")[backward],
                    "gpu" if g else "cpu",
                    n,
                    round(t, 3),
                )
            )
        rows = [rows[i] for i in np.lexsort((first, -us)).tolist()]
        columns = ("kernel", "kind", "cause", "pass", "device", "kernels", "kernel us")
        caption = (
            f"{len(self)} fused cast kernel{'' if len(self) == 1 else 's'}, "
            f"{duration_text(self.total_us)}: their dtypes are not in the trace, their time is "
            "the whole kernel's"
        )
        return _limited(columns, rows, [], limit, caption, [])

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


@dataclass(frozen=True, eq=False)
class CastReport:
    """Every cast found in a tree, as one array per column, with the time of the profiled
    steps they fall in. :attr:`casts` lists them one by one; the summaries are computed on
    the columns; :attr:`fused` holds the casts fused into kernels.

    Per cast: ``ids`` (node id), ``op`` (index into ``names``), ``cause`` (index into
    ``causes``), ``cause_ids`` (the causing op, module or frame; -1 for none), ``module``
    (index into ``modules``, whose None is no module), ``forward_ids`` (of a backward cast,
    the forward cast it is the gradient of; else -1), ``pair`` (index into ``pairs``),
    ``shape`` (index into ``shapes``), ``cpu_us`` and ``gpu_us``, the causing node's own
    ``cause_cpu_us`` and ``cause_gpu_us`` and the part of the cast inside it (``inside_us``),
    and ``backward``. ``step_us`` is None when the trace has no ``ProfilerStep#N`` range;
    ``untyped`` counts the copy chains whose dtypes the trace does not name; ``notes`` say
    what the trace lacked.
    """

    ids: np.ndarray
    op: np.ndarray
    cause: np.ndarray
    cause_ids: np.ndarray
    module: np.ndarray
    forward_ids: np.ndarray
    pair: np.ndarray
    shape: np.ndarray
    cpu_us: np.ndarray
    gpu_us: np.ndarray
    cause_cpu_us: np.ndarray
    cause_gpu_us: np.ndarray
    inside_us: np.ndarray
    backward: np.ndarray
    names: list[str]
    causes: list[str]
    modules: list[str | None]
    pairs: list[tuple[str, str]]
    shapes: list[tuple[int, ...] | None]
    step_us: float | None
    fused: FusedCasts
    source: str = ""
    step_gpu_us: float | None = None
    gpu: bool = False
    untyped: int = 0
    notes: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        return iter(self.casts)

    @cached_property
    def scalar(self) -> np.ndarray:
        """Mask of the casts of 0-d tensors."""
        return np.array([s == () for s in self.shapes], dtype=bool)[self.shape]

    def _bytes(self) -> tuple[np.ndarray, np.ndarray]:
        """Bytes read and written per cast, NaN where the size or shape is unknown."""
        numel = np.array([math.nan if s is None else math.prod(s) for s in self.shapes], float)
        size_in, size_out = (
            np.array([ITEMSIZE.get(p[k], math.nan) for p in self.pairs], float) for k in (0, 1)
        )
        n = numel[self.shape]
        return n * size_in[self.pair], n * size_out[self.pair]

    def share_of_steps(self, gpu: bool) -> tuple[float, float, float]:
        """The casts' time, the profiled steps' time and the first over the second: with
        ``gpu``, the casts' kernel time over the kernel time launched in the steps, else
        their CPU time over the steps' duration (the ``ProfilerStep#N`` ranges).
        MPGuideError when the trace has no step, or no kernel in it for ``gpu``."""
        steps = self.step_gpu_us if gpu else self.step_us
        if not steps:
            where = self.source or "trace"
            lacks = "kernel time in a ProfilerStep#N range" if gpu else "ProfilerStep#N range"
            raise MPGuideError(f"{where}: no {lacks}, so no share of the step")
        cast_us = float((self.gpu_us if gpu else self.cpu_us).sum())
        return cast_us, steps, cast_us / steps

    def _share(self, cpu: list[float]) -> list[float | None]:
        if self.step_us is None:
            return [None] * len(cpu)
        return [_significant(c / self.step_us) for c in cpu]

    def _gpu_share(self, gpu: list[float]) -> list[float | None]:
        if not self.step_gpu_us:
            return [None] * len(gpu)
        return [_significant(g / self.step_gpu_us) for g in gpu]

    @cached_property
    def casts(self) -> tuple[Cast, ...]:
        """One :class:`Cast` per row."""
        names, pairs, shapes = self.names, self.pairs, self.shapes
        read, written = (list(map(_count, b.tolist())) for b in self._bytes())
        pair = [pairs[k] for k in self.pair.tolist()]
        cpu = self.cpu_us.tolist()
        columns = (
            self.ids.tolist(),
            [names[k] for k in self.op.tolist()],
            [self.causes[k] for k in self.cause.tolist()],
            [None if i < 0 else i for i in self.cause_ids.tolist()],
            [p[0] for p in pair],
            [p[1] for p in pair],
            [shapes[k] for k in self.shape.tolist()],
            read,
            written,
            cpu,
            self.gpu_us.tolist(),
            self._share(cpu),
            self.backward.tolist(),
            [self.modules[k] for k in self.module.tolist()],
            [None if i < 0 else i for i in self.forward_ids.tolist()],
        )
        return tuple(map(Cast._make, zip(*columns, strict=True)))

    def _fit(self, columns: tuple[str, ...], rows: list) -> tuple[tuple[str, ...], list]:
        """Without the GPU columns when the trace has no GPU events."""
        if self.gpu:
            return columns, rows
        keep = [i for i, c in enumerate(columns) if "gpu" not in c]
        return tuple(columns[i] for i in keep), [tuple(r[i] for i in keep) for r in rows]

    def _notes(self, bytes_unknown: bool) -> list[str]:
        notes = list(self.notes)
        if bytes_unknown:
            notes.append("bytes are blank where the trace has no shape for the cast")
        if self.step_us is None and len(self):
            notes.append("share of step is blank: the trace has no ProfilerStep#N range")
        unlaunched = self.fused.unlaunched
        fused = len(self.fused) - int(unlaunched.sum())
        if fused:
            us = float(self.fused.us[~unlaunched].sum())
            notes.append(
                f"{fused} casts fused into kernels ({duration_text(us)} of kernel time) are "
                "not in these rows: --by fused lists them"
            )
        if unlaunched.any():
            us = float(self.fused.us[unlaunched].sum())
            notes.append(
                f"{int(unlaunched.sum())} more cast kernels ({duration_text(us)}) were launched "
                "before the trace began (a previous step's copies): not counted above, --by "
                "fused lists them as " + NO_LAUNCH
            )
        return notes

    def _folded(self, keep: np.ndarray, columns: tuple[str, ...], label: str) -> list[tuple]:
        """The one row, in ``columns``, that stands for the 0-d casts left out of ``keep``,
        labelled in column ``label``."""
        out = ~keep
        n = int(out.sum())
        if not n:
            return []
        written = self._bytes()[1][out]
        cpu = float(self.cpu_us[out].sum())
        cells = {
            label: FOLDED if "casts" in columns else f"{FOLDED[:-1]}: {n}, folded)",
            "casts": n,
            "bytes written": None if np.isnan(written).any() else int(written.sum()),
            "cpu us": round(cpu, 3),
            "gpu us": round(float(self.gpu_us[out].sum()), 3),
            "share of step": self._share([cpu])[0],
            "gpu share of step": self._gpu_share([float(self.gpu_us[out].sum())])[0],
        }
        return [tuple(cells.get(c) for c in columns)]

    def table(self, by: str = "cast", *, scalars: bool = True, limit: int | None = None) -> Table:
        """One row per cast (``by="cast"``), a :meth:`summary` (``by`` one of
        :data:`SUMMARY_KEYS`), or the fused casts (``"fused"``). Without ``scalars`` the
        casts of 0-d tensors are folded into one last row; ``limit`` caps the other rows."""
        if by == "fused":
            return self.fused.table(limit=limit)
        if by != "cast":
            return self.summary(by, scalars=scalars, limit=limit)
        keep = np.ones(len(self), bool) if scalars else ~self.scalar
        names, pairs = self.names, self.pairs
        direction = [_direction(*p) for p in pairs]
        shape = ["x".join(map(str, s)) if s is not None else None for s in self.shapes]
        read_b, written_b = self._bytes()
        at = np.flatnonzero(keep)
        pair = self.pair[at].tolist()
        cpu = self.cpu_us[at].tolist()
        cells = {
            "id": self.ids[at].tolist(),
            "op": [names[k] for k in self.op[at].tolist()],
            "cause": [self.causes[k] for k in self.cause[at].tolist()],
            "pass": [("forward", "backward")[b] for b in self.backward[at].tolist()],
            "source": [pairs[k][0] for k in pair],
            "target": [pairs[k][1] for k in pair],
            "direction": [direction[k] for k in pair],
            "shape": [shape[k] for k in self.shape[at].tolist()],
            "bytes read": list(map(_count, read_b[at].tolist())),
            "bytes written": list(map(_count, written_b[at].tolist())),
            "cpu us": [round(c, 3) for c in cpu],
            "gpu us": [round(g, 3) for g in self.gpu_us[at].tolist()],
            "share of step": self._share(cpu),
            "gpu share of step": self._gpu_share(self.gpu_us[at].tolist()),
        }
        rows = list(zip(*(cells[c] for c in COLUMNS), strict=True))
        columns, rows = self._fit(COLUMNS, rows)
        folded = self._folded(keep, columns, "cause")
        n = len(self)
        caption = f"{n} cast{'' if n == 1 else 's'} in {self.source or 'the trace'}"
        unknown = bool(np.isnan(written_b).any())
        return _limited(columns, rows, folded, limit, caption, self._notes(unknown))

    def _groups(self, by: str) -> tuple[np.ndarray, list[tuple]]:
        """Each cast's group under ``by``, and each group's key cells."""
        if by == "cause":
            return self.cause, [(n,) for n in self.causes]
        if by == "module":
            return self.module, [(NO_MODULE if m is None else m,) for m in self.modules]
        if by == "pair":
            return self.pair, self.pairs
        if by == "pass":
            return self.backward.astype(np.int64), [("forward",), ("backward",)]
        direction, labels = codes((_direction(*p) for p in self.pairs), len(self.pairs))
        return direction[self.pair], [(d,) for d in labels]

    def summary(
        self, by: str = "cause", *, scalars: bool = True, limit: int | None = None
    ) -> Table:
        """Casts aggregated by ``cause``, ``module``, ``pair`` (source and target),
        ``direction`` or ``pass``: count, bytes, CPU and GPU time, and share of the profiled
        steps, largest CPU time first. Without ``scalars`` the casts of 0-d tensors are
        folded into one last row; ``limit`` caps the other rows.

        By cause, ``dtypes`` names the directions of each row's casts, most first, and
        ``cause cpu us`` and ``cause gpu us`` are the time of the causing nodes (op, module
        or frame) less the casts in them, to set a cast's cost against the work of what asked
        for it (blank where the casts have no causing node). ``gpu share of step`` is the
        GPU time over that of the kernels launched in the profiled steps.
        """
        if by not in SUMMARY_KEYS:
            raise ValueError(f"unknown summary {by!r}; choose one of {', '.join(SUMMARY_KEYS)}")
        keep = np.ones(len(self), bool) if scalars else ~self.scalar
        group, labels = self._groups(by)
        written_all = self._bytes()[1]
        at = np.flatnonzero(keep)
        present, first, which = np.unique(group[at], return_index=True, return_inverse=True)
        k = len(present)
        count = np.bincount(which, minlength=k)
        written = written_all[at]
        unknown = np.bincount(which, np.isnan(written), k) > 0
        total = np.bincount(which, np.nan_to_num(written), k)
        cpu = np.bincount(which, self.cpu_us[at], k)
        gpu = np.bincount(which, self.gpu_us[at], k)
        columns = [present, count, total, unknown, cpu, gpu]
        if by == "cause":
            columns += self._own_time(at, present)
        directions = self._directions(group[at], self.pair[at], present) if by in _NAMED else None
        rows = []
        for j, (key, n, w, u, c, g, *own) in enumerate(
            zip(*(list(x) if isinstance(x, list) else x.tolist() for x in columns), strict=True)
        ):
            times = [round(t, 3) if t is not None else None for t in (c, g, *own)]
            dts = () if directions is None else (directions[j],)
            shares = (*self._share([c]), *self._gpu_share([g]))
            rows.append((*labels[key], *dts, n, None if u else int(w), *times, *shares))
        rows = [rows[i] for i in np.lexsort((first, -cpu)).tolist()]
        extra = ("cause cpu us", "cause gpu us") if by == "cause" else ()
        keys = SUMMARY_KEYS[by]
        names = (
            *keys,
            *(("dtypes",) if by in _NAMED else ()),
            "casts",
            "bytes written",
            "cpu us",
            "gpu us",
            *extra,
            "share of step",
            "gpu share of step",
        )
        names_fit, rows = self._fit(names, rows)
        folded = self._folded(keep, names_fit, keys[0])
        notes = self._notes(bool(np.isnan(written_all).any()))
        return _limited(names_fit, rows, folded, limit, f"casts by {by}", notes)

    def _directions(self, group: np.ndarray, pair: np.ndarray, present: np.ndarray) -> list[str]:
        """Per group in ``present``, its casts' dtype directions, most casts first."""
        n = len(self.pairs)
        both, count = np.unique(group * n + pair, return_counts=True)
        found: dict[int, Counter[str]] = {}
        for k, c in zip(both.tolist(), count.tolist(), strict=True):
            g, p = divmod(k, n)
            found.setdefault(g, Counter())[pair_label(*self.pairs[p])] += c
        return [
            ", ".join(
                label for label, _ in sorted(found[g].items(), key=lambda kv: (-kv[1], kv[0]))
            )
            for g in present.tolist()
        ]

    def _own_time(self, at: np.ndarray, present: np.ndarray) -> list[list[float | None]]:
        """Per cause in ``present``, the CPU and GPU time of its causing nodes less the part
        of their casts (among ``at``) inside them; a node that causes casts of several rows
        counts in each; None for a row whose casts have no causing node."""
        cause_ids, cause = self.cause_ids[at], self.cause[at]
        row = np.searchsorted(present, cause)
        pairs = row * (int(cause_ids.max(initial=0)) + 2) + (cause_ids + 1)
        _, first, which = np.unique(pairs, return_index=True, return_inverse=True)
        k = len(first)
        has_node = np.bincount(row, cause_ids >= 0, len(present)) > 0
        out = []
        for own, cast in (
            (self.cause_cpu_us[at], self.inside_us[at]),
            (self.cause_gpu_us[at], self.gpu_us[at]),
        ):
            per_node = own[first] - np.bincount(which, cast, k)
            per_node = np.where(cause_ids[first] >= 0, per_node, 0.0)
            per_row = np.bincount(row[first], per_node, len(present))
            out.append([v if h else None for v, h in zip(per_row.tolist(), has_node, strict=True)])
        return out

    def __repr__(self) -> str:
        text = self.summary("cause").to_text()
        return f"{text}\n\n{self.fused!r}" if len(self.fused) else text

    def _repr_html_(self) -> str:
        n = len(self)
        steps = "" if self.step_us is None else f" in {self.step_us:.1f} us of profiled steps"
        head = escape(f"{n} cast{'' if n == 1 else 's'}{steps}")
        fused = self.fused.table().to_html() if len(self.fused) else ""
        return (
            f"<p>{head}</p>{self.summary('cause').to_html()}{self.summary('pair').to_html()}{fused}"
        )


def _count(value: float) -> int | None:
    return None if math.isnan(value) else int(value)


def _chain_pair(tree: Tree, top: int) -> tuple[str, str] | None:
    """(source, target) of the first copy_ in the chain under ``top`` that converts."""
    for node in Node(tree, top).walk():
        if node.name == "aten::copy_":
            args = _cast_args(_CAST_ARGS, node.tree.trace.args.raw(node.id), tree.trace.source)
            pair = _describe(*_key(node.name, args))[0]
            if pair[0] != pair[1]:
                return pair
    return None


def _cast_args(decoder: msgspec.json.Decoder, raw: bytes, source: str):
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as err:
        raise MPGuideError(
            f"{source or 'trace'}: a cast op's args are not usable ({err})"
        ) from None


def _steps_gpu_us(tree: Tree) -> float | None:
    """The time of the GPU work launched in the profiled steps, None without steps or GPU
    work linked to them."""
    steps = tree.step_mask()
    if not (steps.any() and tree.gpu_work.any()):
        return None
    return sum(tree.gpu_us[steps].tolist()) or None


def _steps_us(tree: Tree) -> float | None:
    """The time of the profiled steps, None without a ``ProfilerStep#N`` range."""
    steps = tree.step_mask()
    return sum(tree.dur_us[steps].tolist()) if steps.any() else None


class _Context(NamedTuple):
    """What the tree says above each cast: the nearest causing op below the Python code,
    the innermost module and Python frame below the backward node, the nearest backward node
    and cast op (-1 where none)."""

    op: np.ndarray
    module: np.ndarray
    frame: np.ndarray
    grad: np.ndarray
    cast_op: np.ndarray


_TORCH_FILE = re.compile(r"(?:^|[/\\])torch[/\\]")


def _readers_frame(name: str) -> bool:
    """Whether an event is a Python frame outside torch: a frame inside torch
    (``torch/utils/_device.py(99): __torch_function__``, ``torch/nn/modules/module.py``'s
    ``_call_impl``) is how torch ran the reader's line, not the line."""
    place = frame_place(name)
    return place is not None and not _TORCH_FILE.search(place[0])


def _contexts(tree: Tree, ids: np.ndarray) -> tuple[_Context, int]:
    if not len(ids):
        return _Context(*(np.zeros(0, np.int64) for _ in _Context._fields)), 0
    python = tree.in_category(PYTHON.__eq__)
    cast_op = tree.named(CAST_OPS.__contains__)
    not_work = tree.in_category(lambda c: c in RUNTIME_CATEGORIES or c.startswith("gpu_"))
    causing = ~(cast_op | python | tree.step_mask() | not_work)
    module = python & tree.named(lambda n: n.startswith(MODULE_MARK))
    frame = python & tree.named(_readers_frame)
    grad = tree.named(lambda n: n.startswith(BACKWARD_MARK))
    found = _Context(*tree.nearest(ids, causing, module, frame, grad, cast_op))
    # What lies above the Python code (a range such as a step's) or above the backward node
    # (the Python code that called backward()) is context, not cause.
    depth = np.append(tree.depth, tree.depth.dtype.type(-1))
    found.op[depth[found.op] < np.maximum(depth[found.module], depth[found.frame])] = -1
    for above in (found.module, found.frame):
        above[depth[above] < depth[found.grad]] = -1
    # Where the trace's Python events overlap, nesting can put a cast under a module or
    # frame that had ended before it began: only one that holds the cast in time is a cause.
    # GPU kernels run after their launch, out of the CPU events' time: only the CPU's are held.
    ts, end = tree.trace.ts, tree.trace.ts + tree.dur_us
    cpu = ~tree.gpu_work[ids]
    ended = np.zeros(len(ids), bool)
    for above in (found.module, found.frame):
        at = np.maximum(above, 0)
        held = ~cpu | ((ts[at] <= ts[ids]) & (end[ids] <= end[at]))
        ended |= (above >= 0) & ~held
        above[~held] = -1
    return found, int(ended.sum())


def _label(op: str | None, module: str | None, frame: str | None) -> tuple[str, str | None]:
    """A cause as the reader reads it, and its module's class."""
    cls = None if module is None else module_class(module)
    place = None if frame is None else frame_place(frame)
    head = cls or (place[2] if place else None)
    if head is None:
        return op or TOP_LEVEL, None
    text = f"{head} ({place[0]}:{place[1]})" if place else head
    return (f"{text}, {op}" if op else text), cls


def _causes(tree: Tree, ctx: _Context) -> tuple[np.ndarray, list[str], np.ndarray, list]:
    """Each cast's cause (index into the labels) and module (index into the classes)."""
    name = tree.trace.name
    parts = [np.where(i >= 0, name.codes[np.maximum(i, 0)], -1) for i in ctx[:3]]
    keys, key = np.unique(np.stack(parts, axis=1), axis=0, return_inverse=True)
    found = [_label(*(None if k < 0 else name.values[k] for k in row)) for row in keys.tolist()]
    key = key.reshape(-1)
    cause, labels = codes((text for text, _ in found), len(found))
    module, classes = codes((cls for _, cls in found), len(found))
    return cause[key], labels, module[key], classes


def _tie_backward(tree: Tree, ids: np.ndarray, sequence: np.ndarray, pair, pairs, ctx: _Context):
    """For each cast, the forward cast whose gradient it is (-1 for none).

    A cast under a ``ToCopyBackward`` node is tied to the forward cast that made the node:
    the ops a thread runs share one sequence number until an op makes a backward node, so
    that op is the last with the node's number; taken in the same process, and only when it
    converts the other way."""
    forward = np.full(len(ids), -1, dtype=np.int64)
    grad = ctx.grad
    tied = grad >= 0
    tied[tied] = tree.named(lambda n: n.startswith(TO_COPY_BACKWARD))[grad[tied]]
    fwd = np.flatnonzero((grad < 0) & (sequence >= 0))
    if not (tied.any() and len(fwd)):
        return forward
    pid = tree.trace.pid.codes
    n_pid = len(tree.trace.pid.values)
    fwd = fwd[np.argsort(-tree.trace.ts[ids[fwd]], kind="stable")]
    unique, last = np.unique(sequence[fwd] * n_pid + pid[ids[fwd]], return_index=True)
    at = np.flatnonzero(tied)
    wanted = tree.sequence_numbers(grad[at]) * n_pid + pid[ids[at]]
    pos = np.minimum(np.searchsorted(unique, wanted), len(unique) - 1)
    candidate = fwd[last[pos]]
    reverse = np.array([pairs.index(p[::-1]) if p[::-1] in pairs else -1 for p in pairs])
    hit = (unique[pos] == wanted) & (reverse[pair[at]] == pair[candidate])
    forward[at[hit]] = candidate[hit]
    return forward


def _fused(tree: Tree) -> tuple[np.ndarray, np.ndarray]:
    """The events whose name marks a fused cast, in time order, and their kind: kernels,
    and CPU events that launched no GPU work (a CPU event that did is left to its kernels)."""
    kinds = list(FUSED_KINDS)
    kind_of = [kinds.index(k) if (k := fused_kind(n)) else -1 for n in tree.trace.name.values]
    kind = np.array(kind_of, dtype=np.int8)[tree.trace.name.codes]
    frames = tree.in_category(lambda c: c == PYTHON or c in RUNTIME_CATEGORIES)
    candidate = (kind >= 0) & ~frames
    if candidate.any():
        candidate[candidate] = tree.gpu_work[candidate] | (tree.gpu_us[candidate] == 0)
    ids = tree.order[candidate[tree.order]]
    return ids, kind[ids].astype(np.int64)


@paused_gc()
def report(tree: Tree) -> CastReport:
    """Every cast in ``tree``: a chain of cast ops whose dtypes differ, with its cause (see
    the module docs), and the casts fused into kernels. Share is CPU time over the time of
    the profiled steps (``ProfilerStep#N``); unknown without them."""
    is_cast_op = tree.named(CAST_OPS.__contains__)
    under_cast = np.zeros_like(is_cast_op)
    has_parent = tree.parent >= 0
    under_cast[has_parent] = is_cast_op[tree.parent[has_parent]]
    tops = is_cast_op & ~under_cast
    ids = tree.order[tops[tree.order]]
    names = tree.trace.name
    raws = b"[" + b",".join(tree.trace.args.raws(ids)) + b"]"
    args = _cast_args(_CAST_ARGS_LIST, raws, tree.trace.source)
    sequence = np.fromiter(map(attrgetter("sequence"), args), np.int64, len(args))
    top_names = map(names.values.__getitem__, names.codes[ids].tolist())
    shape, keys = codes(map(_key, top_names, args), len(ids))
    described = [_describe(*key) for key in keys]
    pair_of_key, pairs = codes((p for p, _ in described), len(described))
    pair = pair_of_key[shape]
    known = np.array([UNKNOWN not in p for p in pairs], dtype=bool)[pair]
    same = np.array([p[0] == p[1] for p in pairs], dtype=bool)[pair]
    nothing = np.array([p == (UNKNOWN, UNKNOWN) for p in pairs], dtype=bool)[pair]
    kept = known & ~same
    pairs = list(pairs)
    untyped = 0
    for k in np.flatnonzero(~known).tolist():
        found = _chain_pair(tree, int(ids[k]))
        if found is not None:
            kept[k] = True
            if found not in pairs:  # one index per pair, so that a summary by pair is one row
                pairs.append(found)
            pair[k] = pairs.index(found)
        else:
            untyped += int(nothing[k])
    ids, pair, shape, sequence = ids[kept], pair[kept], shape[kept], sequence[kept]
    fused_ids, fused_kinds = _fused(tree)
    n = len(ids)
    ctx, ended = _contexts(tree, np.concatenate((ids, fused_ids)))
    cause_ids = np.where(ctx.op >= 0, ctx.op, np.where(ctx.module >= 0, ctx.module, ctx.frame))
    forward = _tie_backward(tree, ids, sequence, pair, pairs, _Context(*(c[:n] for c in ctx)))
    tied = np.flatnonzero(forward >= 0)
    for part in ctx[:3]:
        part[tied] = part[forward[tied]]
    cause, causes, module, modules = _causes(tree, ctx)
    backward = ctx.grad >= 0
    dur, gpu_us = tree.dur_us, tree.gpu_us
    alone = ctx.cast_op[n:] < 0
    fid = fused_ids[alone]
    fused_cause = cause[n:][alone]
    unlaunched = tree.gpu_work[fid] & (tree.parent[fid] < 0)
    if unlaunched.any():
        fused_cause[unlaunched] = len(causes)
        causes.append(NO_LAUNCH)
    label = {k: kernel_label(names.values[k]) for k in np.unique(names.codes[fid]).tolist()}
    kernel, kernels = codes(map(label.__getitem__, names.codes[fid].tolist()), len(fid))
    fused = FusedCasts(
        ids=fid,
        kind=fused_kinds[alone],
        kernel=kernel,
        cause=fused_cause,
        backward=backward[n:][alone],
        us=dur[fid],
        gpu=tree.gpu_work[fid],
        kernels=kernels,
        causes=causes,
    )
    cause_ids = cause_ids[:n]
    caused = cause_ids >= 0
    at = np.maximum(cause_ids, 0)
    ts = tree.trace.ts
    inside = np.minimum(ts[ids] + dur[ids], ts[at] + dur[at]) - np.maximum(ts[ids], ts[at])
    return CastReport(
        ids=ids,
        op=names.codes[ids],
        cause=cause[:n],
        cause_ids=cause_ids,
        module=module[:n],
        forward_ids=np.where(forward >= 0, ids[np.maximum(forward, 0)], -1),
        pair=pair,
        shape=shape,
        cpu_us=dur[ids],
        gpu_us=gpu_us[ids],
        cause_cpu_us=np.where(caused, dur[at], 0.0),
        cause_gpu_us=np.where(caused, gpu_us[at], 0.0),
        inside_us=np.where(caused, np.maximum(inside, 0.0), dur[ids]),
        backward=backward[:n],
        names=names.values,
        causes=causes,
        modules=modules,
        pairs=pairs,
        shapes=[s for _, s in described],
        step_us=_steps_us(tree),
        step_gpu_us=_steps_gpu_us(tree),
        fused=fused,
        source=tree.trace.source,
        gpu=bool(tree.gpu_work.any()),
        untyped=untyped,
        notes=tuple(_lacks(tree, n, untyped, ended)),
    )


def _lacks(tree: Tree, n: int, untyped: int, ended: int) -> list[str]:
    """What the trace lacked that the report would have used, and what it got wrong."""
    notes = []
    if ended:
        notes.append(
            f"the trace's Python events overlap: {ended:,} casts nest under a module or line "
            "whose event had ended before they began, and are blamed on what holds them in time"
        )
    if untyped:
        notes.append(
            f"{untyped} copy chains name no dtypes (recorded without record_shapes): they may "
            "be casts and are not counted"
        )
    python = tree.in_category(PYTHON.__eq__)
    if n and not (python & tree.included).any():
        notes.append(
            "causes are ops: the tree was built without its python_function events "
            "(python=True names modules and lines)"
            if python.any()
            else "causes are ops: the trace has no Python stack (record with with_stack=True "
            "to name modules and lines)"
        )
    return notes

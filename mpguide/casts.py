"""Find every dtype conversion in a call tree, what caused it and what it cost.

A cast is a chain of ``aten::to`` / ``aten::_to_copy`` / ``aten::copy_`` nodes whose source
and target dtypes differ: ``copy_`` names both in its ``Input type`` (target first), and
``to`` / ``_to_copy`` name the target in ``Concrete Inputs`` as a ScalarType code. Convert
kernels of compiled code (``..._to_copy...`` in a kernel's name) are casts whose dtypes the
trace does not record. Each cast is reported once, at the top of its chain, with the op that
caused it: the nearest ancestor that is neither a cast nor a Python frame.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape
from operator import attrgetter
from typing import Any, NamedTuple

import msgspec
import numpy as np

from mpguide.table import Table
from mpguide.trace import ANNOTATION, OP, PYTHON, Node, Tree, paused_gc

CAST_OPS = frozenset({"aten::to", "aten::_to_copy", "aten::copy_"})
COMPILED_MARKS = ("_to_copy", "convert_element_type")
BACKWARD_MARK = "autograd::engine::evaluate_function"
STEP_MARK = "ProfilerStep#"

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
# The C++ type names the profiler writes in ``Input type``.
CPP_TYPES = {
    "unsigned char": "uint8",
    "signed char": "int8",
    "short int": "int16",
    "int": "int32",
    "long int": "int64",
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
_ATTRIBUTES = {"pass": "pass_"}
SUMMARY_KEYS = {
    "cause": ("cause",),
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


class _OpArgs(msgspec.Struct, gc=False):
    types: list[Any] | None = msgspec.field(default=None, name="Input type")
    dims: list[msgspec.Raw] | None = msgspec.field(default=None, name="Input Dims")
    concrete: list[Any] | None = msgspec.field(default=None, name="Concrete Inputs")


_OP_ARGS = msgspec.json.Decoder(_OpArgs)
_SHAPE = msgspec.json.Decoder(tuple[int, ...])


def _at(items: list | None, i: int) -> Any:
    return items[i] if items is not None and len(items) > i else None


def _dtypes(name: str, args: _OpArgs) -> tuple[str, str]:
    """(source, target) dtype of a cast op, ``'?'`` where the trace does not say."""
    if name == "aten::copy_":
        dst, src = _at(args.types, 0), _at(args.types, 1)
        return (dtype_of(src) if src else UNKNOWN), (dtype_of(dst) if dst else UNKNOWN)
    src = _at(args.types, 0)
    code = _at(args.concrete, 1)
    target = _scalar_type(code) if isinstance(code, str) and code else None
    return (dtype_of(src) if src else UNKNOWN), (target or UNKNOWN)


def _direction(source: str, target: str) -> str:
    a, b = ITEMSIZE.get(source), ITEMSIZE.get(target)
    if a is None or b is None:
        return UNKNOWN
    return DOWN if b < a else UP if b > a else SIDEWAYS


def _is_compiled_convert(name: str) -> bool:
    return not name.startswith("aten::") and any(m in name for m in COMPILED_MARKS)


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

    @property
    def direction(self) -> str:
        return _direction(self.source, self.target)

    @property
    def pass_(self) -> str:
        return "backward" if self.backward else "forward"


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
)


def _cell(cast: Cast) -> tuple:
    return (
        cast.id,
        cast.op,
        cast.cause,
        cast.pass_,
        cast.source,
        cast.target,
        cast.direction,
        "x".join(map(str, cast.shape)) if cast.shape is not None else None,
        cast.bytes_read,
        cast.bytes_written,
        round(cast.cpu_us, 3),
        round(cast.gpu_us, 3),
        None if cast.share is None else round(cast.share, 4),
    )


@dataclass(frozen=True)
class CastReport:
    """Every cast found in a tree, with the time of the profiled steps they fall in."""

    casts: tuple[Cast, ...]
    step_us: float
    source: str = ""
    cause_time: dict[int, tuple[float, float]] = field(default_factory=dict, repr=False)
    gpu: bool = False

    def __len__(self) -> int:
        return len(self.casts)

    def __iter__(self):
        return iter(self.casts)

    def _fit(self, table: Table) -> Table:
        """Without the GPU columns when the trace has no GPU events."""
        if self.gpu:
            return table
        keep = [i for i, c in enumerate(table.columns) if "gpu" not in c]
        rows = tuple(tuple(r[i] for i in keep) for r in table.rows)
        return Table(tuple(table.columns[i] for i in keep), rows, table.caption, table.notes)

    def table(self) -> Table:
        """One row per cast (GPU time only when the trace has GPU events)."""
        n = len(self.casts)
        return self._fit(
            Table(
                COLUMNS,
                tuple(_cell(c) for c in self.casts),
                caption=f"{n} cast{'' if n == 1 else 's'} in {self.source or 'the trace'}",
            )
        )

    @paused_gc()
    def summary(self, by: str = "cause") -> Table:
        """Casts aggregated by ``cause``, ``pair`` (source and target), ``direction`` or
        ``pass``: count, bytes, CPU and GPU time, and share of the profiled steps.

        By cause, ``op cpu us`` and ``op gpu us`` are the time of the causing ops less the
        casts in them, to set a cast's cost against the work of the op that asked for it.
        """
        if by not in SUMMARY_KEYS:
            raise ValueError(f"unknown summary {by!r}; choose one of {', '.join(SUMMARY_KEYS)}")
        keys = SUMMARY_KEYS[by]
        key_of = attrgetter(*(_ATTRIBUTES.get(k, k) for k in keys))
        groups: dict[Any, list[Cast]] = {}
        for c in self.casts:
            groups.setdefault(key_of(c), []).append(c)
        extra = ("op cpu us", "op gpu us") if by == "cause" else ()
        columns = (*keys, "casts", "bytes written", "cpu us", "gpu us", *extra, "share of step")
        totals = []
        for key, members in groups.items():
            cpu = sum(map(attrgetter("cpu_us"), members))
            totals.append((key if len(keys) > 1 else (key,), members, cpu))
        rows = []
        for key, members, cpu in sorted(totals, key=lambda t: -t[2]):
            row = [
                *key,
                len(members),
                sum(filter(None, map(attrgetter("bytes_written"), members))),
                round(cpu, 3),
                round(sum(map(attrgetter("gpu_us"), members)), 3),
            ]
            if by == "cause":
                own = [self.cause_time.get(i, (0.0, 0.0)) for i in {c.cause_id for c in members}]
                row += [round(sum(t[0] for t in own), 3), round(sum(t[1] for t in own), 3)]
            row.append(round(cpu / self.step_us, 4) if self.step_us else None)
            rows.append(tuple(row))
        return self._fit(Table(columns, tuple(rows), caption=f"casts by {by}"))

    def __repr__(self) -> str:
        return self.summary("cause").to_text()

    def _repr_html_(self) -> str:
        n = len(self.casts)
        head = escape(f"{n} cast{'' if n == 1 else 's'} in {self.step_us:.1f} us of profiled steps")
        return f"<p>{head}</p>{self.summary('cause').to_html()}{self.summary('pair').to_html()}"


def _converts(tree: Tree, top: int, args: _OpArgs) -> tuple[str, str] | None:
    """(source, target) of the cast chain under ``top`` if it converts, else None."""
    events = tree.trace.events
    source, target = _dtypes(events[top].name, args)
    if UNKNOWN not in (source, target):
        return (source, target) if source != target else None
    for node in Node(tree, top).walk():
        if node.name == "aten::copy_":
            pair = _dtypes(node.name, _OP_ARGS.decode(node.event.args))
            if pair[0] != pair[1]:
                return pair
    return None


def _steps(tree: Tree) -> np.ndarray:
    """Mask of the ``ProfilerStep#N`` ranges."""
    return tree.in_category(ANNOTATION.__eq__) & tree.named(lambda n: n.startswith(STEP_MARK))


def _contexts(tree: Tree, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each cast's causing ancestor (-1 for none), and whether it runs in backward; the
    ancestors of all casts are walked together, one level per step."""
    skip = tree.named(CAST_OPS.__contains__) | tree.in_category(PYTHON.__eq__) | _steps(tree)
    in_backward = tree.named(lambda n: n.startswith(BACKWARD_MARK))
    cause = np.full(len(ids), -1, dtype=np.int64)
    backward = np.zeros(len(ids), dtype=bool)
    up = tree.parent[ids]
    live = np.flatnonzero(up >= 0)
    while len(live):
        a = up[live]
        backward[live] |= in_backward[a]
        found = (cause[live] < 0) & ~skip[a]
        cause[live[found]] = a[found]
        up[live] = tree.parent[a]
        live = live[up[live] >= 0]
    return cause, backward


def _shape(args: _OpArgs) -> tuple[int, ...] | None:
    """The first input's shape; only its ``Input Dims`` entry is decoded."""
    dims = _at(args.dims, 0)
    try:
        return None if dims is None else _SHAPE.decode(dims)
    except msgspec.ValidationError:
        return None


def _steps_us(tree: Tree) -> float:
    steps = _steps(tree) & tree.included
    if steps.any():
        return sum(tree.dur_us[steps].tolist())
    return sum(n.dur for nodes in tree.roots().values() for n in nodes if n.cat in (OP, ANNOTATION))


@paused_gc()
def report(tree: Tree) -> CastReport:
    """Every cast in ``tree``: a chain of cast ops whose dtypes differ, or a compiled convert
    kernel. Share is CPU time over the time of the profiled steps (``ProfilerStep#N``) or,
    without steps, of the top-level ops."""
    events = tree.trace.events
    is_cast_op = tree.named(CAST_OPS.__contains__)
    under_cast = np.zeros_like(is_cast_op)
    has_parent = tree.parent >= 0
    under_cast[has_parent] = is_cast_op[tree.parent[has_parent]]
    tops = (is_cast_op & ~under_cast) | tree.named(_is_compiled_convert)
    ids = tree.order[tops[tree.order]]
    step_us = _steps_us(tree)
    cause_ids, backwards = _contexts(tree, ids)
    dur, gpu = tree.dur_us, tree.gpu_us
    found = zip(
        ids.tolist(),
        cause_ids.tolist(),
        backwards.tolist(),
        dur[ids].tolist(),
        gpu[ids].tolist(),
        dur[cause_ids].tolist(),
        gpu[cause_ids].tolist(),
        strict=True,
    )
    casts: list[Cast] = []
    causes: dict[int, tuple[float, float]] = {}
    for i, cause, backward, cpu_us, gpu_us, cause_cpu_us, cause_gpu_us in found:
        name = events[i].name
        args = _OP_ARGS.decode(events[i].args)
        pair = _converts(tree, i, args) if name in CAST_OPS else (UNKNOWN, UNKNOWN)
        if pair is None:
            continue
        shape = _shape(args)
        numel = math.prod(shape) if shape is not None else None
        size_in, size_out = ITEMSIZE.get(pair[0]), ITEMSIZE.get(pair[1])
        if cause >= 0:
            own = causes.get(cause, (cause_cpu_us, cause_gpu_us))
            causes[cause] = (own[0] - cpu_us, own[1] - gpu_us)
        casts.append(
            Cast(
                i,
                name,
                events[cause].name if cause >= 0 else "(top level)",
                cause if cause >= 0 else None,
                pair[0],
                pair[1],
                shape,
                numel * size_in if numel is not None and size_in else None,
                numel * size_out if numel is not None and size_out else None,
                cpu_us,
                gpu_us,
                cpu_us / step_us if step_us else None,
                backward,
            )
        )
    return CastReport(tuple(casts), step_us, tree.trace.source, causes, bool(tree.gpu_work.any()))

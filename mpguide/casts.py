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
from dataclasses import dataclass
from functools import cached_property
from html import escape
from operator import attrgetter
from typing import Any, NamedTuple

import msgspec
import numpy as np

from mpguide import MPGuideError
from mpguide.calltree import ANNOTATION, OP, PYTHON, Node, Tree
from mpguide.columns import codes
from mpguide.table import Table
from mpguide.trace import paused_gc

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


_NULL = msgspec.Raw(b"null")


class _CastArgs(msgspec.Struct, gc=False):
    """The ``args`` entries that name a cast's dtypes and shape, left undecoded."""

    types: msgspec.Raw = msgspec.field(default=_NULL, name="Input type")
    concrete: msgspec.Raw = msgspec.field(default=_NULL, name="Concrete Inputs")
    dims: msgspec.Raw = msgspec.field(default=_NULL, name="Input Dims")


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
    elif name in CAST_OPS:
        code = _at(_list(concrete), 1)
        src, dst = _at(types_, 0), _scalar_type(code) if isinstance(code, str) and code else None
    else:
        src = dst = None
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


def _is_compiled_convert(name: str) -> bool:
    return not name.startswith("aten::") and any(m in name for m in COMPILED_MARKS)


def needs_args(name: str) -> bool:
    """Whether the report reads the ``args`` of events with this name: pass it to
    :func:`mpguide.trace.load` as ``args_of`` to keep only those."""
    return name in CAST_OPS or _is_compiled_convert(name)


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


@dataclass(frozen=True, eq=False)
class CastReport:
    """Every cast found in a tree, as one array per column, with the time of the profiled
    steps they fall in. :attr:`casts` lists them one by one; the summaries are computed on
    the columns.

    Per cast: ``ids`` (node id), ``op`` and ``cause`` (indexes into ``names``),
    ``cause_ids`` (-1 at top level), ``pair`` (index into ``pairs``), ``shape`` (index into
    ``shapes``), ``cpu_us`` and ``gpu_us``, the causing op's own ``cause_cpu_us`` and
    ``cause_gpu_us``, and ``backward``.
    """

    ids: np.ndarray
    op: np.ndarray
    cause: np.ndarray
    cause_ids: np.ndarray
    pair: np.ndarray
    shape: np.ndarray
    cpu_us: np.ndarray
    gpu_us: np.ndarray
    cause_cpu_us: np.ndarray
    cause_gpu_us: np.ndarray
    backward: np.ndarray
    names: list[str]
    pairs: list[tuple[str, str]]
    shapes: list[tuple[int, ...] | None]
    step_us: float
    source: str = ""
    gpu: bool = False

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self):
        return iter(self.casts)

    def _bytes(self) -> tuple[np.ndarray, np.ndarray]:
        """Bytes read and written per cast, NaN where the size or shape is unknown."""
        numel = np.array([math.nan if s is None else math.prod(s) for s in self.shapes], float)
        size_in, size_out = (
            np.array([ITEMSIZE.get(p[k], math.nan) for p in self.pairs], float) for k in (0, 1)
        )
        n = numel[self.shape]
        return n * size_in[self.pair], n * size_out[self.pair]

    @cached_property
    def casts(self) -> tuple[Cast, ...]:
        """One :class:`Cast` per row."""
        names, pairs, shapes = self.names, self.pairs, self.shapes
        read, written = (list(map(_count, b.tolist())) for b in self._bytes())
        pair = [pairs[k] for k in self.pair.tolist()]
        cpu = self.cpu_us.tolist()
        share = [c / self.step_us for c in cpu] if self.step_us else [None] * len(cpu)
        columns = (
            self.ids.tolist(),
            [names[k] for k in self.op.tolist()],
            [names[k] for k in self.cause.tolist()],
            [None if i < 0 else i for i in self.cause_ids.tolist()],
            [p[0] for p in pair],
            [p[1] for p in pair],
            [shapes[k] for k in self.shape.tolist()],
            read,
            written,
            cpu,
            self.gpu_us.tolist(),
            share,
            self.backward.tolist(),
        )
        return tuple(map(Cast._make, zip(*columns, strict=True)))

    def _fit(self, table: Table) -> Table:
        """Without the GPU columns when the trace has no GPU events."""
        if self.gpu:
            return table
        keep = [i for i, c in enumerate(table.columns) if "gpu" not in c]
        rows = tuple(tuple(r[i] for i in keep) for r in table.rows)
        return Table(tuple(table.columns[i] for i in keep), rows, table.caption, table.notes)

    def table(self) -> Table:
        """One row per cast (GPU time only when the trace has GPU events)."""
        n, names, pairs = len(self), self.names, self.pairs
        pair = self.pair.tolist()
        direction = [_direction(*p) for p in pairs]
        shape = ["x".join(map(str, s)) if s is not None else None for s in self.shapes]
        cpu = self.cpu_us.tolist()
        read, written = (list(map(_count, b.tolist())) for b in self._bytes())
        cells = {
            "id": self.ids.tolist(),
            "op": [names[k] for k in self.op.tolist()],
            "cause": [names[k] for k in self.cause.tolist()],
            "pass": [("forward", "backward")[b] for b in self.backward.tolist()],
            "source": [pairs[k][0] for k in pair],
            "target": [pairs[k][1] for k in pair],
            "direction": [direction[k] for k in pair],
            "shape": [shape[k] for k in self.shape.tolist()],
            "bytes read": read,
            "bytes written": written,
            "cpu us": [round(c, 3) for c in cpu],
            "gpu us": [round(g, 3) for g in self.gpu_us.tolist()],
            "share of step": [round(c / self.step_us, 4) for c in cpu]
            if self.step_us
            else [None] * n,
        }
        columns = tuple(c for c in COLUMNS if self.gpu or "gpu" not in c)
        caption = f"{n} cast{'' if n == 1 else 's'} in {self.source or 'the trace'}"
        return Table(columns, tuple(zip(*(cells[c] for c in columns), strict=True)), caption)

    def _groups(self, by: str) -> tuple[np.ndarray, list[tuple]]:
        """Each cast's group under ``by``, and each group's key cells."""
        if by == "cause":
            return self.cause, [(n,) for n in self.names]
        if by == "pair":
            return self.pair, self.pairs
        if by == "pass":
            return self.backward.astype(np.int64), [("forward",), ("backward",)]
        direction, labels = codes((_direction(*p) for p in self.pairs), len(self.pairs))
        return direction[self.pair], [(d,) for d in labels]

    def summary(self, by: str = "cause") -> Table:
        """Casts aggregated by ``cause``, ``pair`` (source and target), ``direction`` or
        ``pass``: count, bytes, CPU and GPU time, and share of the profiled steps, largest
        CPU time first.

        By cause, ``op cpu us`` and ``op gpu us`` are the time of the causing ops less the
        casts in them, to set a cast's cost against the work of the op that asked for it.
        """
        if by not in SUMMARY_KEYS:
            raise ValueError(f"unknown summary {by!r}; choose one of {', '.join(SUMMARY_KEYS)}")
        group, labels = self._groups(by)
        present, first, which = np.unique(group, return_index=True, return_inverse=True)
        k = len(present)
        count = np.bincount(which, minlength=k)
        written = np.bincount(which, np.nan_to_num(self._bytes()[1]), k)
        cpu = np.bincount(which, self.cpu_us, k)
        gpu = np.bincount(which, self.gpu_us, k)
        columns = [present, count, written, cpu, gpu]
        if by == "cause":
            columns += self._own_time(present)
        rows = []
        for key, n, w, c, g, *own in zip(*(x.tolist() for x in columns), strict=True):
            share = round(c / self.step_us, 4) if self.step_us else None
            times = [round(t, 3) for t in (c, g, *own)]
            rows.append((*labels[key], n, int(w), *times, share))
        rows = [rows[i] for i in np.lexsort((first, -cpu)).tolist()]
        extra = ("op cpu us", "op gpu us") if by == "cause" else ()
        keys = SUMMARY_KEYS[by]
        columns = (*keys, "casts", "bytes written", "cpu us", "gpu us", *extra, "share of step")
        return self._fit(Table(columns, tuple(rows), caption=f"casts by {by}"))

    def _own_time(self, present: np.ndarray) -> list[np.ndarray]:
        """Per cause in ``present``, the CPU and GPU time of its ops less their casts."""
        ops, first, which = np.unique(self.cause_ids, return_index=True, return_inverse=True)
        at = np.searchsorted(present, self.cause[first])
        out = []
        for own, cast in ((self.cause_cpu_us, self.cpu_us), (self.cause_gpu_us, self.gpu_us)):
            per_op = own[first] - np.bincount(which, cast, len(ops))
            out.append(np.bincount(at, np.where(ops >= 0, per_op, 0.0), len(present)))
        return out

    def __repr__(self) -> str:
        return self.summary("cause").to_text()

    def _repr_html_(self) -> str:
        n = len(self)
        head = escape(f"{n} cast{'' if n == 1 else 's'} in {self.step_us:.1f} us of profiled steps")
        return f"<p>{head}</p>{self.summary('cause').to_html()}{self.summary('pair').to_html()}"


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
    is_cast_op = tree.named(CAST_OPS.__contains__)
    under_cast = np.zeros_like(is_cast_op)
    has_parent = tree.parent >= 0
    under_cast[has_parent] = is_cast_op[tree.parent[has_parent]]
    tops = (is_cast_op & ~under_cast) | tree.named(_is_compiled_convert)
    ids = tree.order[tops[tree.order]]
    names = tree.trace.name
    raws = b"[" + b",".join(tree.trace.args.raws(ids)) + b"]"
    args = _cast_args(_CAST_ARGS_LIST, raws, tree.trace.source)
    top_names = map(names.values.__getitem__, names.codes[ids].tolist())
    shape, keys = codes(map(_key, top_names, args), len(ids))
    described = [_describe(*key) for key in keys]
    pair_of_key, pairs = codes((p for p, _ in described), len(described))
    pair = pair_of_key[shape]
    known = np.array([UNKNOWN not in p for p in pairs], dtype=bool)[pair]
    same = np.array([p[0] == p[1] for p in pairs], dtype=bool)[pair]
    cast_op = is_cast_op[ids]
    kept = ~cast_op | (known & ~same)
    pairs = list(pairs)
    for k in np.flatnonzero(cast_op & ~known).tolist():
        found = _chain_pair(tree, int(ids[k]))
        if found is not None:
            kept[k] = True
            pairs.append(found)
            pair[k] = len(pairs) - 1
    ids, pair, shape = ids[kept], pair[kept], shape[kept]
    cause_ids, backward = _contexts(tree, ids)
    caused = cause_ids >= 0
    name_code, names = tree.trace.name
    dur, gpu = tree.dur_us, tree.gpu_us
    return CastReport(
        ids=ids,
        op=name_code[ids],
        cause=np.where(caused, name_code[cause_ids], len(names)),
        cause_ids=cause_ids,
        pair=pair,
        shape=shape,
        cpu_us=dur[ids],
        gpu_us=gpu[ids],
        cause_cpu_us=np.where(caused, dur[cause_ids], 0.0),
        cause_gpu_us=np.where(caused, gpu[cause_ids], 0.0),
        backward=backward,
        names=[*names, "(top level)"],
        pairs=pairs,
        shapes=[s for _, s in described],
        step_us=_steps_us(tree),
        source=tree.trace.source,
        gpu=bool(tree.gpu_work.any()),
    )

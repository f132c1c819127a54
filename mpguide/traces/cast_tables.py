"""The cast report (:class:`CastReport`, with its fused casts, :class:`FusedCasts`): one
row per cast or summaries by cause, module, dtype pair, direction or pass, as tables, and the
text a person reads of them (:func:`readable`). :func:`mpguide.traces.casts.report` makes it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from html import escape

import numpy as np

from mpguide import MPGuideError
from mpguide.core.table import Table
from mpguide.core.units import duration_text
from mpguide.traces.cast_kinds import (
    FOLDED,
    FUSED_KINDS,
    ITEMSIZE,
    NO_LAUNCH,
    NO_MODULE,
    SUMMARY_KEYS,
    Cast,
    _direction,
)
from mpguide.traces.columns import codes

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
    "kernels launched during those steps, by any thread (autograd's backward thread too; GPU "
    "columns only when the trace has kernels). json and "
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


def _unlaunched_note(fused: FusedCasts, listed: str) -> list[str]:
    """The sentence on the cast kernels whose launch is not in the trace, when there are
    some: they are not fused casts, and ``listed`` says where they are shown."""
    unlaunched = fused.unlaunched
    if not unlaunched.any():
        return []
    us = float(fused.us[unlaunched].sum())
    return [
        f"{int(unlaunched.sum())} more cast kernels ({duration_text(us)}) were launched before "
        f"the trace began (a previous step's copies): not fused casts, not counted; {listed} "
        + NO_LAUNCH
    ]


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
    kernel's own duration) and ``gpu`` (whether it ran on the device). ``cpu_only`` counts
    the CPU events of a trace with GPU work that are named like fused cast kernels but
    launched no GPU work (a graph capture's ops, whose kernels run at replay), and
    ``cpu_only_us`` is their CPU time: they are not kernel time, and not rows."""

    ids: np.ndarray
    kind: np.ndarray
    kernel: np.ndarray
    cause: np.ndarray
    backward: np.ndarray
    us: np.ndarray
    gpu: np.ndarray
    kernels: list[str]
    causes: list[str]
    cpu_only: int = 0
    cpu_only_us: float = 0.0

    def __len__(self) -> int:
        return len(self.ids)

    def cpu_only_note(self) -> list[str]:
        """The sentence on the CPU events named like fused cast kernels that launched no GPU
        work, when there are some."""
        if not self.cpu_only:
            return []
        text = (
            f"{self.cpu_only:,} CPU events named like fused cast kernels launched no GPU work "
            f"({duration_text(self.cpu_only_us)} of CPU time; in a CUDA or HIP graph's capture "
            "their kernels run later, at replay): not counted as kernel time"
        )
        return [text]

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
        last = np.zeros(k, bool)  # the kernels launched before the trace, after the others
        if NO_LAUNCH in self.causes:
            last = present // 2 % n_c == self.causes.index(NO_LAUNCH)
        rows = [rows[i] for i in np.lexsort((first, -us, last)).tolist()]
        columns = ("kernel", "kind", "cause", "pass", "device", "kernels", "kernel us")
        unlaunched = self.unlaunched
        n = len(self) - int(unlaunched.sum())
        caption = (
            f"{n} fused cast kernel{'' if n == 1 else 's'}, "
            f"{duration_text(float(self.us[~unlaunched].sum()))}: their dtypes are not in the "
            "trace, their time is the whole kernel's"
            if n
            else "no fused cast kernels launched in the trace"
        )
        notes = _unlaunched_note(self, "listed last, as") + self.cpu_only_note()
        return _limited(columns, rows, [], limit, caption, notes)

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
        ``gpu``, the casts' kernel time over the kernel time launched during the steps by
        any thread (:func:`mpguide.traces.casts.launched_in_steps`), else
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
            where = "are not in these rows" if len(self) else "are not cast ops"
            notes.append(
                f"{fused} casts fused into kernels ({duration_text(us)} of kernel time) {where}: "
                "--by fused lists them"
            )
        notes += _unlaunched_note(self.fused, "--by fused lists them apart, as")
        return notes + self.fused.cpu_only_note()

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
        casts of 0-d tensors are folded into one row: one row per cast is in time order and
        the folded row comes last (``limit`` caps the others), a summary sorts it with the
        others."""
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
        folded into one row (:data:`FOLDED`), sorted with the others; ``limit`` caps the
        rows.

        By cause, ``dtypes`` names the directions of each row's casts, most first, and
        ``cause cpu us`` and ``cause gpu us`` are the time of the causing nodes (op, module
        or frame) less the casts in them, to set a cast's cost against the work of what asked
        for it (blank where the casts have no causing node). ``gpu share of step`` is the
        GPU time over that of the kernels launched during the profiled steps, by any thread.
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
        if folded:  # sorted with the others by CPU time, after those of as much
            cpu_at = names_fit.index("cpu us")
            at = sum(r[cpu_at] >= folded[0][cpu_at] for r in rows)
            rows = [*rows[:at], *folded, *rows[at:]]
        notes = self._notes(bool(np.isnan(written_all).any()))
        return _limited(names_fit, rows, [], limit, f"casts by {by}", notes)

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

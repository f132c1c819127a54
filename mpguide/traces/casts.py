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

import re
from operator import attrgetter
from typing import NamedTuple

import msgspec
import numpy as np

from mpguide import MPGuideError
from mpguide.core.cast_rule import is_cast
from mpguide.traces.calltree import (
    MODULE_MARK,
    PYTHON,
    RUNTIME_CATEGORIES,
    Node,
    Tree,
    frame_place,
    module_class,
)
from mpguide.traces.cast_kinds import (
    _CAST_ARGS,
    BACKWARD_MARK,
    CAST_OPS,
    CPP_TYPES,
    DOWN,
    FOLDED,
    FUSED_KINDS,
    ITEMSIZE,
    NO_LAUNCH,
    NO_MODULE,
    SCALAR_TYPES,
    SIDEWAYS,
    SUMMARY_KEYS,
    TO_COPY_BACKWARD,
    TOP_LEVEL,
    UNKNOWN,
    UP,
    Cast,
    _describe,
    _keys,
    dtype_of,
    fused_kind,
    kernel_label,
    needs_args,
)
from mpguide.traces.cast_tables import (
    COLUMNS,
    LEGEND,
    CastReport,
    FusedCasts,
    bytes_text,
    pair_label,
    percent_text,
    readable,
)
from mpguide.traces.columns import codes
from mpguide.traces.trace import paused_gc

__all__ = [
    "BACKWARD_MARK",
    "CAST_OPS",
    "COLUMNS",
    "CPP_TYPES",
    "DOWN",
    "FOLDED",
    "FUSED_KINDS",
    "ITEMSIZE",
    "LEGEND",
    "NO_LAUNCH",
    "NO_MODULE",
    "SCALAR_TYPES",
    "SIDEWAYS",
    "SUMMARY_KEYS",
    "TOP_LEVEL",
    "TO_COPY_BACKWARD",
    "UNKNOWN",
    "UP",
    "Cast",
    "CastReport",
    "FusedCasts",
    "bytes_text",
    "dtype_of",
    "fused_kind",
    "kernel_label",
    "launched_in_steps",
    "needs_args",
    "pair_label",
    "percent_text",
    "readable",
    "report",
]


def _chain_pair(tree: Tree, top: int) -> tuple[str, str] | None:
    """(source, target) of the first copy_ in the chain under ``top`` that converts."""
    for node in Node(tree, top).walk():
        if node.name == "aten::copy_":
            (args,) = _cast_args([node.tree.trace.args.raw(node.id)], tree.trace.source)
            pair = _describe(*next(_keys([node.name], [args])))[0]
            if is_cast(*pair):
                return pair
    return None


def _cast_args(raws: list[bytes], source: str) -> list:
    """The cast entries of each ``args`` JSON (one decode each: faster than one of the
    joined list)."""
    try:
        return list(map(_CAST_ARGS.decode, raws))
    except msgspec.ValidationError as err:
        raise MPGuideError(
            f"{source or 'trace'}: a cast op's args are not usable ({err})"
        ) from None


def launched_in_steps(tree: Tree) -> np.ndarray:
    """Mask of the GPU work (kernels, memcpys, memsets) whose launch started during a
    profiled step (a ``ProfilerStep#N`` range) of its process, on any of its threads:
    autograd's engine thread launches the backward kernels inside the step's time but not
    under its node. GPU work whose launch is not in the trace is not counted."""
    out = np.zeros(len(tree.parent), bool)
    steps = np.flatnonzero(tree.step_mask())
    work = np.flatnonzero(tree.gpu_work & (tree.parent >= 0))
    launch = tree.parent[work].astype(np.int64)
    launched = tree.in_category(RUNTIME_CATEGORIES.__contains__)[launch]
    work, launch = work[launched], launch[launched]  # not a GPU event nested in a GPU range
    if not (len(steps) and len(work)):
        return out
    ts, pid = tree.trace.ts, tree.trace.pid.codes
    inside = np.zeros(len(work), bool)
    for p in np.unique(pid[steps]).tolist():
        mine = steps[pid[steps] == p]
        mine = mine[np.argsort(ts[mine], kind="stable")]
        start = ts[mine]
        reach = np.maximum.accumulate(start + tree.dur_us[mine])  # overlapping steps too
        at = np.flatnonzero(pid[launch] == p)
        when = ts[launch[at]]
        k = np.searchsorted(start, when, side="right") - 1
        inside[at] = (k >= 0) & (when < reach[np.maximum(k, 0)])
    out[work[inside]] = True
    return out


def _steps_gpu_us(tree: Tree) -> float | None:
    """The time of the GPU work launched during the profiled steps
    (:func:`launched_in_steps`), None without steps or GPU work launched in them."""
    return sum(tree.dur_us[launched_in_steps(tree)].tolist()) or None


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
    # Where the trace's Python events overlap, nesting can put a cast under a module or
    # frame that had ended before it began: the innermost one that holds the cast in time is
    # its cause, found by climbing. GPU kernels run after their launch, out of the CPU
    # events' time: only the CPU's are held.
    ts, end = tree.trace.ts, tree.trace.ts + tree.dur_us
    cpu = ~tree.gpu_work[ids]
    ended = np.zeros(len(ids), bool)
    for above, mask in ((found.module, module), (found.frame, frame)):
        climbing = np.flatnonzero(above >= 0)
        while len(climbing):
            at, mine = above[climbing], ids[climbing]
            gone = cpu[climbing] & ((ts[at] > ts[mine]) | (end[mine] > end[at]))
            climbing = climbing[gone]
            ended[climbing] = True
            (above[climbing],) = tree.nearest(above[climbing], mask)
            climbing = climbing[above[climbing] >= 0]
    # What lies above the Python code (a range such as a step's) or above the backward node
    # (the Python code that called backward()) is context, not cause.
    depth = np.append(tree.depth, tree.depth.dtype.type(-1))
    found.op[depth[found.op] < np.maximum(depth[found.module], depth[found.frame])] = -1
    for above in (found.module, found.frame):
        above[depth[above] < depth[found.grad]] = -1
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
    base = len(name.values) + 1
    if base**3 < 2**62:  # the three codes as one integer: unique on rows sorts far slower
        whole = ((parts[0] + np.int64(1)) * base + parts[1] + 1) * base + parts[2] + 1
        distinct, key = np.unique(whole, return_inverse=True)
        keys = np.stack([distinct // base**2, distinct // base % base, distinct % base], 1) - 1
    else:
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


def _fused(tree: Tree) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The events whose name marks a fused cast, in time order, and their kind: kernels,
    and the CPU's kernels (CPU events that launched no GPU work: in a trace with GPU work,
    only inductor's C++ kernels, ``cpp_fused_...``); and apart, the other CPU events so
    named that launched no GPU work in a trace with GPU work: in a CUDA or HIP graph's
    capture these are capture-time ops whose kernels run later, at replay. A CPU event that
    launched GPU work is left to its kernels."""
    kinds = list(FUSED_KINDS)
    kind_of = [kinds.index(k) if (k := fused_kind(n)) else -1 for n in tree.trace.name.values]
    kind = np.array(kind_of, dtype=np.int8)[tree.trace.name.codes]
    frames = tree.in_category(lambda c: c == PYTHON or c in RUNTIME_CATEGORIES)
    candidate = (kind >= 0) & ~frames & tree.included
    idle = np.zeros_like(candidate)
    if candidate.any():
        on_gpu = tree.gpu_work[candidate]
        alone = ~on_gpu & (tree.gpu_us[candidate] == 0)
        if tree.gpu_work.any():
            cpu_kernel = tree.named(lambda n: n.startswith(_CPU_KERNEL))[candidate]
            idle[candidate] = alone & ~cpu_kernel
            candidate[candidate] = on_gpu | (alone & cpu_kernel)
        else:
            candidate[candidate] = alone
    ids = tree.order[candidate[tree.order]]
    return ids, kind[ids].astype(np.int64), np.flatnonzero(idle)


_CPU_KERNEL = "cpp_"
"""How inductor names the kernels it compiles for the CPU (``cpp_fused__to_copy_add_0``)."""


@paused_gc()
def report(tree: Tree) -> CastReport:
    """Every cast in ``tree``: a chain of cast ops whose dtypes differ, with its cause (see
    the module docs), and the casts fused into kernels. Share is CPU time over the time of
    the profiled steps (``ProfilerStep#N``), and GPU time over that of the GPU work launched
    during them (:func:`launched_in_steps`); unknown without them."""
    is_cast_op = tree.named(CAST_OPS.__contains__)
    under_cast = np.zeros_like(is_cast_op)
    has_parent = tree.parent >= 0
    under_cast[has_parent] = is_cast_op[tree.parent[has_parent]]
    tops = is_cast_op & ~under_cast
    ids = tree.order[tops[tree.order]]
    names = tree.trace.name
    args = _cast_args(tree.trace.args.raws(ids), tree.trace.source)
    sequence = np.fromiter(map(attrgetter("sequence"), args), np.int64, len(args))
    top_names = map(names.values.__getitem__, names.codes[ids].tolist())
    shape, keys = codes(_keys(top_names, args), len(ids))
    described = [_describe(*key) for key in keys]
    pair_of_key, pairs = codes((p for p, _ in described), len(described))
    pair = pair_of_key[shape]
    known = np.array([UNKNOWN not in p for p in pairs], dtype=bool)[pair]
    cast = np.array([is_cast(*p) for p in pairs], dtype=bool)[pair]
    nothing = np.array([p == (UNKNOWN, UNKNOWN) for p in pairs], dtype=bool)[pair]
    kept = known & cast
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
    fused_ids, fused_kinds, idle = _fused(tree)
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
        cpu_only=len(idle),
        cpu_only_us=float(dur[idle].sum()),
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

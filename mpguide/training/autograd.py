"""The autograd graph with the dtypes it recorded, a dispatch-mode dtype logger, master weights.

- :func:`grad_graph` walks ``grad_fn`` from a tensor and gives the autograd graph as a tree:
  each node with the metadata autograd recorded for the gradients it receives (dtype, shape,
  device), and the parameters behind ``AccumulateGrad`` leaves named.
- :class:`DtypeLog` is a :class:`mpguide.core.dtypes.Log` that records every ATen op run while it
  is active, in forward and in backward, with input and output dtypes and shapes, and marks
  the casts::

      with DtypeLog(model) as log:
          model(x).sum().backward()
      log.casts("backward")

  An op runs in the ``backward`` phase when the autograd engine runs it (inside a node's
  backward); every other op takes the current label, ``forward`` unless set with
  :meth:`DtypeLog.phase`. The ``ones_like`` seed that ``backward()`` makes before the engine
  starts is such an op. A ``torch.compile``'d function called inside the logger runs eagerly;
  call its forward outside and only its backward inside to log the compiled backward.

The autograd chapter's experiments build on these: :mod:`mpguide.training.casting` (the ways to cast a
module's parameters) and :mod:`mpguide.training.master_weights` (updates bf16 cannot hold).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from html import escape
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from mpguide import MPGuideError
from mpguide.core import dtypes
from mpguide.core.table import Table

FORWARD, BACKWARD = "forward", "backward"
# Bookkeeping ops (``record_function`` markers that optimizers emit) the log leaves out.
# The ops that convert dtype, and which argument is the source (the output is the target).

Params = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Meta:
    """A tensor's dtype, shape and device."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str

    @classmethod
    def of(cls, t: Any) -> Meta:
        """From a tensor, or from autograd's recorded input metadata."""
        return cls(t.dtype, tuple(int(s) for s in t.shape), str(t.device))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{dtypes.name(self.dtype)}[{', '.join(map(str, self.shape))}]"


def _names(params: Params | None) -> dict[int, str]:
    if params is None:
        return {}
    if isinstance(params, torch.nn.Module):
        params = params.named_parameters()
    elif isinstance(params, Mapping):
        params = params.items()
    return {id(t): name for name, t in params}


def _leaf_name(node: Any, names: dict[int, str]) -> str | None:
    """The parameter behind an ``AccumulateGrad`` node (``None`` for other nodes)."""
    var = getattr(node, "variable", None)
    if var is None:
        return None
    return names.get(id(var), "(unnamed leaf)")


# ---------------------------------------------------------------------------------------------
# grad_graph
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GradNode:
    """One autograd node: its name, the gradient metadata it records, the nodes it feeds.

    ``grad_in`` is what autograd checks and casts incoming gradients against: the metadata of
    the forward outputs the node belongs to. ``param`` names the parameter of an
    ``AccumulateGrad`` node. ``repeat`` marks a node shown before (the graph is a DAG).
    """

    name: str
    grad_in: tuple[Meta, ...]
    param: str | None = None
    children: tuple[GradNode, ...] = ()
    repeat: bool = False

    @property
    def short_name(self) -> str:
        """The name without its C++ namespace (``AccumulateGrad``)."""
        return self.name.rsplit("::", 1)[-1]

    def label(self) -> str:
        grads = ", ".join(f"{m} {m.device}" for m in self.grad_in)
        text = f"{self.short_name}  grad in: {grads}" if grads else self.short_name
        if self.param is not None:
            text += f"  <- {self.param}"
        return text + ("  (shown above)" if self.repeat else "")


@dataclass(frozen=True)
class GradGraph:
    """The autograd graph behind a tensor, as a tree from its ``grad_fn``."""

    root: GradNode

    def walk(self) -> Iterator[tuple[int, GradNode]]:
        """``(depth, node)`` for every node, repeats included, depth first from the root."""
        stack = [(0, self.root)]
        while stack:
            depth, n = stack.pop()
            yield depth, n
            stack.extend((depth + 1, c) for c in reversed(n.children))

    def nodes(self) -> list[GradNode]:
        """Every node once, depth first from the root."""
        return [n for _, n in self.walk() if not n.repeat]

    def find(self, name: str) -> list[GradNode]:
        """The nodes whose name ends with ``name`` (``AccumulateGrad`` matches the C++ name)."""
        return [n for n in self.nodes() if n.name.endswith(name)]

    def param(self, name: str) -> GradNode:
        """The ``AccumulateGrad`` node of one named parameter."""
        for n in self.nodes():
            if n.param == name:
                return n
        raise KeyError(name)

    def lines(self) -> list[str]:
        """The tree drawn with box characters, one node per line."""
        out: list[str] = []
        # Each entry: the node, the prefix its children continue, and its own connector.
        stack: list[tuple[GradNode, str, str]] = [(self.root, "", "")]
        while stack:
            n, prefix, connector = stack.pop()
            out.append(connector + n.label())
            last = len(n.children) - 1
            for i, c in reversed(list(enumerate(n.children))):
                tail = "└─ " if i == last else "├─ "
                stack.append((c, prefix + ("   " if i == last else "│  "), prefix + tail))
        return out

    def table(self) -> Table:
        """One row per node (repeats included), indented by depth."""
        rows = tuple(
            (
                "  " * depth + n.short_name,
                ", ".join(dtypes.name(m.dtype) for m in n.grad_in),
                ", ".join(str(list(m.shape)) for m in n.grad_in),
                ", ".join(m.device for m in n.grad_in),
                n.param or "",
            )
            for depth, n in self.walk()
        )
        return Table(
            ("node", "grad dtype", "grad shape", "device", "parameter"),
            rows,
            f"autograd graph, torch {torch.__version__}",
        )

    def __repr__(self) -> str:
        return "\n".join(self.lines())

    def _repr_html_(self) -> str:
        return f'<pre class="mpguide-tree">{escape(repr(self))}</pre>'


def grad_graph(output: torch.Tensor, params: Params | None = None) -> GradGraph:
    """Walk ``output.grad_fn`` and give the autograd graph as a tree.

    ``params`` (a module, a name->tensor mapping or ``named_parameters()``) names the leaves.
    """
    if not isinstance(output, torch.Tensor):
        raise MPGuideError(f"grad_graph takes a tensor, not {type(output).__name__}")
    if output.grad_fn is None:
        raise MPGuideError(
            "the tensor has no grad_fn: it is a leaf or was computed without autograd"
        )
    names = _names(params)

    def grad_in(node: Any) -> tuple[Meta, ...]:
        return tuple(Meta.of(m) for m in getattr(node, "_input_metadata", ()))

    def inputs(node: Any) -> Iterator[Any]:
        return (n for n, _ in node.next_functions if n is not None)

    # Iterative depth-first walk (deep models exceed Python's recursion limit). ``seen`` keeps
    # every node object alive, so that ``id`` identifies a node for the whole walk.
    seen: dict[int, Any] = {id(output.grad_fn): output.grad_fn}
    stack: list[tuple[Any, list[GradNode], Iterator[Any]]] = [
        (output.grad_fn, [], inputs(output.grad_fn))
    ]
    while True:
        node, children, pending = stack[-1]
        child = next(pending, None)
        if child is None:
            stack.pop()
            built = GradNode(node.name(), grad_in(node), _leaf_name(node, names), tuple(children))
            if not stack:
                return GradGraph(built)
            stack[-1][1].append(built)
        elif id(child) in seen:
            children.append(
                GradNode(child.name(), grad_in(child), _leaf_name(child, names), repeat=True)
            )
        else:
            seen[id(child)] = child
            stack.append((child, [], inputs(child)))


# ---------------------------------------------------------------------------------------------
# DtypeLog
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpRecord:
    """One ATen op as the logger saw it."""

    phase: str
    op: str
    inputs: tuple[Meta, ...]
    outputs: tuple[Meta, ...]
    node: str = ""
    param: str = ""

    @property
    def op_name(self) -> str:
        """The op without its ``.default`` overload, for tables."""
        return self.op.removesuffix(".default")

    @property
    def node_name(self) -> str:
        """The autograd node without its C++ namespace, for tables."""
        return self.node.rsplit("::", 1)[-1]

    @property
    def source(self) -> Meta | None:
        """The converted tensor, for a cast op."""
        i = dtypes.source_index(self.op)
        return self.inputs[i] if i is not None and len(self.inputs) > i else None

    @property
    def is_cast(self) -> bool:
        """A conversion between two floating dtypes."""
        src = self.source
        return (
            src is not None
            and bool(self.outputs)
            and src.dtype != self.outputs[0].dtype
            and src.dtype.is_floating_point
            and self.outputs[0].dtype.is_floating_point
        )

    @property
    def cast(self) -> str:
        """``float32->bfloat16`` for a cast, else ``''``."""
        if not self.is_cast:
            return ""
        src, dst = self.source.dtype, self.outputs[0].dtype
        return f"{dtypes.name(src)}->{dtypes.name(dst)}"

    @property
    def cast_bytes(self) -> int:
        """Bytes a cast reads and writes (0 for other ops)."""
        return self.source.nbytes + self.outputs[0].nbytes if self.is_cast else 0

    def signature(self) -> str:
        def dts(ms: tuple[Meta, ...]) -> str:
            return ", ".join(dtypes.name(m.dtype) for m in ms)

        return f"({dts(self.inputs)}) -> ({dts(self.outputs)})"


def _metas(value: Any) -> tuple[Meta, ...]:
    return tuple(Meta.of(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor))


class DtypeLog(dtypes.Log):
    """Records every ATen op run while active, with dtypes, shapes and phase; marks casts.

    Pass the model (or ``named_parameters()``) to name the parameters whose gradients a
    backward op produces. The log is read after the ``with`` block: :meth:`summary`,
    :meth:`casts`, :meth:`cast_bytes`, :meth:`per_param`, :meth:`table`.
    """

    def __init__(self, params: Params | None = None):
        super().__init__()
        self.records: list[OpRecord] = []
        self._names = _names(params)
        self._label = FORWARD

    @contextmanager
    def phase(self, label: str) -> Iterator[None]:
        """Label the ops run outside the autograd engine (``optimizer``, ``eval``, ...)."""
        before, self._label = self._label, label
        try:
            yield
        finally:
            self._label = before

    def _params_of(self, node: Any) -> str:
        own = _leaf_name(node, self._names)
        if own is not None:
            return own
        fed = (_leaf_name(n, self._names) for n, _ in node.next_functions if n is not None)
        return ", ".join(name for name in fed if name is not None)

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Keep one op as an :class:`OpRecord`, with its phase and autograd node."""
        node = torch._C._current_autograd_node()
        ins, outs = _metas((args, kwargs)), _metas(out)
        if node is None:
            self.records.append(OpRecord(self._label, str(func), ins, outs))
        else:
            name = node.name()
            self.records.append(
                OpRecord(BACKWARD, str(func), ins, outs, name, self._params_of(node))
            )

    def select(self, phase: str | None = None, casts: bool = False) -> list[OpRecord]:
        """The records of one phase (or all), optionally only the casts."""
        return [
            r
            for r in self.records
            if (phase is None or r.phase == phase) and (r.is_cast or not casts)
        ]

    def signatures(self, op: str, phase: str | None = None) -> list[str]:
        """The dtype signatures of every call of ``op`` (``aten.mm`` matches every overload)."""
        return [r.signature() for r in self.select(phase) if r.op.startswith(op)]

    def phases(self) -> list[str]:
        """The phases seen, in the order they first appeared."""
        return list(dict.fromkeys(r.phase for r in self.records))

    def cast_bytes(self, phase: str | None = None) -> int:
        """Bytes read and written by the casts of one phase (or all)."""
        return sum(r.cast_bytes for r in self.select(phase, casts=True))

    def table(self, phase: str | None = None, casts: bool = False) -> Table:
        """One row per op, in the order they ran."""
        rows = tuple(
            (
                r.phase,
                r.node_name,
                r.op_name,
                ", ".join(map(str, r.inputs)),
                ", ".join(map(str, r.outputs)),
                r.cast,
                r.param,
            )
            for r in self.select(phase, casts)
        )
        return Table(
            ("phase", "autograd node", "op", "inputs", "outputs", "cast", "parameter"),
            rows,
            self._caption(phase, "casts" if casts else "ops"),
        )

    def casts(self, phase: str | None = None) -> Table:
        """The casts, one row each, with the bytes each reads and writes."""
        rows = tuple(
            (r.phase, r.node_name, r.cast, str(list(r.source.shape)), r.cast_bytes, r.param)
            for r in self.select(phase, casts=True)
        )
        return Table(
            ("phase", "autograd node", "cast", "shape", "bytes", "parameter"),
            rows,
            self._caption(phase, "casts"),
        )

    def summary(self) -> Table:
        """Ops grouped by phase, op and dtype signature, with counts; casts marked."""
        counts = Counter(
            (r.phase, r.node_name, r.op_name, r.signature(), r.cast) for r in self.records
        )
        rows = tuple((*key, n) for key, n in counts.items())
        total = {p: len(self.select(p)) for p in self.phases()}
        notes = tuple(
            f"{p}: {n} ops, {len(self.select(p, casts=True))} casts, "
            f"{self.cast_bytes(p)} bytes cast"
            for p, n in total.items()
        )
        return Table(
            ("phase", "autograd node", "op", "dtypes", "cast", "count"),
            rows,
            self._caption(None, "ops"),
            notes,
        )

    def per_param(self, phase: str = BACKWARD) -> Table:
        """Casts and cast bytes per parameter, for the casts attributed to one."""
        casts: Counter[str] = Counter()
        nbytes: Counter[str] = Counter()
        for r in self.select(phase, casts=True):
            if r.param:
                casts[r.param] += 1
                nbytes[r.param] += r.cast_bytes
        rows = tuple((p, casts[p], nbytes[p]) for p in casts)
        return Table(
            ("parameter", "casts", "bytes"),
            rows,
            f"{phase} casts per parameter, torch {torch.__version__}",
        )

    def _caption(self, phase: str | None, what: str) -> str:
        where = f"{phase} " if phase else ""
        return f"{where}{what} seen by DtypeLog, torch {torch.__version__}"

    def __repr__(self) -> str:
        return self.summary().to_text()

    def _repr_html_(self) -> str:
        return self.summary().to_html()

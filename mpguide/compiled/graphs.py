"""Capture the graphs ``torch.compile`` backends run, and follow their dtypes.

- :func:`capture` gives the forward graph and (when the output requires grad) the backward graph
  AOTAutograd produces for a backend: for ``aot_eager`` the plain ATen graphs, for ``inductor``
  the graphs after inductor's decompositions, as inductor receives them to lower, with the code
  inductor generated from them. Given fake tensors (made inside :func:`mpguide.core.device.tensors`
  for a simulated device) it simulates: the same graphs from this build's dispatch rules, with
  no kernel run and no code generated. :func:`inputs` makes tensors from ``bf16[32, 7, 1, 8]``.
- :func:`dtype_flow` lists the nodes of a graph where the dtype changes, with the line of user
  code that produced each; :func:`eager_flow` lists the same for an eager run.

Running and measuring backends is :mod:`mpguide.compiled.backends`; what ``TORCH_LOGS`` shows is
:mod:`mpguide.compiled.compile_logs`.
"""

from __future__ import annotations

import math
import re
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves

from mpguide import MPGuideError
from mpguide.compiled import backends
from mpguide.core import device as _device
from mpguide.core import dtypes
from mpguide.core.table import Table


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy the compiler cannot change afterwards (node metadata kept)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


# -- rendering -------------------------------------------------------------------------------


def node_type(node: torch.fx.Node) -> str:
    """``bf16[32, 7, 1, 8]`` for a node whose value is a tensor (tuples joined), else ``''``."""

    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{dtypes.short(v.dtype)}[{', '.join(str(s) for s in v.shape)}]"
        return ""

    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(one(v) for v in val) + ")"
    return one(val)


def _arg(a: Any) -> str:
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, torch.dtype):
        return dtypes.name(a)
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, torch.device):
        return repr(str(a))
    return repr(a)


def _op(node: torch.fx.Node) -> str:
    name = str(node.target) if node.op == "call_function" else f"{node.op}:{node.target}"
    return name.removesuffix(".default")


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def source_line(node: torch.fx.Node) -> str:
    """``file.py:18 in f: code`` for the innermost user frame that produced ``node``."""
    where, code = _source(node)
    return f"{where} {code}" if where else ""


def _source(node: torch.fx.Node) -> tuple[str, str]:
    """``("file.py:18", "in f: code")`` for the innermost user frame that produced ``node``
    (empty where the graph does not say): a table cuts the code, never the line."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return "", ""
    path, line, func, code = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}", f"in {func}: {code.strip()}"


def render(gm: torch.fx.GraphModule, name: str = "forward", compact: bool = False) -> str:
    """The graph as readable code, one node per line with its dtype and shape, and a comment
    with the user line each group of nodes comes from. ``compact`` keeps only each node's dtype,
    shape and op, to set graphs side by side."""
    params = [f"{n.name}: {node_type(n)}" for n in gm.graph.nodes if n.op == "placeholder"]
    if compact:
        lines = [f"def {name}(", *(f"    {p}," for p in params), "):"]
    else:
        lines = [f"def {name}({', '.join(params)}):"]
    last_source = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            lines.append(f"    return {_arg(node.args[0])}")
            continue
        if compact:
            lines.append(f"    {node_type(node):<18} {_op(node).split('.', 1)[-1]}")
            continue
        src = source_line(node)
        if src and src != last_source:
            lines.append(f"    # {src}")
            last_source = src
        args = [_arg(a) for a in node.args]
        args += [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
        lines.append(f"    {node.name}: {node_type(node)} = {_op(node)}({', '.join(args)})")
    return "\n".join(lines)


def _pre(text: str) -> str:
    return (
        '<pre class="mpguide-graph" style="font-size: 0.72rem; overflow-x: auto; '
        f'white-space: pre;">{escape(text)}</pre>'
    )


# -- dtype flow ------------------------------------------------------------------------------


def _dtype(node: Any) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _input_dtypes(node: torch.fx.Node) -> list[torch.dtype]:
    found = []
    for a in tree_leaves((node.args, node.kwargs)):
        dt = _dtype(a)
        if dt is not None and dt not in found:
            found.append(dt)
    return found


def dtype_flow(gm: torch.fx.GraphModule, caption: str = "") -> Table:
    """The nodes where the dtype changes, in graph order, each with the user line (file:line)
    and code that produced it: conversions (``convert_element_type``, ``_to_copy``, a
    ``copy`` into another dtype), new tensors made in another dtype from an input's shape
    (``new_ones``), promotions (a floating output wider than a floating input), comparisons
    (a predicate's bool output; another op's is "to bool"), and floating values made from
    integers or integers from floating values. Integer indices and bool masks beside the
    values they pick (``embedding``, ``index``, ``where``) are no change."""
    rows = []
    for node in gm.graph.nodes:
        out = _dtype(node)
        ins = _input_dtypes(node)
        if node.op != "call_function" or out is None or not ins:
            continue
        kind = _change(str(node.target), ins, out)
        if kind is not None:
            rows.append(
                (
                    node.name,
                    _op(node),
                    kind,
                    " + ".join(dtypes.short(d) for d in ins),
                    dtypes.short(out),
                    *_source(node),
                )
            )
    return Table(FLOW_COLUMNS, tuple(rows), caption)


FLOW_COLUMNS = ("node", "op", "change", "in", "out", "line", "user code")
_CREATED = frozenset(
    {"new_ones", "new_zeros", "new_full", "new_empty", "new_empty_strided", "full_like",
     "zeros_like", "ones_like", "empty_like", "rand_like", "randn_like", "randint_like"}
)  # fmt: skip
"""Ops that make a tensor of the dtype they are given, taking only a shape from their input."""
_COMPARISONS = frozenset(
    {"eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "isfinite", "isneginf", "isposinf",
     "isclose", "signbit", "logical_and", "logical_or", "logical_xor", "logical_not", "any",
     "all", "equal"}
)  # fmt: skip
"""Ops whose bool output answers a question about their inputs."""
_INDEXED = frozenset(
    {"index", "_unsafe_index", "index_put", "_unsafe_index_put", "index_select", "gather",
     "scatter", "scatter_add", "scatter_reduce", "embedding", "take", "index_add", "index_copy",
     "index_fill"}
)  # fmt: skip
"""Ops whose integer inputs are indices: they pick values, and change no value's dtype."""
_MASKED = frozenset({"where", "masked_fill", "masked_scatter", "masked_select"})
"""Ops whose bool inputs are masks: they choose between values."""


def _base(op: str) -> str:
    """``aten.new_ones.default`` -> ``new_ones``."""
    parts = op.split(".")
    return parts[1] if len(parts) > 1 and parts[0] in ("aten", "prims") else parts[0]


def _change(op: str, ins: list[torch.dtype], out: torch.dtype) -> str | None:
    """How a node changes the dtype, or None where it does not: integer indices (``index``,
    ``embedding``) and bool masks (``where``, ``masked_fill``) beside the values they pick
    change nothing; a tensor made in a given dtype from another's shape (``new_ones``) is a
    new tensor; only a predicate (``eq``, ``isnan``, ...) is a comparison."""
    base = _base(op)
    if base in _INDEXED:
        ins = [dt for dt in ins if dt.is_floating_point or dt.is_complex or dt == out] or ins
    if base in _MASKED and out != torch.bool:
        ins = [dt for dt in ins if dt != torch.bool] or ins
    if all(dt == out for dt in ins):
        return None
    if op in dtypes.CONVERSIONS:
        return "conversion"
    if base in _CREATED:
        return "new tensor"
    if out == torch.bool:
        return "comparison" if base in _COMPARISONS else "to bool"
    floats = [dt for dt in ins if dt.is_floating_point]
    if out.is_floating_point:
        if not floats:
            return "to floating"
        return None if all(dt == out for dt in floats) else "promotion"
    return "to integer" if floats else "integer promotion"


_LIBRARY_DIRS = (str(Path(torch.__file__).parent), str(Path(__file__).resolve().parents[1]))


def _user_frame() -> tuple[str, str]:
    """``("file.py:18", "in f: code")`` for the innermost frame of the running Python stack
    outside torch and mpguide."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_LIBRARY_DIRS):
            code = (frame.line or "").strip()
            return f"{Path(frame.filename).name}:{frame.lineno}", f"in {frame.name}: {code}"
    return "", ""


class _FlowLog(dtypes.Log):
    """The calls that change the dtype (see :func:`dtype_flow`), as flow rows."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.rows: list[tuple[str, ...]] = []

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        ins = list(
            dict.fromkeys(
                a.dtype for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
            )
        )
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        name = str(func)
        kind = _change(name, ins, outs[0].dtype) if ins and outs else None
        if kind is not None:
            self.rows.append(
                (
                    self.phase,
                    name.removesuffix(".default"),
                    kind,
                    " + ".join(dtypes.short(d) for d in ins),
                    dtypes.short(outs[0].dtype),
                    *(_user_frame() if self.phase == "forward" else ("", "")),
                )
            )


def eager_flow(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Table:
    """The dtype changes eager PyTorch makes running ``fn(*args, **kwargs)`` and, when the
    output requires grad, its backward pass (see :func:`backward_once`): the eager counterpart
    of :func:`dtype_flow`, recorded at the dispatcher, so autocast's casts are included."""
    recorder = _FlowLog()
    with recorder:
        out = fn(*args, **kwargs)
        recorder.phase = "backward"
        backward_once(out)
    return Table(
        ("phase", *FLOW_COLUMNS[1:]),
        tuple(recorder.rows),
        "dtype changes in eager",
    )


# -- capture ---------------------------------------------------------------------------------

_SPEC = re.compile(r"([a-z]+\d+)\[(\d+(?:,\d+)*)?\]")


def inputs(specs: Sequence[str], dev: torch.device | str, requires_grad: bool = False) -> tuple:
    """Random tensors on ``dev`` from the graphs' own notation, ``bf16[32, 7, 1, 8]`` or
    ``i64[4]`` (see :func:`node_type`); the floating ones require grad when ``requires_grad``.
    Inside :func:`mpguide.core.device.tensors` of a simulated device they are fake."""
    by_name = {v: k for k, v in dtypes.SHORT.items()}
    made = []
    for spec in specs:
        m = _SPEC.fullmatch(spec.replace(" ", ""))
        if not m or m[1] not in by_name:
            raise MPGuideError(
                f"bad input {spec!r}: write DTYPE[SHAPE] such as bf16[32,7,1,8], with DTYPE one "
                f"of {', '.join(by_name)}"
            )
        dtype, shape = by_name[m[1]], [int(d) for d in m[2].split(",")] if m[2] else []
        if math.prod(shape) * dtype.itemsize >= 2**63:
            raise MPGuideError(f"bad input {spec!r}: too large, a tensor holds under 2**63 bytes")
        if dtype.is_floating_point:
            t = torch.randn(shape, device=dev).to(dtype).requires_grad_(requires_grad)
        else:
            t = torch.zeros(shape, dtype=dtype, device=dev)
        made.append(t)
    return tuple(made)


@dataclass(frozen=True)
class Graphs:
    """What AOTAutograd gave one backend on one device: the forward graph, the backward graph
    (``None`` when nothing requires grad) and, for inductor, the code it generated from each.
    ``how`` says how they were obtained (:data:`mpguide.core.device.LIVE` or
    :data:`~mpguide.core.device.SIMULATED`); ``note`` what a simulated capture leaves out."""

    backend: str
    forward: torch.fx.GraphModule = field(repr=False)
    backward: torch.fx.GraphModule | None = field(repr=False)
    code: tuple[str, ...] = field(default=(), repr=False)
    device: str = "cpu"
    how: str = _device.LIVE
    note: str = ""

    @property
    def simulated(self) -> bool:
        """Whether the graphs come from fake tensors, with no kernel run."""
        return self.how == _device.SIMULATED

    @property
    def label(self) -> str:
        """``inductor, cuda (simulated)``: the backend and where its graphs come from."""
        return f"{self.backend}, {_device.label(self.device, self.how)}"

    @property
    def obtained(self) -> str:
        """``cuda, simulated: dispatch rules of this build, no kernels ran`` and the note, if any."""
        how = f"simulated: {self.how}" if self.simulated else self.how
        return f"{self.device}, {how}" + (f"; {self.note}" if self.note else "")

    def graphs(self) -> dict[str, torch.fx.GraphModule]:
        """``{"forward": ..., "backward": ...}``, backward only when there is one."""
        out = {"forward": self.forward}
        if self.backward is not None:
            out["backward"] = self.backward
        return out

    def render(self, which: str = "forward", compact: bool = False) -> str:
        """One graph as readable code (see :func:`render`)."""
        return render(self._pick(which), which, compact)

    def flow(self, which: str = "forward") -> Table:
        """The dtype changes of one graph (see :func:`dtype_flow`)."""
        return dtype_flow(
            self._pick(which),
            f"dtype changes in the {which} graph, {self.backend}, {self.obtained}",
        )

    def nodes(self, which: str = "forward") -> list[tuple[str, str]]:
        """``(op, dtype and shape)`` of each op node of one graph, in order: what two captures
        must share to be the same graph."""
        return [
            (_op(n), node_type(n)) for n in self._pick(which).graph.nodes if n.op == "call_function"
        ]

    def kernels(self) -> tuple[str, ...]:
        """The source of each kernel inductor generated (C++ on CPU, Triton on CUDA); none for
        ``aot_eager`` and none for a simulated capture, whose :attr:`note` says why."""
        return tuple(
            k.strip()
            for src in self.code
            for k in re.findall(r"async_compile\.\w+\(.*?'''(.*?)'''", src, flags=re.DOTALL)
        )

    def _pick(self, which: str) -> torch.fx.GraphModule:
        graphs = self.graphs()
        if which not in graphs:
            raise MPGuideError(
                f"no {which!r} graph; this capture has {', '.join(map(repr, graphs))}"
            )
        return graphs[which]

    def __repr__(self) -> str:
        return "\n\n".join(
            f"# {self.backend}, {w}, {self.obtained}\n{self.render(w)}" for w in self.graphs()
        )

    def _repr_html_(self) -> str:
        return "".join(
            f"<p><strong>{escape(self.backend)}, {w}</strong>, {escape(self.obtained)}</p>"
            f"{_pre(self.render(w))}"
            for w in self.graphs()
        )


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    return [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]


def _leaves(outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors (inputs, parameters) that ``outs`` depend on through autograd."""
    found: dict[int, torch.Tensor] = {}
    # Nodes are kept alive while walking: a Python wrapper of a node can be freed as soon as it
    # is popped, and its id() reused by the next one, which would end the walk early.
    seen: dict[int, Any] = {}
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen[id(fn)] = fn
        if hasattr(fn, "variable"):
            found[id(fn.variable)] = fn.variable
        stack.extend(f for f, _ in fn.next_functions)
    return list(found.values())


def backward_once(out: Any) -> bool:
    """Run the backward pass of ``out`` once, with ones as output gradients, leaving every
    ``.grad`` alone. Returns whether there was a backward pass to run."""
    outs = _grad_outputs(out)
    leaves = _leaves(outs)
    if not (outs and leaves):
        return False
    torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs], allow_unused=True)
    return True


def _recording_backend(backend: str, fw: list, bw: list, code: list):
    if backend == backends.AOT_EAGER:
        from torch._dynamo.backends.debugging import aot_eager, boxed_nop

        def keep(store):
            def compiler(gm, example_inputs):
                store.append(_copy(gm))
                return boxed_nop(gm, example_inputs)

            return compiler

        def compile_aot(gm, example_inputs):
            return aot_eager(gm, example_inputs, fw_compiler=keep(fw), bw_compiler=keep(bw))

        return compile_aot

    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(gm, example_inputs, **kwargs):
        (bw if kwargs.get("is_backward") else fw).append(_copy(gm))
        compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        code.append(getattr(compiled, "source_code", "") or "")
        return compiled

    def compile_inductor(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=inner)

    return compile_inductor


def _simulated_backend(backend: str, fw: list, bw: list, detach: list | None):
    """AOTAutograd as ``backend`` sets it up, recording the graphs and compiling nothing. For
    inductor: its decompositions and partitioner, after the one joint-graph pass that needs no
    device (removing no-op aliases and clones); the pattern passes need the device to set up.
    Given a ``detach`` list, AOTAutograd gets inputs (parameters included) that do not require
    grad, and the list gets whether any did."""
    if backend == backends.AOT_EAGER:
        compile_aot = _recording_backend(backend, fw, bw, [])
    else:
        compile_aot = _inductor_aot(fw, bw)
    if detach is None:
        return compile_aot

    def compile_detached(gm, example_inputs):
        tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
        detach.append(any(t.requires_grad for t in tensors))
        inputs = [t.detach() if isinstance(t, torch.Tensor) else t for t in example_inputs]
        return compile_aot(gm, inputs)

    return compile_detached


def _inductor_aot(fw: list, bw: list):
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.post_grad import remove_noop_ops

    def keep(store, passes=False):
        def compiler(gm, example_inputs):
            if passes:
                remove_noop_ops(gm.graph)
                gm.recompile()
            store.append(_copy(gm))
            return boxed_nop(gm, example_inputs)

        return compiler

    def partition(gm, joint_inputs, **kwargs):
        remove_noop_ops(gm.graph)
        gm.recompile()
        return min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor", **kwargs)

    return aot_autograd(
        fw_compiler=keep(fw),
        bw_compiler=keep(bw),
        inference_compiler=keep(fw, passes=True),
        decompositions=select_decomp_table(),
        partition_fn=partition,
        keep_inference_input_mutations=True,
    )


SIMULATED_INDUCTOR = (
    "inductor's decompositions and partitioner, without the joint-graph pattern passes "
    "that need the device to set up; no code generated"
)


def _fake_mode(values: Any):
    modes = {id(t.fake_mode): t.fake_mode for t in tree_leaves(values) if isinstance(t, FakeTensor)}
    if len(modes) > 1:
        raise MPGuideError("the inputs are fake tensors of different fake modes; make them in one")
    return next(iter(modes.values()), None)


@contextmanager
def _no_constant_folding() -> Iterator[None]:
    """AOTAutograd's tracer without constant folding: it computes a small constant (a
    ``torch.tensor([])`` moved to the device) on real tensors, which a device this machine
    lacks cannot hold."""
    from torch.fx.experimental import proxy_tensor

    limit = proxy_tensor.CONSTANT_NUMEL_LIMIT
    proxy_tensor.CONSTANT_NUMEL_LIMIT = -1
    try:
        yield
    finally:
        proxy_tensor.CONSTANT_NUMEL_LIMIT = limit


def modules_of(fn: Callable[..., Any]) -> list[torch.nn.Module]:
    """The modules ``fn`` reaches: ``fn`` itself when it is one, the instance of a bound
    method, and the modules its closure and its module's globals hold, each once. Give them to
    :func:`mpguide.core.device.tensors` so that their parameters and buffers follow a simulated
    device."""
    found = [fn, getattr(fn, "__self__", None)]
    for cell in getattr(fn, "__closure__", None) or ():
        with suppress(ValueError):  # a cell not yet filled
            found.append(cell.cell_contents)
    found += list(getattr(fn, "__globals__", {}).values())
    modules = {id(m): m for m in found if isinstance(m, torch.nn.Module)}
    return list(modules.values())


def capture(
    fn: Callable[..., Any], *args: Any, backend: str = backends.AOT_EAGER, **kwargs: Any
) -> Graphs:
    """Compile ``fn`` with ``backend`` (``aot_eager``, ``inductor`` or
    ``inductor+emulate_precision_casts``), call it once on ``args`` and ``kwargs``, and keep the
    graphs AOTAutograd handed to the backend's compiler.

    When the output requires grad (through an input or a parameter), the backward pass is run
    once with :func:`backward_once` so the backward graph is compiled too. Dynamo's caches are
    reset before and after; ``fn`` must compile to one graph. Call it inside
    :func:`torch.autocast` (or :func:`mpguide.core.device.autocast`) to see where autocast puts its
    casts.

    Fake inputs (made inside :func:`mpguide.core.device.tensors` of a simulated device, parameters
    too) are simulated: Dynamo and AOTAutograd trace as they would on that device and no kernel
    runs; inductor is simulated by its decompositions and partitioner
    (:data:`SIMULATED_INDUCTOR`), and ``emulate_precision_casts``, which changes only generated
    code, cannot be. Where this build cannot run autograd on the device (see
    :func:`mpguide.core.device.simulates_autograd`), ``fn`` is traced without grad and, if anything
    required grad, :attr:`Graphs.note` says there is no backward graph.
    """
    backends.check(backend, backends.COMPILED)
    fake = _fake_mode((args, kwargs))
    if fake is not None and backend == backends.EMULATE:
        raise MPGuideError(
            f"{backends.EMULATE} changes only the code inductor generates; a simulated capture has none"
        )
    backends.import_inductor()
    import torch._functorch.config

    fw: list = []
    bw: list = []
    code: list = []
    dev = next(
        (t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), "cpu"
    )
    notes = [SIMULATED_INDUCTOR] if fake is not None and backend == backends.INDUCTOR else []
    no_grad = fake is not None and not _device.simulates_autograd(dev)
    dropped: list[bool] = []
    compiler = (
        _recording_backend(backend, fw, bw, code)
        if fake is None
        else _simulated_backend(backend, fw, bw, dropped if no_grad else None)
    )
    torch._dynamo.reset()
    try:
        # AOTAutograd's own cache would skip the compiler calls that record the graphs.
        with (
            torch._functorch.config.patch(enable_autograd_cache=False),
            backends.settings(backend),
            nullcontext() if fake is None else fake,
            nullcontext() if fake is None else _device.aten_methods(dev),
            torch.no_grad() if no_grad else nullcontext(),
            _no_constant_folding()
            if fake is not None and not _device.present(dev)
            else nullcontext(),
        ):
            compiled = torch.compile(fn, backend=compiler, fullgraph=True, dynamic=False)
            out = compiled(*args, **kwargs)
            if not bw:
                backward_once(out)
    finally:
        torch._dynamo.reset()
    if not fw:
        name = getattr(fn, "__qualname__", repr(fn))
        raise MPGuideError(
            f"{name} ran no tensor op (it returned {type(out).__name__}): Dynamo captured no "
            "graph; return a tensor computed from the inputs"
        )
    if len(fw) != 1:
        raise MPGuideError(f"expected one forward graph from {backend}, got {len(fw)}")
    if any(dropped):
        notes.append(f"no backward graph: {_device.no_autograd_reason(dev)}")
    return Graphs(
        backend,
        fw[0],
        bw[0] if bw else None,
        tuple(code),
        device=dev,
        how=_device.LIVE if fake is None else _device.SIMULATED,
        note="; ".join(notes),
    )


@dataclass(frozen=True)
class SideBySide:
    """Several captures' graphs in columns, compact (see :func:`render`), for the eye."""

    captures: tuple[Graphs, ...]
    which: str = "forward"

    def __repr__(self) -> str:
        return "\n\n".join(
            f"# {g.backend}, {g.obtained}\n{g.render(self.which, compact=True)}"
            for g in self.captures
        )

    def _repr_html_(self) -> str:
        cols = "".join(
            '<div class="mpguide-column" style="flex: 1 1 0; min-width: 0;">'
            f"<p><strong>{escape(g.label)}, {escape(self.which)}</strong><br>"
            f"<small>{escape(g.obtained)}</small></p>{_pre(g.render(self.which, compact=True))}</div>"
            for g in self.captures
        )
        return f'<div class="mpguide-columns" style="display: flex; gap: 1rem;">{cols}</div>'


def side_by_side(*captures: Graphs, which: str = "forward") -> SideBySide:
    """Show the ``which`` graph of each capture in columns."""
    for g in captures:
        g._pick(which)
    return SideBySide(tuple(captures), which)

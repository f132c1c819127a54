"""Capture the graphs ``torch.compile`` backends run, follow their dtypes, and measure each
backend against a float64 reference.

- :func:`capture` gives the forward graph and (when the output requires grad) the backward graph
  AOTAutograd produces for a backend: for ``aot_eager`` the plain ATen graphs, for ``inductor``
  the graphs after inductor's decompositions, as inductor receives them to lower, with the code
  inductor generated from them. Given fake tensors (made inside :func:`mpguide.device.tensors`
  for a simulated device) it simulates: the same graphs from this build's dispatch rules, with
  no kernel run and no code generated. :func:`inputs` makes tensors from ``bf16[32, 7, 1, 8]``.
- :func:`dtype_flow` lists the nodes of a graph where the dtype changes, with the line of user
  code that produced each; :func:`eager_flow` lists the same for an eager run.
- :func:`compare_backends` runs one function under several backends and tabulates each
  output's dtype and error against a float64 reference.
- :func:`torch_logs` runs a script with ``TORCH_LOGS`` switches and returns what each logged.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from mpguide import MPGuideError, error_line
from mpguide import device as _device
from mpguide.table import Table

EAGER, AOT_EAGER, INDUCTOR = "eager", "aot_eager", "inductor"
EMULATE = "inductor+emulate_precision_casts"
BACKENDS = (EAGER, AOT_EAGER, INDUCTOR, EMULATE)
_COMPILED = (AOT_EAGER, INDUCTOR, EMULATE)

_ABBR = {
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
_CONVERSIONS = {
    "prims.convert_element_type.default",
    "aten._to_copy.default",
    "aten.to.dtype",
    "aten.to.dtype_layout",
    "aten.copy.default",
    "aten.copy_.default",
}


def _check_backend(backend: str, allowed: Sequence[str]) -> None:
    if backend not in allowed:
        raise MPGuideError(f"unknown backend {backend!r}; choose one of {', '.join(allowed)}")


def _config(backend: str):
    """The inductor settings a backend name stands for."""
    if backend == EMULATE:
        import torch._inductor.config

        return torch._inductor.config.patch(emulate_precision_casts=True)
    return nullcontext()


def _import_inductor() -> None:
    """Import inductor's compiler, silencing the deprecation warning its import chain raises
    (``torch.utils.mkldnn`` uses ``torch.jit.script_method``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*torch\.jit\.script_method", category=DeprecationWarning
        )
        import torch._inductor.compile_fx  # noqa: F401


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy the compiler cannot change afterwards (node metadata kept)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


# -- rendering -------------------------------------------------------------------------------


def _abbr(dt: torch.dtype) -> str:
    return _ABBR.get(dt, _device.dtype_name(dt))


def node_type(node: torch.fx.Node) -> str:
    """``bf16[32, 7, 1, 8]`` for a node whose value is a tensor (tuples joined), else ``''``."""

    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{_abbr(v.dtype)}[{', '.join(str(s) for s in v.shape)}]"
        return ""

    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(one(v) for v in val) + ")"
    return one(val)


def _arg(a: Any) -> str:
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, torch.dtype):
        return _device.dtype_name(a)
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
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return ""
    path, line, func, code = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line} in {func}: {code.strip()}"


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
    """The nodes where the dtype changes, in graph order: conversions (``convert_element_type``,
    ``_to_copy``, a ``copy`` into another dtype) and ops whose output dtype differs from one of
    their tensor inputs, each with the user line that produced it."""
    rows = []
    for node in gm.graph.nodes:
        out = _dtype(node)
        ins = _input_dtypes(node)
        if node.op != "call_function" or out is None or not ins:
            continue
        if any(dt != out for dt in ins):
            kind = _change(str(node.target))
            rows.append(
                (
                    node.name,
                    _op(node),
                    kind,
                    " + ".join(_abbr(d) for d in ins),
                    _abbr(out),
                    source_line(node),
                )
            )
    return Table(("node", "op", "change", "in", "out", "user code"), tuple(rows), caption)


def _change(op: str) -> str:
    return "conversion" if op in _CONVERSIONS else "promotion"


_LIBRARY_DIRS = (str(Path(torch.__file__).parent), str(Path(__file__).parent))


def _user_frame() -> str:
    """The innermost frame of the running Python stack outside torch and mpguide."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_LIBRARY_DIRS):
            code = (frame.line or "").strip()
            return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}: {code}"
    return ""


class _DtypeRecorder(TorchDispatchMode):
    """Records the ops whose output dtype differs from one of their tensor inputs."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.rows: list[tuple[str, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins: list[torch.dtype] = []
        for a in tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor) and a.dtype not in ins:
                ins.append(a.dtype)
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        if ins and outs and any(dt != outs[0].dtype for dt in ins):
            name = str(func)
            where = _user_frame() if self.phase == "forward" else ""
            self.rows.append(
                (
                    self.phase,
                    name.removesuffix(".default"),
                    _change(name),
                    " + ".join(_abbr(d) for d in ins),
                    _abbr(outs[0].dtype),
                    where,
                )
            )
        return out


def eager_flow(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Table:
    """The dtype changes eager PyTorch makes running ``fn(*args, **kwargs)`` and, when the
    output requires grad, its backward pass (see :func:`backward_once`): the eager counterpart
    of :func:`dtype_flow`, recorded at the dispatcher, so autocast's casts are included."""
    recorder = _DtypeRecorder()
    with recorder:
        out = fn(*args, **kwargs)
        recorder.phase = "backward"
        backward_once(out)
    return Table(
        ("phase", "op", "change", "in", "out", "user code"),
        tuple(recorder.rows),
        "dtype changes in eager",
    )


# -- capture ---------------------------------------------------------------------------------

_SPEC = re.compile(r"^([a-z]+\d+)\[([\d,\s]*)\]$")


def inputs(specs: Sequence[str], dev: torch.device | str, requires_grad: bool = False) -> tuple:
    """Random tensors on ``dev`` from the graphs' own notation, ``bf16[32, 7, 1, 8]`` or
    ``i64[4]`` (see :func:`node_type`); the floating ones require grad when ``requires_grad``.
    Inside :func:`mpguide.device.tensors` of a simulated device they are fake."""
    by_name = {v: k for k, v in _ABBR.items()}
    made = []
    for spec in specs:
        m = _SPEC.match(spec.replace(" ", ""))
        if not m or m[1] not in by_name:
            raise MPGuideError(
                f"bad input {spec!r}: write DTYPE[SHAPE] such as bf16[32,7,1,8], with DTYPE one "
                f"of {', '.join(by_name)}"
            )
        dtype, shape = by_name[m[1]], [int(d) for d in m[2].split(",") if d]
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
    ``how`` says how they were obtained (:data:`mpguide.device.LIVE` or
    :data:`~mpguide.device.SIMULATED`); ``note`` what a simulated capture leaves out."""

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
    seen: set[int] = set()
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
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
    if backend == AOT_EAGER:
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
    if backend == AOT_EAGER:
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


def capture(fn: Callable[..., Any], *args: Any, backend: str = AOT_EAGER, **kwargs: Any) -> Graphs:
    """Compile ``fn`` with ``backend`` (``aot_eager``, ``inductor`` or
    ``inductor+emulate_precision_casts``), call it once on ``args`` and ``kwargs``, and keep the
    graphs AOTAutograd handed to the backend's compiler.

    When the output requires grad (through an input or a parameter), the backward pass is run
    once with :func:`backward_once` so the backward graph is compiled too. Dynamo's caches are
    reset before and after; ``fn`` must compile to one graph. Call it inside
    :func:`torch.autocast` (or :func:`mpguide.device.autocast`) to see where autocast puts its
    casts.

    Fake inputs (made inside :func:`mpguide.device.tensors` of a simulated device, parameters
    too) are simulated: Dynamo and AOTAutograd trace as they would on that device and no kernel
    runs; inductor is simulated by its decompositions and partitioner
    (:data:`SIMULATED_INDUCTOR`), and ``emulate_precision_casts``, which changes only generated
    code, cannot be. Where this build cannot run autograd on the device (see
    :func:`mpguide.device.simulates_autograd`), ``fn`` is traced without grad and, if anything
    required grad, :attr:`Graphs.note` says there is no backward graph.
    """
    _check_backend(backend, _COMPILED)
    fake = _fake_mode((args, kwargs))
    if fake is not None and backend == EMULATE:
        raise MPGuideError(
            f"{EMULATE} changes only the code inductor generates; a simulated capture has none"
        )
    _import_inductor()
    import torch._functorch.config

    fw: list = []
    bw: list = []
    code: list = []
    dev = next(
        (t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), "cpu"
    )
    notes = [SIMULATED_INDUCTOR] if fake is not None and backend == INDUCTOR else []
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
            _config(backend),
            nullcontext() if fake is None else fake,
            nullcontext() if fake is None else _device.aten_copy(),
            torch.no_grad() if no_grad else nullcontext(),
        ):
            compiled = torch.compile(fn, backend=compiler, fullgraph=True, dynamic=False)
            out = compiled(*args, **kwargs)
            if not bw:
                backward_once(out)
    finally:
        torch._dynamo.reset()
    if len(fw) != 1:
        raise MPGuideError(f"expected one forward graph from {backend}, got {len(fw)}")
    if any(dropped):
        notes.append(f"no backward graph: torch {torch.__version__} cannot run autograd on {dev}")
    return Graphs(
        backend,
        fw[0],
        bw[0] if bw else None,
        tuple(code),
        device=dev,
        how=_device.LIVE if fake is None else _device.SIMULATED,
        note="; ".join(notes),
    )


_ASSIGNED_CONVERSION = re.compile(r"^\s*(?:auto\s+)?(tmp\d+)\s*=\s*.*(?:convert|\.to\()")


def unused_conversions(kernel: str) -> list[str]:
    """The lines of generated kernel code that convert a value to another dtype into a
    temporary that nothing reads afterwards: a rounding the fused kernel computes and drops."""
    lines = kernel.splitlines()
    unused = []
    for i, line in enumerate(lines):
        m = _ASSIGNED_CONVERSION.match(line)
        if m and not any(re.search(rf"\b{m[1]}\b", later) for later in lines[i + 1 :]):
            unused.append(line.strip())
    return unused


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


# -- comparison against a reference ----------------------------------------------------------


def _floats(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def run(fn: Callable[..., Any], args: Sequence[Any], backend: str) -> Any:
    """Call ``fn(*args)`` eagerly (``eager``) or compiled with ``backend`` from a fresh dynamo
    state, without gradients."""
    _check_backend(backend, BACKENDS)
    if backend == EAGER:
        with torch.no_grad():
            return fn(*args)
    _import_inductor()
    torch._dynamo.reset()
    try:
        with _config(backend), torch.no_grad():
            name = INDUCTOR if backend == EMULATE else backend
            return torch.compile(fn, backend=name, fullgraph=True, dynamic=False)(*args)
    finally:
        torch._dynamo.reset()


@dataclass(frozen=True)
class Outcome:
    """One backend's output, measured against the reference, or the error it raised."""

    backend: str
    dtype: str
    max_abs: float | None
    max_rel: float | None
    equals_eager: bool | None
    error: str | None = None
    output: Any = field(default=None, repr=False, compare=False)


def _errors(out: Any, ref: Any) -> tuple[float, float]:
    got, want = _floats(out), _floats(ref)
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want, strict=False)):
        raise MPGuideError("the output and the reference differ in number or shape of tensors")
    max_abs = max_rel = 0.0
    for g, w in zip(got, want, strict=True):
        w64 = w.detach().to(torch.float64)
        diff = (g.detach().to(torch.float64) - w64).abs()
        rel = torch.where(w64 != 0, diff / w64.abs(), torch.where(diff == 0, 0.0, math.inf))
        max_abs = max(max_abs, diff.max().item() if diff.numel() else 0.0)
        max_rel = max(max_rel, rel.max().item() if rel.numel() else 0.0)
    return max_abs, max_rel


def _bitwise(a: Any, b: Any) -> bool:
    la, lb = _floats(a), _floats(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        for x, y in zip(la, lb, strict=False)
    )


@dataclass(frozen=True)
class Comparison:
    """Each backend's output against a float64 reference."""

    outcomes: tuple[Outcome, ...]
    reference: str
    machine: _device.Machine

    def __getitem__(self, backend: str) -> Outcome:
        for o in self.outcomes:
            if o.backend == backend:
                return o
        raise KeyError(backend)

    def table(self) -> Table:
        rows = tuple(
            (
                o.backend,
                o.dtype,
                o.max_abs,
                o.max_rel,
                "" if o.equals_eager is None else "yes" if o.equals_eager else "no",
                o.error,
            )
            for o in self.outcomes
        )
        return Table(
            (
                "backend",
                "output dtype",
                "max abs error",
                "max rel error",
                "bitwise equal to eager",
                "error",
            ),
            rows,
            f"against {self.reference}, {self.machine.caption()}",
        )

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def _reference(
    fn: Callable[..., Any], args: Sequence[Any], reference: torch.dtype | Callable[..., Any]
) -> tuple[Any, str]:
    if callable(reference) and not isinstance(reference, torch.dtype):
        call, name = reference, getattr(reference, "__name__", "the reference")
    else:
        dt = _device.dtype(reference)

        def cast(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                return x.detach().to(dt)
            return x

        def call(*a):
            return fn(*tree_map(cast, tuple(a)))

        name = f"{_device.dtype_name(dt)} eager"
    try:
        with torch.no_grad():
            return call(*args), name
    except Exception as err:  # noqa: BLE001 -- named in one line for the reader
        raise MPGuideError(
            f"the reference ({name}) raised {error_line(err)}; pass reference= a function"
        ) from None


def compare_backends(
    fn: Callable[..., Any],
    args: Sequence[Any],
    backends: Sequence[str] = BACKENDS,
    reference: torch.dtype | Callable[..., Any] = torch.float64,
) -> Comparison:
    """Run ``fn(*args)`` under each backend and measure it against ``reference``: a dtype
    (``fn`` run eagerly on the floating inputs cast to it) or a callable taking ``args``.

    A backend that raises gets a row with its error instead of numbers.
    """
    for b in backends:
        _check_backend(b, BACKENDS)
    ref, ref_name = _reference(fn, args, reference)
    try:
        eager, eager_error = run(fn, args, EAGER), None
    except Exception as err:  # noqa: BLE001 -- eager raising is a finding: its row says so
        eager, eager_error = None, err
    outcomes = []
    for b in backends:
        try:
            if b == EAGER and eager_error is not None:
                raise eager_error
            out = eager if b == EAGER else run(fn, args, b)
        except Exception as err:  # noqa: BLE001 -- a backend that raises is a finding, not a failure
            outcomes.append(Outcome(b, "", None, None, None, error_line(err)))
            continue
        max_abs, max_rel = _errors(out, ref)
        dtypes = ", ".join(dict.fromkeys(_device.dtype_name(t.dtype) for t in _floats(out)))
        same = None if eager is None or b == EAGER else _bitwise(out, eager)
        outcomes.append(Outcome(b, dtypes, max_abs, max_rel, same, output=out))
    dev = next((t.device for t in tree_leaves(args) if isinstance(t, torch.Tensor)), None)
    return Comparison(tuple(outcomes), ref_name, _device.describe(dev))


# -- TORCH_LOGS ------------------------------------------------------------------------------

_LOG_LINE = re.compile(r"^[A-Z]\d{4} [\d:.]+ +\d+ \S+\] (?:\[[^\]]*\] )*\[__(\w+)\] ?(.*)$")


def torch_logs(
    script: str, artifacts: Sequence[str], cached: bool = True, timeout: float = 600
) -> dict[str, str]:
    """Run ``script`` in a fresh Python with ``TORCH_LOGS`` set to ``artifacts`` (``graph_code``,
    ``aot_graphs``, ``post_grad_graphs``, ``output_code``, ...) and return what each artifact
    logged, its log prefixes taken off. Nothing in this process's logging changes.

    A compile served from torch.compile's caches skips stages and their logs; ``cached=False``
    turns the caches off for the script so every stage runs and logs."""
    env = {**os.environ, "TORCH_LOGS": ",".join(artifacts)}
    if not cached:
        env["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise MPGuideError(f"the script exited with status {proc.returncode}: {last}")
    logged: dict[str, list[str]] = {a: [] for a in artifacts}
    for line in proc.stderr.splitlines():
        m = _LOG_LINE.match(line)
        if m and m[1] in logged:
            logged[m[1]].append(m[2])
    return {a: "\n".join(lines) for a, lines in logged.items()}

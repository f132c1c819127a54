"""Pick the device, resolve the device names readers type, simulate another device, and describe
the machine for captions."""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from mpguide import MPGuideError
from mpguide.core import dtypes as _dtypes
from mpguide.core import stored

_DEVICE_TYPES = ("cpu", "cuda")

LIVE = "ran on hardware"
SIMULATED = "dispatch rules of this build, no kernels ran"
NEEDS_HARDWARE = "needs hardware"


def pick() -> torch.device:
    """The device examples run on: CUDA when present, else CPU; ``MPGUIDE_DEVICE`` overrides."""
    forced = os.environ.get("MPGUIDE_DEVICE")
    if forced:
        return resolve(forced)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve(name: str) -> torch.device:
    """Turn a device name into a ``torch.device`` this machine has, or raise ``MPGuideError``."""
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise MPGuideError(
            f"unknown device {name!r}; choose one of {', '.join(_DEVICE_TYPES)}"
        ) from None
    if dev.type not in _DEVICE_TYPES:
        raise MPGuideError(f"unknown device {name!r}; choose one of {', '.join(_DEVICE_TYPES)}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise MPGuideError(
                f"device {name!r} is not available: torch {torch.__version__} sees no CUDA GPU"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise MPGuideError(
                f"device {name!r} is not available: this machine has "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
    return dev


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class Machine:
    """The device and torch build a result was measured on."""

    device: str
    name: str
    torch: str
    detail: str

    def caption(self) -> str:
        return f"torch {self.torch} on {self.device} ({self.name})"

    def __repr__(self) -> str:
        return f"{self.caption()}\n{self.detail}"

    def _repr_html_(self) -> str:
        from html import escape

        return (
            f"<p><strong>{escape(self.caption())}</strong><br>"
            f"<small>{escape(self.detail)}</small></p>"
        )


def describe(dev: torch.device | str | None = None) -> Machine:
    """Describe ``dev`` (default: :func:`pick`) and the torch build, for captions."""
    dev = pick() if dev is None else torch.device(dev)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name = props.name
        detail = (
            f"compute capability {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"
        )
    else:
        name = cpu_name()
        detail = (
            f"{torch.get_num_threads()} threads, {platform.machine()}, "
            f"{'no CUDA build' if torch.version.cuda is None else f'CUDA {torch.version.cuda} build'}"
        )
    return Machine(
        device=dev.type,
        name=name,
        torch=torch.__version__,
        detail=f"{detail}, Python {platform.python_version()}",
    )


# -- simulated devices -----------------------------------------------------------------------

_AUTOCAST_KERNEL = re.compile(r"^Autocast(\w+): registered at .*\[kernel\]$", re.MULTILINE)


@functools.cache
def autocast_kernels() -> dict[str, int]:
    """How many ATen ops have an autocast kernel for each device type, read from this build's
    dispatcher (``{"cpu": 127, "cuda": 119, ...}``); fallthroughs are not counted."""
    counts: dict[str, int] = {}
    for op in torch._C._dispatch_get_all_op_names():
        for key in _AUTOCAST_KERNEL.findall(torch._C._dispatch_dump_table(op)):
            counts[key.lower()] = counts.get(key.lower(), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (kv[0] != "cpu", kv[0] != "cuda", kv[0])))


@contextmanager
def fake_mode(**kwargs: Any) -> Iterator[Any]:
    """:class:`~torch._subclasses.fake_tensor.FakeTensorMode` (``kwargs`` passed on) that
    makes fake tensors of device types this machine lacks. With a CUDA GPU present, torch
    makes a real tensor on the type of every new fake cuda or xpu tensor (to set up a GPU
    context), and a fake xpu tensor then raises "Torch not compiled with XPU enabled" (seen with
    2.11 on an H100): that set-up is skipped for a type that is not present."""
    from torch._subclasses import fake_tensor

    real_init = fake_tensor.init_gpu_context

    def init(dev: torch.device) -> None:
        if present(dev.type):
            real_init(dev)

    fake_tensor.init_gpu_context = init
    try:
        with fake_tensor.FakeTensorMode(**kwargs) as mode:
            yield mode
    finally:
        fake_tensor.init_gpu_context = real_init


def _carries_autocast(dev_type: str) -> bool:
    """Whether a fake tensor on ``dev_type`` carries that device's autocast dispatch key."""
    try:
        with fake_mode():
            keys = str(torch._C._dispatch_keys(torch.empty(1, device=dev_type)))
    except (RuntimeError, AttributeError):
        return False
    return f"autocast{dev_type}" in keys.lower()


@functools.cache
def simulated_types() -> tuple[str, ...]:
    """The device types whose autocast this build can run on fake tensors: those with autocast
    kernels whose tensors carry the autocast dispatch key (cpu first, then cuda); kept in
    ``$MPGUIDE_CACHE`` when that names a folder (finding them imports torch._dynamo)."""
    return stored.kept(
        "simulated_types",
        (),
        lambda: tuple(t for t in autocast_kernels() if _carries_autocast(t)),
        tuple,
    )


def present(dev_type: str) -> bool:
    """Whether this machine has a device of ``dev_type`` that torch can run kernels on."""
    if dev_type == "cpu":
        return True
    module = getattr(torch, dev_type, None)
    if dev_type == "mps":
        module = torch.backends.mps
    available = getattr(module, "is_available", None)
    try:
        return bool(available()) if callable(available) else False
    except RuntimeError:
        return False


def label(dev_type: str, how: str) -> str:
    """``cuda (simulated)`` or ``cpu (ran on hardware)``: a device and how its results were
    obtained, for column headers and titles."""
    return f"{dev_type} ({'simulated' if how == SIMULATED else how})"


@dataclass(frozen=True)
class Target:
    """A device to probe: real hardware when present, else simulated from dispatch rules."""

    device: torch.device
    simulated: bool

    @property
    def how(self) -> str:
        """How results on this target are obtained: :data:`LIVE` or :data:`SIMULATED`."""
        return SIMULATED if self.simulated else LIVE

    def describe(self) -> Machine:
        """The machine the results come from: the device itself, or this build simulating it."""
        if not self.simulated:
            return describe(self.device)
        return Machine(
            device=self.device.type,
            name="simulated",
            torch=torch.__version__,
            detail=f"{SIMULATED}: fake {self.device.type} tensors under its autocast, "
            f"on {cpu_name()}, Python {platform.python_version()}",
        )


def target(name: str | torch.device | None = None, simulate: bool = False) -> Target:
    """The device ``name`` as a :class:`Target`: live when this machine has it (and ``simulate``
    is false), simulated when this build can simulate its autocast, else ``MPGuideError``."""
    if name is None:
        return Target(pick(), simulated=False)
    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = None
    if dev is not None and not simulate and present(dev.type):
        return Target(resolve(str(dev)) if dev.type in _DEVICE_TYPES else dev, simulated=False)
    known = simulated_types()  # reads the dispatcher once: only a simulation needs it
    if dev is None or dev.type not in known:
        raise MPGuideError(
            f"unknown device {str(name)!r}; this build's autocast knows {', '.join(known)}"
        )
    return Target(torch.device(dev.type), simulated=True)


@contextmanager
def autocast(dev: Target, dtype: torch.dtype | None) -> Iterator[None]:
    """Autocast for ``dev``'s type with ``dtype`` (off when ``None``). On a live device this is
    :func:`torch.autocast`; on a simulated one, which :func:`torch.autocast` would switch off,
    the same thread-local switches are set directly and restored afterwards, and its cast cache
    is off so no fake tensor outlives the call."""
    kind = dev.device.type
    if not dev.simulated:
        try:
            with torch.autocast(kind, dtype=dtype, enabled=dtype is not None):
                yield
        finally:
            torch.clear_autocast_cache()
        return
    saved = (
        torch.is_autocast_enabled(kind),
        torch.get_autocast_dtype(kind),
        torch.is_autocast_cache_enabled(),
    )
    try:
        torch.set_autocast_enabled(kind, dtype is not None)
        if dtype is not None:
            torch.set_autocast_dtype(kind, dtype)
        torch.set_autocast_cache_enabled(False)
        yield
    finally:
        torch.set_autocast_enabled(kind, saved[0])
        torch.set_autocast_dtype(kind, saved[1])
        torch.set_autocast_cache_enabled(saved[2])
        torch.clear_autocast_cache()


def built(dev_type: str) -> bool:
    """Whether this torch build has ``dev_type`` compiled in (``cpu`` and ``meta`` always).
    Only then does the device have a guard, which some Python bindings of tensor methods ask to
    set the device (whether a device is there is :func:`present`)."""
    if dev_type in ("cpu", "meta"):
        return True
    compiled = getattr(getattr(torch, dev_type, None), "_is_compiled", None)
    return bool(compiled()) if callable(compiled) else False


def simulates_autograd(dev_type: str) -> bool:
    """Whether autograd can run on fake ``dev_type`` tensors here: only where the device is
    :func:`present` (a build that has it compiled in is not enough). On a CPU-only build the
    first op on a fake CUDA tensor that requires grad aborts the process; on a CUDA build without
    a GPU the backward pass asks the device for its streams and raises."""
    return present(dev_type)


def no_autograd_reason(dev_type: str) -> str:
    """Why autograd cannot run on a simulated ``dev_type`` here (see :func:`simulates_autograd`),
    in words for a note or an error."""
    why = "not in this build" if not built(dev_type) else f"this machine has no {dev_type} device"
    return f"torch {torch.__version__} cannot run autograd on a simulated {dev_type} ({why})"


def _index(x: torch.Tensor, index: Any) -> tuple[torch.Tensor, list] | None:
    """``x[index]`` as the indexing binding does it, in ATen ops: integers select, slices
    slice, ``None`` unsqueezes, ``...`` skips dims, and tensors (or lists of integers) are
    kept, at the dim they index, for one ``aten.index`` afterwards. Returns the view and those
    indices; ``None`` for an index it does not read (a bool, two ellipses, anything else)."""
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, bool) for i in index) or sum(i is Ellipsis for i in index) > 1:
        return None
    span = x.dim() - sum(i is not None and i is not Ellipsis for i in index)
    dim, tensors = 0, {}
    for i in index:
        if i is Ellipsis:
            dim += span
        elif i is None:
            x, dim = torch.ops.aten.unsqueeze.default(x, dim), dim + 1
        elif isinstance(i, (int, torch.SymInt)):
            x = torch.ops.aten.select.int(x, dim, i)
        elif isinstance(i, slice):
            if (i.start, i.stop, i.step) != (None, None, None):  # ``:`` is no op
                x = torch.ops.aten.slice.Tensor(x, dim, i.start, i.stop, i.step or 1)
            dim += 1
        elif isinstance(i, torch.Tensor) or (
            isinstance(i, list) and all(isinstance(j, int) and not isinstance(j, bool) for j in i)
        ):
            tensors[dim] = i if isinstance(i, torch.Tensor) else torch.tensor(i, device=x.device)
            dim += 1
        else:
            return None
    return x, [tensors.get(d) for d in range(max(tensors) + 1)] if tensors else []


def _aten_methods(indexing: bool) -> dict[str, Callable]:
    original = {n: getattr(torch.Tensor, n) for n in ("__getitem__", "__setitem__")}

    def copy_(self, src, non_blocking=False):
        return torch.ops.aten.copy_.default(self, src, non_blocking)

    def __getitem__(self, index):
        split = _index(self, index)
        if split is None:
            return original["__getitem__"](self, index)
        view, indices = split
        return torch.ops.aten.index.Tensor(view, indices) if indices else view

    def __setitem__(self, index, value):
        split = _index(self, index)
        if split is None:
            return original["__setitem__"](self, index, value)
        view, indices = split
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(value, dtype=self.dtype, device=self.device)
        if indices:
            torch.ops.aten.index_put_.default(view, indices, value)
        else:
            torch.ops.aten.copy_.default(view, value)

    def contiguous(self, memory_format=torch.contiguous_format):
        if self.is_contiguous(memory_format=memory_format):
            return self
        return torch.ops.aten.clone.default(self, memory_format=memory_format)

    methods = {"copy_": copy_}
    if indexing:
        methods.update(__getitem__=__getitem__, __setitem__=__setitem__, contiguous=contiguous)
    return methods


@contextmanager
def aten_methods(dev_type: str = "cpu") -> Iterator[None]:
    """Tensor methods whose Python bindings set the device up first, which raises for a device
    this build lacks, call their ATen ops directly inside the block (the ops themselves run on
    fake tensors): ``copy_`` always (``out=`` arguments and ``nn.init`` fill tensors through
    it), and where ``dev_type`` is not :func:`built`, indexing, index assignment and
    ``contiguous``, through the ops their bindings call."""
    methods = _aten_methods(indexing=not built(dev_type))
    own = {n: torch.Tensor.__dict__.get(n) for n in methods}  # None: inherited from C
    try:
        for n, m in methods.items():
            setattr(torch.Tensor, n, m)
        yield
    finally:
        for n, m in own.items():
            if m is None:
                delattr(torch.Tensor, n)
            else:
                setattr(torch.Tensor, n, m)


def _fake_like(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A fake tensor on ``dev`` with ``t``'s shape, strides, dtype and ``requires_grad``; a
    parameter stays a parameter. Made inside :func:`tensors` of a simulated device."""
    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(fake, requires_grad=t.requires_grad)
    return fake.requires_grad_(t.requires_grad)


@contextmanager
def _swapped_state(
    modules: Iterable[torch.nn.Module], make: Callable[[torch.Tensor], torch.Tensor]
) -> Iterator[None]:
    """The parameters and buffers of ``modules`` and their submodules replaced by ``make`` of
    each (a tensor shared by two modules stays shared); the originals are put back."""
    made: dict[int, torch.Tensor] = {}
    swapped = []
    try:
        for module in {id(m): m for root in modules for m in root.modules()}.values():
            for slots in (module._parameters, module._buffers):
                for name, t in list(slots.items()):
                    if t is not None:
                        new = made.get(id(t))
                        if new is None:  # made once per tensor, shared or not
                            new = made[id(t)] = make(t)
                        swapped.append((slots, name, t))
                        slots[name] = new
        yield
    finally:
        for slots, name, t in reversed(swapped):
            slots[name] = t


def _moved(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    if t.device == dev:
        return t
    copy = t.detach().to(dev)
    return torch.nn.Parameter(copy, t.requires_grad) if isinstance(t, torch.nn.Parameter) else copy


@contextmanager
def tensors(dev: Target, modules: Iterable[torch.nn.Module] = ()) -> Iterator[None]:
    """Where ``dev`` is simulated, make every tensor created inside fake (shapes, dtypes and
    devices only; ops run their meta kernels, some tensor methods as in :func:`aten_methods`),
    and give the parameters and buffers of ``modules`` fake counterparts on ``dev`` for the
    block, the real ones put back after; on a live device they are copied there for the block
    (the originals put back after), and tensors are made as usual. Where autograd cannot
    run on the device here (:func:`simulates_autograd`), grad mode is off inside, so a module's
    parameters neither abort the process nor fail its backward pass."""
    if not dev.simulated:
        with _swapped_state(modules, lambda t: _moved(t, dev.device)):
            yield
        return

    grad = nullcontext() if simulates_autograd(dev.device.type) else torch.no_grad()
    # A meta kernel that raises is logged at ERROR with its traceback; the caller reports it.
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled = logger.disabled
    logger.disabled = True
    try:
        with (
            fake_mode(allow_non_fake_inputs=False),
            aten_methods(dev.device.type),
            grad,
            _swapped_state(modules, lambda t: _fake_like(t, dev.device)),
        ):
            yield
    finally:
        logger.disabled = disabled


def move(value: Any, dev: Target) -> Any:
    """The tensors of ``value`` (one, or a structure of them) on ``dev``'s device: fake ones of
    the same dtypes and shapes where it is simulated (call it inside :func:`tensors`), else
    ``Tensor.to`` (the same tensor where it is already there)."""

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return _fake_like(t, dev.device) if dev.simulated else t.to(dev.device)

    return tree_map(one, value)


@contextmanager
def simulate(dev_type: str, dtype: torch.dtype | str | None = None) -> Iterator[torch.device]:
    """Run the block on a simulated ``dev_type``: tensors made inside are fake, autocast for
    that device is on with ``dtype`` (off when ``None``), and every switch is restored after.
    Yields the device to make tensors on::

        with device.simulate("cuda", torch.bfloat16) as dev:
            x = torch.randn(4, 16, device=dev)
            torch.softmax(x, -1).dtype  # torch.float32: CUDA autocast runs softmax in float32
    """
    t = target(dev_type, simulate=True)
    with tensors(t), autocast(t, None if dtype is None else _dtypes.autocast_dtype(dtype)):
        yield t.device


def accepts(dev_type: str, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether ``torch.autocast(dev_type, dtype=dtype)`` switches autocast on in this process,
    and the warnings it raised (``""`` when none): autocast disables itself, with a warning,
    for a dtype the device does not support or a device this machine lacks."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast(dev_type, dtype=dtype):
            enabled = torch.is_autocast_enabled(dev_type)
    return enabled, "; ".join(str(w.message) for w in caught)

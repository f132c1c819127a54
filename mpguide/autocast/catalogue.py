"""Every ATen op this torch build registers an autocast kernel for, per device type, with inputs
to call it: the first working sample of torch's own OpInfo for the op (``op_db`` of
``torch.testing._internal``, which needs ``expecttest``, a dependency of mpguide) where one
exists, else a small hand-written call, else none (the op is listed and counted, not probed).

An op is an ATen packet (``conv2d``); the overloads registered on each device are kept. The
OpInfo whose ``aten_name`` (or name) is the packet's provides the call: ``F.conv2d`` for
``conv2d``. An outer overload without an autocast kernel falls through to the inner one, so a
Python call reaches the registered kernel.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mpguide.autocast.calls import Inputs, Op
from mpguide.core.device import NEEDS_HARDWARE
from mpguide.core.table import Table

_KERNEL = re.compile(r"^Autocast(\w+): registered at .*\[kernel\]$", re.MULTILINE)

OPINFO, HAND, NONE = "OpInfo", "hand-written", "no inputs"
"""Where an op's inputs come from."""


@functools.cache
def registered() -> dict[str, dict[str, tuple[str, ...]]]:
    """``{op: {device type: overloads}}`` for every ATen op with an autocast kernel (not a
    fallthrough) on some device, read from this build's dispatcher; ops sorted by name."""
    found: dict[str, dict[str, list[str]]] = {}
    for full in torch._C._dispatch_get_all_op_names():
        if not full.startswith("aten::"):
            continue
        for key in _KERNEL.findall(torch._C._dispatch_dump_table(full)):
            name, _, overload = full.removeprefix("aten::").partition(".")
            found.setdefault(name, {}).setdefault(key.lower(), []).append(overload or "default")
    return {n: {d: tuple(o) for d, o in devs.items()} for n, devs in sorted(found.items())}


def on(dev_type: str) -> tuple[str, ...]:
    """The ops with an autocast kernel on ``dev_type``."""
    return tuple(n for n, devs in registered().items() if dev_type in devs)


# -- inputs ----------------------------------------------------------------------------------


def _hand() -> dict[str, tuple]:
    """Calls for registered ops that no OpInfo names: ``op: (inputs, call)``."""
    ops = torch.ops.aten
    conv = (lambda t: (t(1, 3, 8), t(4, 3, 3), t(4)),)
    cell = {
        "lstm_cell": (lambda t: (t(2, 4), (t(2, 5), t(2, 5)), t(20, 4), t(20, 5), t(20), t(20)),),
        "gru_cell": (lambda t: (t(2, 4), t(2, 5), t(15, 4), t(15, 5), t(15), t(15)),),
        "rnn_tanh_cell": (lambda t: (t(2, 4), t(2, 5), t(5, 4), t(5, 5), t(5), t(5)),),
        "rnn_relu_cell": (lambda t: (t(2, 4), t(2, 5), t(5, 4), t(5, 5), t(5), t(5)),),
    }
    hand = {name: (*args, getattr(torch, name)) for name, args in cell.items()}
    up = {
        "upsample_nearest1d": ((1, 2, 8), "nearest"),
        "upsample_nearest2d": ((1, 2, 4, 4), "nearest"),
        "upsample_nearest3d": ((1, 2, 2, 2, 2), "nearest"),
        "_upsample_nearest_exact1d": ((1, 2, 8), "nearest-exact"),
        "_upsample_nearest_exact2d": ((1, 2, 4, 4), "nearest-exact"),
        "_upsample_nearest_exact3d": ((1, 2, 2, 2, 2), "nearest-exact"),
        "upsample_linear1d": ((1, 2, 8), "linear"),
        "upsample_bilinear2d": ((1, 2, 4, 4), "bilinear"),
        "upsample_bicubic2d": ((1, 2, 4, 4), "bicubic"),
        "upsample_trilinear3d": ((1, 2, 2, 2, 2), "trilinear"),
    }
    for name, (shape, mode) in up.items():
        hand[name] = (
            lambda t, s=shape: (t(*s),),
            lambda x, m=mode: F.interpolate(x, scale_factor=2.0, mode=m),
        )
    for name, mode in (
        ("_upsample_bilinear2d_aa", "bilinear"),
        ("_upsample_bicubic2d_aa", "bicubic"),
    ):
        hand[name] = (
            lambda t: (t(1, 2, 8, 8),),
            lambda x, m=mode: F.interpolate(x, scale_factor=0.5, mode=m, antialias=True),
        )
    for name, dims in (
        ("reflection_pad1d", 3),
        ("reflection_pad2d", 4),
        ("replication_pad1d", 3),
        ("replication_pad2d", 4),
        ("replication_pad3d", 5),
    ):
        hand[name] = (
            lambda t, d=dims: (t(*(1, 2, 4, 4, 4)[:d]),),
            lambda x, n=name, d=dims: getattr(ops, n)(x, [1, 1] * (d - 2)),
        )
    hand.update(
        _addmm_activation=(lambda t: (t(4), t(3, 5), t(5, 4)), torch._addmm_activation),
        convolution=(
            *conv,
            lambda x, w, b: torch.convolution(x, w, b, [1], [0], [1], False, [0], 1),
        ),
        _convolution=(
            *conv,
            lambda x, w, b: ops._convolution(
                x, w, b, [1], [0], [1], False, [0], 1, False, False, True, True
            ),
        ),
        cudnn_convolution=(
            lambda t: (t(1, 3, 8, 8), t(4, 3, 3, 3)),
            lambda x, w: torch.cudnn_convolution(
                x, w, [0, 0], [1, 1], [1, 1], 1, False, False, True
            ),
        ),
        cudnn_convolution_transpose=(
            lambda t: (t(1, 3, 8, 8), t(3, 4, 3, 3)),
            lambda x, w: torch.cudnn_convolution_transpose(
                x, w, [0, 0], [0, 0], [1, 1], [1, 1], 1, False, False, True
            ),
        ),
        conv_tbc=(
            lambda t: (t(8, 2, 3), t(3, 3, 4), t(4)),
            lambda x, w, b: torch.conv_tbc(x, w, b),
        ),
        _grid_sampler_2d_cpu_fallback=(
            lambda t: (t(1, 2, 4, 4), t.unit(1, 3, 3, 2) * 2 - 1),
            lambda x, g: torch._grid_sampler_2d_cpu_fallback(x, g, 0, 0, False),
        ),
        grid_sampler=(
            lambda t: (t(1, 2, 4, 4), t.unit(1, 3, 3, 2) * 2 - 1),
            lambda x, g: torch.grid_sampler(x, g, 0, 0, False),
        ),
        _lu_with_info=(lambda t: (t(4, 4),), lambda a: torch._lu_with_info(a)[0]),
        inverse=(lambda t: (t.spd(4),), torch.inverse),
        orgqr=(lambda t: (t(5, 4), t(4)), torch.orgqr),
        _native_multi_head_attention=(
            lambda t: (t(2, 3, 8), t(2, 3, 8), t(2, 3, 8), t(24, 8), t(24), t(8, 8), t(8)),
            lambda q, k, v, wi, bi, wo, bo: ops._native_multi_head_attention(
                q, k, v, 8, 2, wi, bi, wo, bo
            )[0],
        ),
        _scaled_dot_product_flash_attention=(
            lambda t: (t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8)),
            lambda q, k, v: ops._scaled_dot_product_flash_attention(q, k, v)[0],
        ),
        _thnn_fused_lstm_cell=(
            lambda t: (t(2, 20), t(2, 20), t(2, 5)),
            lambda i, h, c: ops._thnn_fused_lstm_cell(i, h, c)[0],
        ),
        _thnn_fused_gru_cell=(
            lambda t: (t(2, 15), t(2, 15), t(2, 5)),
            lambda i, h, hx: ops._thnn_fused_gru_cell(i, h, hx)[0],
        ),
        chain_matmul=(lambda t: (t(3, 4), t(4, 5), t(5, 2)), torch.chain_matmul),
        cross_entropy_loss=(lambda t: (t(4, 8), t.index(8, 4)), F.cross_entropy),
        nll_loss2d=(
            lambda t: (torch.log_softmax(t(2, 3, 4, 4), 1), t.index(3, 2, 4, 4)),
            F.nll_loss,
        ),
        multilabel_margin_loss_forward=(
            lambda t: (t(3, 4), t.index(4, 3, 4)),
            lambda x, y: ops.multilabel_margin_loss_forward(x, y, 1)[0],
        ),
        fake_quantize_per_tensor_affine=(
            lambda t: (t(4, 8),),
            lambda x: torch.fake_quantize_per_tensor_affine(x, 0.1, 0, 0, 255),
        ),
        frobenius_norm=(lambda t: (t(4, 8),), lambda x: torch.frobenius_norm(x, [0, 1])),
        nuclear_norm=(lambda t: (t(4, 8),), torch.nuclear_norm),
    )
    return hand


@contextmanager
def _import_contained() -> Iterator[None]:
    """Undo what importing torch's OpInfo database (through its ``common_utils``) does to this
    process, as seen on torch 2.11.0+cu130, 2.13.0+cpu and 2.14.1+cu130:

    - it calls ``torch.backends.disable_global_flags()``, after which setting a flag such as
      ``torch.backends.cudnn.allow_tf32`` outside ``torch.backends.flags()`` raises: thawed
      again on leaving, unless they were frozen before (all three; torch has no public
      ``enable_global_flags``);
    - without hypothesis it warns ``ImportWarning`` "Fail to import hypothesis" (all three), an
      error where warnings are errors (the docs build): ignored;
    - on a CUDA build without a CUDA runtime ``torch.utils.cpp_extension`` logs "No CUDA runtime
      is found" to stderr at import (2.11.0+cu130 and 2.14.1+cu130): that logger is off;
    - where a GPU is present it imports ``numba.cuda``, whose import warns
      ``DeprecationWarning`` on NumPy's generic timedelta unit (numba-cuda beside numpy 2.4, on
      an H100 with 2.11.0+cu130): ignored.

    Left alone: it sets ``TORCHINDUCTOR_CACHE_DIR`` to the folder inductor uses by default
    (all three). It reads ``sys.argv`` only in ``run_tests``, which is never called here.
    """
    frozen = torch.backends.flags_frozen()
    cpp_log = logging.getLogger("torch.utils.cpp_extension")
    disabled = cpp_log.disabled
    try:
        cpp_log.disabled = True
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Fail to import hypothesis", ImportWarning)
            warnings.filterwarnings("ignore", "The 'generic' unit for NumPy", DeprecationWarning)
            yield
    finally:
        cpp_log.disabled = disabled
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = not frozen


@functools.cache
def _op_db() -> list | None:
    """torch's OpInfo database, or ``None`` where it cannot be imported (no ``expecttest``);
    imported once, its side effects undone by :func:`_import_contained`."""
    name = "torch.testing._internal.common_methods_invocations"
    if name not in sys.modules:
        try:
            with _import_contained():
                importlib.import_module(name)
        except ImportError:
            return None
    return sys.modules[name].op_db


def has_samples() -> bool:
    """Whether torch's OpInfo samples can be imported here (they need ``expecttest``); without
    them every op takes its hand-written call, or none."""
    return _op_db() is not None


def _n_floats(value) -> int:
    leaves = torch.utils._pytree.tree_leaves(value)
    return sum(isinstance(x, torch.Tensor) and x.is_floating_point() for x in leaves)


def _first_sample(info) -> tuple | None:
    """A float32 CPU sample of an OpInfo that runs, as ``(args, kwargs)``: of its first six,
    the first with two or more floating tensors (so the mixed-input run exists), else the
    first that runs."""
    found = None
    with torch.random.fork_rng(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        try:
            # The raw generator: ``sample_inputs`` wraps it in a tracker that inspects the stack.
            samples = info.sample_inputs_func(info, "cpu", torch.float32, False)
            for _, sample in zip(range(6), samples, strict=False):
                args = (sample.input, *sample.args)
                try:
                    info.op(*args, **sample.kwargs)
                except Exception:  # noqa: BLE001, S112 - try the next sample
                    continue
                if _n_floats((args, sample.kwargs)) >= 2:
                    return args, dict(sample.kwargs)
                found = found or (args, dict(sample.kwargs))
        except Exception:  # noqa: BLE001 - a sample generator that fails gives no more inputs
            return found
    return found


def _from_sample(info, args: tuple, kwargs: dict) -> tuple:
    """An :class:`Op`'s ``inputs`` and ``call`` for one OpInfo sample: the sample's tensors are
    cloned onto the probed device (fake ones where it is simulated)."""

    def inputs(t: Inputs) -> tuple:
        def move(x):
            if not isinstance(x, torch.Tensor):
                return x
            if t.gen is None:
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=t.dev)
            return x.clone().to(t.dev)

        return torch.utils._pytree.tree_map(move, (args, kwargs))

    return inputs, lambda a, k: info.op(*a, **k)


@dataclass(frozen=True)
class Entry:
    """One registered op: its overloads per device, and the call that probes it (``None``
    where neither an OpInfo nor a hand-written call exists)."""

    name: str
    devices: dict[str, tuple[str, ...]]
    source: str
    op: Op | None


def _keys(info) -> tuple[str, ...]:
    return (
        info.aten_name,
        info.name.replace(".", "_"),
        info.name.removeprefix("nn.functional."),
    )


@functools.cache
def entries() -> tuple[Entry, ...]:
    """Every registered op with the call that probes it, by name."""
    reg = registered()
    infos: dict[str, list] = {}
    for info in _op_db() or ():
        if info.variant_test_name in ("", "default"):
            for key in dict.fromkeys(_keys(info)):
                if key in reg:
                    infos.setdefault(key, []).append(info)
    hand = _hand()
    out = []
    for name, devices in reg.items():
        op, source = None, NONE
        for info in infos.get(name, ()):
            sample = _first_sample(info)
            if sample is not None:
                inputs, call = _from_sample(info, *sample)
                op, source = Op(name, f"{OPINFO} {info.name}", inputs, call), OPINFO
                break
        if op is None and name in hand:
            inputs, call = hand[name]
            op, source = Op(name, HAND, inputs, call), HAND
        out.append(Entry(name, devices, source, op))
    return tuple(out)


def ops() -> tuple[Op, ...]:
    """The probe calls of every registered op that has one."""
    return tuple(e.op for e in entries() if e.op is not None)


def coverage(policies) -> Table:
    """Per device of ``policies`` (probes of :func:`ops` on several devices, a
    :class:`~mpguide.autocast.policy.Devices`): how many ops it registers an autocast kernel
    for (and overloads), how many of those were probed and how many the probe decided; and of
    every op probed there (those registered on other devices too), how many were decided."""
    rows = []
    for p in policies.policies:
        names = on(p.device)
        with_inputs = [n for n in names if p.has(n)]
        decided = [n for n in with_inputs if p.kind(n) != NEEDS_HARDWARE]
        overloads = sum(len(registered()[n][p.device]) for n in names)
        rows.append(
            (
                p.device,
                p.how,
                f"{len(names)} ({overloads})",
                len(with_inputs),
                len(decided),
                len(with_inputs) - len(decided),
                len(names) - len(with_inputs),
                f"{sum(x.kind != NEEDS_HARDWARE for x in p.probes)} of {len(p.probes)}",
            )
        )
    return Table(
        (
            "device",
            "obtained",
            "ops (overloads)",
            "probed",
            "decided",
            NEEDS_HARDWARE,
            NONE,
            "every probed op: decided",
        ),
        tuple(rows),
        f"ops with an autocast kernel, torch {torch.__version__}, dtype "
        f"{str(policies.dtype).removeprefix('torch.')}",
    )

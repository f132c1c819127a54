"""Synthetic chrome traces shaped like ``torch.profiler``'s, for tests and benchmarks.

:func:`generate` yields the events of a training-like trace: transformer layers of ops
(linear, layer_norm, gelu, softmax, add) under autocast, with the casts autocast inserts,
shapes and argument lists like a real export, ``ProfilerStep#N`` ranges, and optionally a
``python_function`` layer, GPU kernels with their launches and flow events, several
threads. Each generated event records the index of the event it was nested in (``parent``),
so a test can check a tree against the truth. Traces of several ranks, merged, come from one
:func:`generate` per rank with its own process ids, clock offset and first correlation id.
:func:`write` streams a trace to disk.
"""

from __future__ import annotations

import gzip
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

BASE_US = 4_402_438_546_026.403
GPU_PID, GPU_TID = 0, 7
_BF16, _F32 = "c10::BFloat16", "float"
_CODES = {_BF16: "15", _F32: "6"}


@dataclass
class _Op:
    name: str
    dims: list
    types: list
    concrete: list
    kernel: bool = False
    children: tuple = ()


def _leaf(name: str, dims: list, types: list, kernel: bool = True) -> _Op:
    return _Op(name, dims, types, [""] * len(dims), kernel)


def _cast(shape: list, src: str, dst: str) -> _Op:
    code = _CODES[dst]
    copy = _Op("aten::copy_", [shape, shape, []], [dst, src, "Scalar"], ["", "", "False"], True)
    empty = _Op(
        "aten::empty_strided",
        [[], [], [], [], [], []],
        ["ScalarList", "ScalarList", "Scalar", "Scalar", "", "Scalar"],
        [str(shape), str([shape[-1], 1]), code, "0", "", "False"],
    )
    to_copy = _Op(
        "aten::_to_copy",
        [shape, [], [], [], [], [], []],
        [src, "Scalar", "", "", "", "Scalar", ""],
        ["", code, "", "", "", "False", ""],
        children=(empty, copy),
    )
    return _Op(
        "aten::to",
        [shape, [], [], [], []],
        [src, "Scalar", "Scalar", "Scalar", ""],
        ["", code, "False", "False", ""],
        children=(to_copy,),
    )


def _linear(rows: int, d_in: int, d_out: int) -> _Op:
    """``aten::linear`` under autocast: the fp32 weight and bias cast to bf16 inside it."""
    w = [d_out, d_in]
    t = _Op(
        "aten::t",
        [w],
        [_BF16],
        [""],
        children=(
            _Op(
                "aten::transpose",
                [w, [], []],
                [_BF16, "Scalar", "Scalar"],
                ["", "0", "1"],
                children=(_leaf("aten::as_strided", [w, [], [], []], [_BF16, "", "", ""], False),),
            ),
        ),
    )
    addmm = _leaf(
        "aten::addmm",
        [[d_out], [rows, d_in], [d_in, d_out], [], []],
        [_BF16, _BF16, _BF16, "Scalar", "Scalar"],
    )
    inner = _Op(
        "aten::linear",
        [[rows, d_in], w, [d_out]],
        [_BF16, _BF16, _BF16],
        ["", "", ""],
        children=(t, addmm),
    )
    return _Op(
        "aten::linear",
        [[rows, d_in], w, [d_out]],
        [_BF16, _F32, _F32],
        ["", "", ""],
        children=(_cast(w, _F32, _BF16), _cast([d_out], _F32, _BF16), inner),
    )


def _layer_norm(rows: int, d: int) -> _Op:
    """``aten::layer_norm`` under autocast on a GPU: its bf16 input cast to fp32 inside it."""
    native = _Op(
        "aten::native_layer_norm",
        [[rows, d], [], [d], [d], []],
        [_F32, "ScalarList", _F32, _F32, "Scalar"],
        ["", f"[{d}]", "", "", "1e-05"],
        True,
        children=tuple(
            _leaf(
                "aten::empty",
                [[], [], [], [], [], []],
                ["ScalarList", "Scalar", "Scalar", "", "", ""],
                False,
            )
            for _ in range(3)
        ),
    )

    def layer_norm(dtype: str, children: tuple) -> _Op:
        return _Op(
            "aten::layer_norm",
            [[rows, d], [], [d], [d], [], []],
            [dtype, "ScalarList", _F32, _F32, "Scalar", "Scalar"],
            ["", f"[{d}]", "", "", "1e-05", "True"],
            children=children,
        )

    return layer_norm(_BF16, (_cast([rows, d], _BF16, _F32), layer_norm(_F32, (native,))))


def _layer(rows: int, d: int) -> list[_Op]:
    """One transformer-like layer under autocast on a GPU: norms run in float32."""
    return [
        _layer_norm(rows, d),
        _linear(rows, d, 3 * d),
        _Op(
            "aten::softmax",
            [[rows, d], [], []],
            [_BF16, "Scalar", ""],
            ["", "-1", ""],
            children=(_leaf("aten::_softmax", [[rows, d], [], []], [_BF16, "Scalar", "Scalar"]),),
        ),
        _linear(rows, d, d),
        _leaf("aten::add", [[rows, d], [rows, d], []], [_BF16, _BF16, "Scalar"]),
        _layer_norm(rows, d),
        _linear(rows, d, 4 * d),
        _leaf("aten::gelu", [[rows, 4 * d], []], [_BF16, ""]),
        _linear(rows, 4 * d, d),
        _leaf("aten::add", [[rows, d], [rows, d], []], [_BF16, _BF16, "Scalar"]),
    ]


def _strides(dims: list) -> list:
    out, step = [], 1
    for d in reversed(dims):
        out.append(step)
        step *= d
    return out[::-1]


def _size(op: _Op) -> int:
    return 1 + sum(_size(c) for c in op.children)


_LAYER_OPS = sum(_size(op) for op in _layer(1, 1))


class _Writer:
    """Lays ops out in time on one thread and turns them into events."""

    def __init__(
        self,
        rng: random.Random,
        pid: int,
        tid: int,
        python: bool,
        gpu: bool,
        counters: dict[str, int],
        gpu_pid: int,
        now: int,
    ):
        self.rng, self.pid, self.tid = rng, pid, tid
        self.python, self.gpu, self.counters = python, gpu, counters
        self.gpu_pid = gpu_pid
        self.now = now
        self.gpu_now = now

    def _next(self, key: str) -> int:
        self.counters[key] += 1
        return self.counters[key]

    def _event(self, out: list, parent: int, **fields: Any) -> int:
        fields.setdefault("pid", self.pid)
        fields.setdefault("tid", self.tid)
        fields["parent"] = parent
        out.append(fields)
        return len(out) - 1

    def span(self, out: list, parent: int, name: str, cat: str, args: dict) -> int:
        """Open an event now; :meth:`close` sets its duration."""
        self.now += self.rng.randint(1_000, 4_000)
        return self._event(out, parent, ph="X", cat=cat, name=name, ts=self.now, dur=0, args=args)

    def close(self, out: list, i: int) -> None:
        self.now += self.rng.randint(500, 3_000)
        out[i]["dur"] = self.now - out[i]["ts"]

    def op(self, out: list, parent: int, op: _Op) -> None:
        i = self.span(
            out,
            parent,
            op.name,
            "cpu_op",
            {
                "External id": self._next("external"),
                "Sequence number": self._next("sequence"),
                "Fwd thread id": 0,
                "Record function id": 0,
                "Concrete Inputs": op.concrete,
                "Input type": op.types,
                "Input Strides": [_strides(d) for d in op.dims],
                "Input Dims": op.dims,
                "Ev Idx": self.counters["external"],
            },
        )
        for child in op.children:
            self.op(out, i, child)
        if self.gpu and op.kernel:
            self.launch(out, i, op.name)
        self.close(out, i)

    def launch(self, out: list, parent: int, name: str) -> None:
        corr = self._next("correlation")
        launch = self.span(
            out,
            parent,
            "cudaLaunchKernel",
            "cuda_runtime",
            {"External id": self.counters["external"], "cbid": 211, "correlation": corr},
        )
        self.now += self.rng.randint(2_000, 6_000)
        self.close(out, launch)
        start = max(self.gpu_now, out[launch]["ts"] + 3_000) + self.rng.randint(200, 900)
        dur = self.rng.randint(2_000, 40_000)
        self.gpu_now = start + dur
        kernel_name = f"void at::native::kernel_{name.removeprefix('aten::')}<float>"
        self._event(
            out,
            launch,
            ph="X",
            cat="kernel",
            name=kernel_name,
            pid=self.gpu_pid,
            tid=GPU_TID,
            ts=start,
            dur=dur,
            args={
                "External id": self.counters["external"],
                "device": 0,
                "stream": 7,
                "correlation": corr,
                "grid": [128, 1, 1],
                "block": [256, 1, 1],
            },
        )
        self._event(
            out, -2, ph="s", id=corr, cat="ac2g", name="ac2g", ts=out[launch]["ts"], args=None
        )
        self._event(
            out,
            -2,
            ph="f",
            id=corr,
            cat="ac2g",
            name="ac2g",
            bp="e",
            pid=self.gpu_pid,
            tid=GPU_TID,
            ts=start,
            args=None,
        )

    def module(self, out: list, parent: int, op: _Op, index: int) -> None:
        if not self.python:
            self.op(out, parent, op)
            return
        module = self.span(
            out,
            parent,
            f"nn.Module: Block_{index}",
            "python_function",
            {"Python parent id": None, "Python id": self._next("python")},
        )
        frame = self.span(
            out,
            module,
            "torch/nn/modules/module.py(1784): _call_impl",
            "python_function",
            {"Python parent id": self.counters["python"], "Python id": self._next("python")},
        )
        self.op(out, frame, op)
        self.close(out, frame)
        self.close(out, module)


def generate(
    ops: int,
    *,
    python: bool = False,
    gpu: bool = False,
    threads: int = 1,
    layers_per_step: int = 4,
    rows: int = 512,
    width: int = 1024,
    seed: int = 0,
    pid: int = 1000,
    gpu_pid: int = GPU_PID,
    correlation: int = 0,
    offset_ns: int = 0,
) -> Iterator[dict[str, Any]]:
    """Events of a synthetic trace with about ``ops`` cpu_op events (whole layers).

    Each event is a dict in chrome-trace form plus ``parent``: the index of the event it
    nests in (-1 for a root, -2 for a flow event, which is not a node). Flow and GPU events
    follow the CPU events they belong to, so indices increase in file order. The CPU events
    are in process ``pid``, the GPU events in ``gpu_pid``; correlation ids start after
    ``correlation``; the clock starts at ``offset_ns``.
    """
    rng = random.Random(seed)
    counters = {"external": 0, "correlation": correlation, "python": 0, "sequence": 0}
    writers = [
        _Writer(rng, pid, 1000 + t, python, gpu, counters, gpu_pid, offset_ns)
        for t in range(threads)
    ]
    produced = 0
    offset = 0
    step = 0
    while produced < ops:
        out: list[dict[str, Any]] = []
        main = writers[0]
        root = main.span(
            out,
            -1,
            f"ProfilerStep#{step}",
            "user_annotation",
            {"External id": main._next("external")},
        )
        for k in range(layers_per_step):
            for t, w in enumerate(writers):
                if produced >= ops:
                    break
                for j, op in enumerate(_layer(rows, width)):
                    w.module(out, root if t == 0 else -1, op, k * 100 + j)
                produced += _LAYER_OPS
        main.close(out, root)
        step += 1
        for e in out:
            if e["parent"] >= 0:
                e["parent"] += offset
            yield e
        offset += len(out)


def _json(e: dict[str, Any]) -> dict[str, Any]:
    """Chrome-trace form: microseconds with nanosecond decimals, no ``parent`` key."""
    out = {k: v for k, v in e.items() if k != "parent" and v is not None}
    out["ts"] = round(BASE_US + e["ts"] / 1000, 3)
    if "dur" in out:
        out["dur"] = e["dur"] / 1000
    return out


def write(path: str | Path, ops: int, **options: Any) -> Path:
    """Write a synthetic trace of about ``ops`` cpu_op events (gzipped if the name ends in
    ``.gz``) and return its path; ``options`` go to :func:`generate`."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    encode = msgspec.json.Encoder().encode
    with opener(path, "wb") as f:
        f.write(b'{"schemaVersion": 1, "deviceProperties": [], "traceEvents": [\n')
        f.write(
            b'{"ph": "M", "name": "process_name", "pid": 1000, "tid": 0, "ts": 0, '
            b'"args": {"name": "python"}}'
        )
        for e in generate(ops, **options):
            f.write(b",\n")
            f.write(encode(_json(e)))
        f.write(b"\n]}\n")
    return path

"""Error statistics against a float64 reference, and matmul error tables per precision mode.

A matmul table runs ``a @ b`` on seeded standard-normal float32 inputs for each shape and mode
and compares with the float64 product of the same inputs. Modes:

- ``fp32``: IEEE float32, every precision switch off;
- ``tf32``, ``bfloat16``, ``float16``, fp8 formats: on CUDA the hardware path (the TF32
  switch, low-precision inputs, :func:`torch._scaled_mm` for fp8); elsewhere emulated: inputs
  rounded to the format by :mod:`mpguide.precision.formats`, products accumulated in IEEE float32;
- ``fp32_precision=VALUE``: each other value the device's matmul backend accepts for its
  ``fp32_precision`` switch, run on the hardware and marked when it changed nothing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from mpguide import MPGuideError, error_line
from mpguide.core import device as _device
from mpguide.core import switches, timing
from mpguide.core.table import Table
from mpguide.precision import formats

log = logging.getLogger(__name__)

DEFAULT_MODES = ("fp32", "tf32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
HARDWARE, EMULATED, NO_EFFECT = "hardware", "emulated", "switch had no effect"
_BACKENDS = {"cuda": "cuda.matmul", "cpu": "mkldnn.matmul"}


@dataclass(frozen=True)
class ErrorStats:
    """How far an approximate result is from a float64 reference."""

    max_abs: float
    max_rel: float
    rms: float
    mean: float

    def __repr__(self) -> str:
        return (
            f"max |error| {self.max_abs:.3g}, max |error| / mean |ref| {self.max_rel:.3g}, "
            f"RMS {self.rms:.3g}, mean signed {self.mean:.3g}"
        )


def errors(approx: torch.Tensor, ref: torch.Tensor) -> ErrorStats:
    """Max absolute error, max absolute error over mean ``|ref|``, RMS and mean signed error
    of ``approx`` against ``ref``, computed in float64. Against a reference of zeros, the
    relative error is 0 where ``approx`` is exact and infinite where it is not."""
    if approx.shape != ref.shape:
        raise MPGuideError(f"shapes differ: {tuple(approx.shape)} against {tuple(ref.shape)}")
    if ref.numel() == 0:
        raise MPGuideError("no values to compare")
    ref = ref.double()
    diff = approx.double() - ref
    max_abs = diff.abs().max().item()
    scale = ref.abs().mean().item()
    return ErrorStats(
        max_abs=max_abs,
        max_rel=max_abs / scale if scale else 0.0 if max_abs == 0 else math.inf,
        rms=diff.square().mean().sqrt().item(),
        mean=diff.mean().item(),
    )


@dataclass(frozen=True)
class MatmulRow:
    """One mode at one shape."""

    mode: str
    shape: tuple[int, int, int]
    how: str
    stats: ErrorStats
    seconds: float | None

    @property
    def tflops(self) -> float | None:
        if self.seconds is None:
            return None
        m, k, n = self.shape
        return 2 * m * k * n / self.seconds / 1e12


@dataclass(frozen=True)
class MatmulErrors:
    """A matmul error table: one row per shape and mode, on one device."""

    rows: tuple[MatmulRow, ...]
    caption: str

    def row(self, mode: str, shape: tuple[int, int, int] | None = None) -> MatmulRow:
        """The row of ``mode`` (at ``shape``, needed when the table has several shapes)."""
        found = [r for r in self.rows if r.mode == mode and shape in (None, r.shape)]
        if len(found) != 1:
            raise MPGuideError(f"{len(found)} rows for mode {mode!r} at shape {shape}")
        return found[0]

    def table(self) -> Table:
        rows = tuple(
            (
                r.mode,
                " x ".join(map(str, r.shape)),
                r.how,
                r.stats.max_rel,
                r.stats.max_abs,
                r.stats.rms,
                r.stats.mean,
                r.seconds,
                r.tflops,
            )
            for r in self.rows
        )
        columns = (
            "mode",
            "M x K x N",
            "how",
            "max err / mean |ref|",
            "max |err|",
            "RMS err",
            "mean err",
            "seconds",
            "TFLOP/s",
        )
        note = (
            f"'{EMULATED}': inputs rounded to the format, products accumulated in IEEE fp32 "
            "(where a hardware path failed, the row says why). "
            f"'{NO_EFFECT}': results bit-identical to the fp32 row. Seconds: median after "
            "warm-up, hardware rows only."
        )
        return Table(columns, rows, self.caption, (note,))

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def switch_modes(dev: torch.device) -> tuple[str, ...]:
    """``fp32_precision=VALUE`` for each value other than ``ieee`` that the matmul switch of
    ``dev``'s backend accepts in the installed torch."""
    backend = _BACKENDS.get(dev.type)
    if backend is None:
        return ()
    accepted = []
    for value in ("tf32", "bf16"):
        try:
            with switches.precision({f"{backend}.fp32_precision": value}):
                accepted.append(f"fp32_precision={value}")
        except MPGuideError:
            pass
    return tuple(accepted)


def _scaled_mm(a8: torch.Tensor, b8: torch.Tensor) -> torch.Tensor:
    one = torch.ones((), device=a8.device)
    return torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.float32)


def _fp8_operands(a: torch.Tensor, b: torch.Tensor, dt: torch.dtype):
    """``a`` row-major and ``b`` column-major in fp8, as :func:`torch._scaled_mm` wants."""
    return a.to(dt), b.t().contiguous().to(dt).t()


Run = tuple[dict[str, str], Callable[[], torch.Tensor]]


def _hardware(mode: str, a: torch.Tensor, b: torch.Tensor) -> Run | str | None:
    """The switch settings and the call of ``mode``'s hardware path on ``a``'s device; None
    where there is no such path; why, where the path exists but failed."""
    dev = a.device
    if mode == "fp32":
        return {}, partial(torch.matmul, a, b)
    if mode.startswith("fp32_precision="):
        settings = {f"{_BACKENDS[dev.type]}.fp32_precision": mode.split("=", 1)[1]}
        return settings, partial(torch.matmul, a, b)
    if dev.type != "cuda":
        return None
    if mode == "tf32":
        return {"cuda.matmul.fp32_precision": "tf32"}, partial(torch.matmul, a, b)
    fmt = formats.get(mode)
    if fmt.bits == 16:
        return {}, partial(torch.matmul, a.to(fmt.dtype), b.to(fmt.dtype))
    capability = torch.cuda.get_device_capability(dev)
    if fmt.bits == 8 and capability >= (8, 9):
        try:
            _scaled_mm(*_fp8_operands(a[:16, :16], b[:16, :16], fmt.dtype))
        except (RuntimeError, ValueError) as err:  # e5m2 x e5m2: ValueError in torch 2.11
            return f"torch._scaled_mm raised {error_line(err)}"
        return {}, partial(_scaled_mm, *_fp8_operands(a, b, fmt.dtype))
    return None


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in IEEE fp32."""
    with switches.precision(switches.inheriting()):
        return a @ b


def matmul_errors(
    shapes: Sequence[tuple[int, int, int]],
    modes: Sequence[str] = DEFAULT_MODES,
    dev: torch.device | str | None = None,
    *,
    seed: int = 0,
    repeats: int = 3,
    emulate: bool = False,
) -> MatmulErrors:
    """Errors of ``a @ b`` (shape ``M x K`` times ``K x N``) for each shape and mode against
    float64; ``fp32`` is always measured, and the switch modes of :func:`switch_modes` are
    added (on CUDA, ``tf32`` is the switch itself). ``emulate=True`` emulates every
    low-precision format, even where hardware could run it."""
    dev = _device.pick() if dev is None else torch.device(dev)
    for mode in modes:
        if mode != "fp32" and not mode.startswith("fp32_precision="):
            formats.get(mode)
    modes = ("fp32", *(m for m in modes if m != "fp32"))
    covered = {"fp32_precision=tf32"} if dev.type == "cuda" and "tf32" in modes else set()
    modes += tuple(m for m in switch_modes(dev) if m not in modes and m not in covered)
    gen = torch.Generator(device=dev).manual_seed(seed)
    rows = []
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=gen, device=dev)
        b = torch.randn(k, n, generator=gen, device=dev)
        ref = a.double() @ b.double()
        fp32_out = None
        for mode in modes:
            asked = emulate and not mode.startswith("fp32")
            run = None if asked else _hardware(mode, a, b)
            if run is None or isinstance(run, str):
                fmt = formats.get(mode)
                out, seconds = _matmul(fmt.round(a), fmt.round(b)), None
                how = EMULATED if run is None else f"{EMULATED}: {run}"
                if run is not None:
                    log.info("%s at %s emulated because %s", mode, (m, k, n), run)
            else:
                settings, call = run
                with switches.precision({**switches.inheriting(), **settings}):
                    out, how = call(), HARDWARE
                    seconds = timing.measure(call, dev, warmup=1, repeat=repeats).median
            if mode == "fp32":
                fp32_out = out
            elif how == HARDWARE and out.dtype == fp32_out.dtype and torch.equal(out, fp32_out):
                how = NO_EFFECT
            rows.append(MatmulRow(mode, (m, k, n), how, errors(out, ref), seconds))
    caption = f"matmul errors against float64, {_device.describe(dev).caption()}"
    return MatmulErrors(tuple(rows), caption)


def accumulate(a: torch.Tensor, b: torch.Tensor, name: str) -> torch.Tensor:
    """``a @ b`` for float32 inputs emulated entirely in format ``name``: inputs rounded, then
    the products summed one ``k`` at a time with every partial sum rounded to the format (a
    sequential, worst-case order; hardware usually accumulates in fp32)."""
    fmt = formats.get(name)
    ra, rb = fmt.round(a), fmt.round(b)
    acc = torch.zeros(a.shape[0], b.shape[1], device=a.device)
    for k in range(a.shape[1]):
        acc = fmt.round(acc + ra[:, k, None] * rb[None, k, :])
    return acc


@dataclass(frozen=True)
class SweepRow:
    """One format and accumulation at one reduction length ``k``."""

    format: str
    accumulation: str
    k: int
    stats: ErrorStats


@dataclass(frozen=True)
class KSweep:
    """Matmul errors against the reduction length ``K``, per format and accumulation."""

    rows: tuple[SweepRow, ...]
    caption: str

    def series(self, fmt: str, accumulation: str = "fp32") -> tuple[list[int], list[ErrorStats]]:
        """The ``K`` values and their error statistics for one format and accumulation."""
        rows = [r for r in self.rows if r.format == fmt and r.accumulation == accumulation]
        if not rows:
            raise MPGuideError(f"no rows for format {fmt!r} accumulated in {accumulation!r}")
        return [r.k for r in rows], [r.stats for r in rows]

    def curves(self) -> tuple[tuple[str, str], ...]:
        """Every (format, accumulation) pair, in measuring order."""
        return tuple(dict.fromkeys((r.format, r.accumulation) for r in self.rows))

    def table(self) -> Table:
        """Max error over mean ``|ref|``: one row per ``K``, one column per curve."""
        curves = self.curves()
        by_key = {(r.format, r.accumulation, r.k): r.stats.max_rel for r in self.rows}
        ks = dict.fromkeys(r.k for r in self.rows)
        rows = tuple((k, *(by_key[f, a, k] for f, a in curves)) for k in ks)
        columns = ("K", *(f"{f}, {a} acc." for f, a in curves))
        return Table(columns, rows, f"max error / mean |ref|: {self.caption}")

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def k_sweep(
    ks: Sequence[int],
    names: Sequence[str] = ("tf32", "bfloat16", "float16"),
    accumulate_in: Sequence[str] = ("bfloat16", "float16"),
    dev: torch.device | str | None = None,
    *,
    m: int = 32,
    n: int = 32,
    seed: int = 0,
) -> KSweep:
    """Errors of an ``m x K`` by ``K x n`` matmul against float64 for each ``K``: fp32, each
    format of ``names`` emulated with fp32 accumulation, and each of ``accumulate_in``
    accumulated in its own format (:func:`accumulate`). The inputs of a smaller ``K`` are
    the first columns (rows) of the largest one's."""
    dev = _device.pick() if dev is None else torch.device(dev)
    if not ks or min(ks) < 1:
        raise MPGuideError(f"reduction lengths must be positive, got {list(ks)}")
    for name in (*names, *accumulate_in):
        formats.get(name)
    gen = torch.Generator(device=dev).manual_seed(seed)
    a_full = torch.randn(m, max(ks), generator=gen, device=dev)
    b_full = torch.randn(max(ks), n, generator=gen, device=dev)
    rows = []
    for k in ks:
        a, b = a_full[:, :k], b_full[:k]
        ref = a.double() @ b.double()
        rows.append(SweepRow("float32", "fp32", k, errors(_matmul(a, b), ref)))
        for name in names:
            fmt = formats.get(name)
            out = _matmul(fmt.round(a), fmt.round(b))
            rows.append(SweepRow(fmt.name, "fp32", k, errors(out, ref)))
        for name in accumulate_in:
            fmt = formats.get(name)
            rows.append(SweepRow(fmt.name, fmt.name, k, errors(accumulate(a, b, name), ref)))
    caption = f"errors against K, {_device.describe(dev).caption()}"
    return KSweep(tuple(rows), caption)

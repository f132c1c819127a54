"""Record the facts that change between torch releases, on the running torch, as JSON.

Three groups, each a flat mapping so two recordings compare key by key:

- ``autocast``: the class and output dtypes of every op of :data:`mpguide.autocast.policy.CATALOGUE`
  under autocast, for cpu (live) and each of cuda, mps and xpu this build can simulate, in
  bf16 and fp16;
- ``switches``: the defaults of the precision switches (TF32, reduced-precision reductions,
  the ``fp32_precision`` tree, matmul precision, autocast's default dtypes, inductor's
  rounding emulation), read in a fresh process;
- ``facts``: one probe per fact of :data:`mpguide.core.versions.CHANGES` (and a few more),
  registered with :func:`fact`, returning a short observation (``"float32"``, ``"raises
  RuntimeError"``).

``python -m mpguide.versions.probes --out DIR`` writes ``DIR/<torch>.json``;
``nox -s versions`` runs it on every release of the supported window.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mpguide import MPGuideError, error_line
from mpguide.autocast import catalogue, policy
from mpguide.core import device, dtypes, state
from mpguide.core.device import NEEDS_HARDWARE

SCHEMA = 1
GROUPS = ("switches", "facts", "autocast")
DEVICES = ("cpu", "cuda", "mps", "xpu")
DTYPES = (torch.bfloat16, torch.float16)
SWITCHES = (
    "cuda.matmul.allow_tf32",
    "cuda.matmul.allow_bf16_reduced_precision_reduction",
    "cuda.matmul.allow_fp16_reduced_precision_reduction",
    "cuda.matmul.allow_fp16_accumulation",
    "cuda.matmul.fp32_precision",
    "cudnn.allow_tf32",
    "cudnn.benchmark",
    "cudnn.deterministic",
    "cudnn.fp32_precision",
    "cudnn.conv.fp32_precision",
    "cudnn.rnn.fp32_precision",
    "fp32_precision",
    "mkldnn.fp32_precision",
    "mkldnn.matmul.fp32_precision",
    "mkldnn.conv.fp32_precision",
    "mkldnn.rnn.fp32_precision",
)
"""Switches under ``torch.backends`` whose defaults are recorded (absent ones say so)."""
INDUCTOR = ("emulate_precision_casts", "fallback_random")
ABSENT = "absent"

FACTS: dict[str, Callable[[], str]] = {}
"""The fact probes by name: a name of :data:`mpguide.core.versions.CHANGES` where the fact is
one of its changes. Each returns what the running torch does, in a few words."""


def fact(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    """Register a probe of the fact ``name``: a function without arguments that returns what
    the running torch does, in a few words that do not quote torch's messages."""

    def register(fn: Callable[[], str]) -> Callable[[], str]:
        if name in FACTS:
            raise ValueError(f"fact {name!r} has two probes")
        FACTS[name] = fn
        return fn

    return register


def raised(err: BaseException) -> str:
    """An exception as a fact: ``raises`` and its type, never its wording."""
    return f"raises {type(err).__name__}"


@contextmanager
def _quiet() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def build() -> str:
    """``CPU-only`` or ``CUDA 13.0 libraries, no GPU`` (or the GPU's name)."""
    if torch.version.cuda is None:
        return "CPU-only" if torch.version.hip is None else f"ROCm {torch.version.hip}"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"CUDA {torch.version.cuda} libraries, {gpu}"


def provenance(command: str) -> dict[str, str]:
    """Where and how a recording is made: torch, build, Python, machine, date, command."""

    return {
        "torch": torch.__version__,
        "build": build(),
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}, {device.cpu_name()}",
        "date": datetime.date.today().isoformat(),
        "command": command,
    }


def _read(path: str) -> Any:
    with _quiet() as caught:
        try:
            value = state.get(path)
        except AttributeError:
            return ABSENT
        except RuntimeError as err:
            return raised(err)
    value = value if isinstance(value, bool | int | float | str) else str(value)
    return f"{value} (warns)" if caught else value


def switches() -> dict[str, Any]:
    """The precision switches as this process finds them (call it before changing any)."""
    out: dict[str, Any] = {f"backends.{p}": _read(p) for p in SWITCHES}
    out["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    for dev in DEVICES:
        try:
            out[f"autocast_dtype.{dev}"] = dtypes.name(torch.get_autocast_dtype(dev))
        except RuntimeError as err:
            out[f"autocast_dtype.{dev}"] = raised(err)
    import torch._inductor.config as inductor

    for name in INDUCTOR:
        out[f"inductor.{name}"] = getattr(inductor, name, ABSENT)
    return out


def autocast(devices: tuple[str, ...] = DEVICES, ops: tuple | None = None) -> dict[str, Any]:
    """Each op's class and output dtypes (float32 in, low in, mixed in) and the casts
    autocast inserts, per ``device/dtype``, for ``ops`` (default: the ops
    :func:`mpguide.autocast.policy.probe` probes by default); a device this build cannot
    simulate, or a probe that fails, is recorded as such."""
    chosen = {} if ops is None else {"ops": ops}
    out: dict[str, Any] = {}
    for dev in devices:
        for dtype in DTYPES:
            key = f"{dev}/{dtypes.name(dtype)}"
            if dev not in device.simulated_types():
                out[key] = {"how": "this build cannot simulate it"}
                continue
            try:
                pol = policy.probe(dev, dtype, **chosen)
            except Exception as err:  # noqa: BLE001 - a failed probe is a finding
                out[key] = {"how": f"the probe failed: {error_line(err)}"}
                continue
            probed = {
                p.op: {
                    "class": p.kind,
                    "out": [_out(getattr(p, r), r in p.undecided) for r in policy.RUNS],
                    "casts": list(p.casts),
                }
                for p in pol.probes
            }
            out[key] = {
                "how": "simulated" if pol.how == device.SIMULATED else "live",
                "ops": probed,
            }
    return out


def _out(run: Any, undecided: bool) -> str:
    """One run's output dtype as a cell: ``""`` for no such run, ``error`` where it raised."""
    if run is None:
        return ""
    if undecided:
        return NEEDS_HARDWARE
    return "error" if run.error else dtypes.name(run.out) if run.out else "-"


def facts(names: tuple[str, ...] | None = None) -> dict[str, str]:
    """Run the fact probes named (default: all); a probe that fails records how it failed."""
    out = {}
    for name in names or sorted(FACTS):
        try:
            out[name] = FACTS[name]()
        except Exception as err:  # noqa: BLE001 - a failed probe is a finding
            out[name] = f"probe failed: {raised(err)}"
    return out


def record(command: str, groups: tuple[str, ...] = GROUPS) -> dict:
    """The whole recording of the running torch (switches first, before anything changes
    them)."""
    if "autocast" in groups and not catalogue.has_samples():
        raise MPGuideError(
            "recording the autocast policy needs torch's OpInfo samples, which import only with "
            "expecttest, a dependency of mpguide: pip install expecttest (recordings made without "
            "them would differ)"
        )
    doc: dict[str, Any] = {"schema": SCHEMA, "provenance": provenance(command)}
    for group in groups:
        doc[group] = {"switches": switches, "facts": facts, "autocast": autocast}[group]()
    return doc


def dumps(doc: Any, flat_at: int = 4, _depth: int = 0) -> str:
    """JSON with sorted keys, nested objects indented down to depth ``flat_at`` and everything
    deeper on one line: one op, switch or fact per line, so recordings diff line by line."""
    if not isinstance(doc, dict) or not doc or _depth >= flat_at:
        return json.dumps(doc, sort_keys=True, ensure_ascii=False)
    pad = " " * (_depth + 1)
    items = [
        f"{pad}{json.dumps(k)}: {dumps(v, flat_at, _depth + 1)}" for k, v in sorted(doc.items())
    ]
    return "{\n" + ",\n".join(items) + "\n" + " " * _depth + "}"


def filename(version: str = torch.__version__) -> str:
    """``2.14.1+cu130.json``: one recording per release and build."""
    return f"{version}.json"


def load(path: Path | str) -> dict:
    """Read a recording, checking its schema."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MPGuideError(f"{path}: cannot read a recording ({err})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or "provenance" not in doc:
        raise MPGuideError(f"{path}: not a version recording of schema {SCHEMA}")
    return doc


# The fact probes -------------------------------------------------------------------------------


def _dtype_or_raise(fn: Callable[[], Any]) -> str:
    try:
        with _quiet():
            out = fn()
    except Exception as err:  # noqa: BLE001 - raising is the observation
        return raised(err)
    return dtypes.name(out.dtype)


def _autocast_kernel(op: str, key: str) -> str:
    table = torch._C._dispatch_dump_table(op)
    return "has a kernel" if f"{key}: registered at" in table else "no kernel"


@fact("rms_norm_cuda_autocast")
def _rms_norm_cuda() -> str:
    """Whether the dispatcher holds a CUDA autocast rule for ``aten::rms_norm``."""
    return _autocast_kernel("aten::rms_norm", "AutocastCUDA")


@fact("addmv_cpu_mixed_bias")
def _addmv_mixed() -> str:
    """CPU ``addmv`` with a bf16 bias and float32 matrix and vector, no autocast."""
    bias, mat, vec = torch.ones(4, dtype=torch.bfloat16), torch.ones(4, 3), torch.ones(3)
    return _dtype_or_raise(lambda: torch.addmv(bias, mat, vec))


@fact("quantile_fake_tensor")
def _quantile_fake() -> str:
    """``torch.quantile`` on a fake float32 tensor."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return _dtype_or_raise(lambda: torch.quantile(torch.empty(64), 0.5))


@fact("quantile_internal_float64")
def _quantile_float64() -> str:
    """Whether float32 ``torch.quantile`` computes in float64 inside (casts it makes)."""
    log = dtypes.Log()
    with log:
        torch.quantile(torch.rand(64), 0.5)
    casts = sorted({f"{dtypes.name(a)}->{dtypes.name(b)}" for a, b in log.conversions()})
    return ", ".join(casts) or "no casts"


@fact("quantile_bf16")
def _quantile_bf16() -> str:
    """``torch.quantile`` on a bf16 CPU tensor, no autocast."""
    return _dtype_or_raise(lambda: torch.quantile(torch.rand(64, dtype=torch.bfloat16), 0.5))


@fact("profiler_acc_events")
def _profiler_acc_events() -> str:
    """Whether ``torch.profiler.profile`` takes ``acc_events``, and whether profiling one op
    without it warns."""
    import inspect

    takes = "acc_events" in inspect.signature(torch.profiler.profile).parameters
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with _quiet() as caught, torch.profiler.profile(activities=cpu):
        torch.ones(2) + 1
    warned = sorted({w.category.__name__ for w in caught})
    return f"acc_events {'taken' if takes else 'absent'}; warns: {', '.join(warned) or 'no'}"


@fact("dynamo_user_error_type")
def _dynamo_user_error() -> str:
    """The exception a compiled function (``fullgraph=True``) raising ``ValueError`` gives its
    caller, and where the function's error is: on the first line (what a one-line error
    shows), further down as it was raised, further down wrapped in dynamo's variables, or
    lost."""

    def fn(x):
        raise ValueError("mpguide-marker")

    torch._dynamo.reset()
    try:
        with _quiet():
            torch.compile(fn, backend="eager", fullgraph=True)(torch.ones(2))
    except Exception as err:  # noqa: BLE001 - the exception is the observation
        text = str(err)
        where = (
            "lost"
            if "mpguide-marker" not in text
            else "on its first line"
            if "mpguide-marker" in error_line(err)
            else "further down, as raised"
            if repr(ValueError("mpguide-marker")) in text
            else "further down, inside dynamo's variables"
        )
        return f"{raised(err)}, the function's message {where}"
    finally:
        torch._dynamo.reset()
    return "does not raise"


@fact("inductor_cpu_bf16_round_trip")
def _inductor_round_trip() -> str:
    """Whether inductor's CPU code keeps a float32 -> bf16 -> float32 round trip, by default
    and with ``emulate_precision_casts``."""
    import torch._inductor.config as inductor

    def fn(x):
        return x.to(torch.bfloat16).to(torch.float32) * 2

    x = torch.linspace(1, 2, 64) + 1e-3
    want = fn(x)
    seen = []
    for emulate in (False, True):
        torch._dynamo.reset()
        with state.preserved(), _quiet():
            if hasattr(inductor, "emulate_precision_casts"):
                inductor.emulate_precision_casts = emulate
            got = torch.compile(fn, backend="inductor")(x)
        seen.append(("kept" if torch.equal(got, want) else "removed") + (" (emulated)" * emulate))
    torch._dynamo.reset()
    return ", ".join(seen)


@fact("compile_rejects_mixed_matmul")
def _compile_mixed_matmul() -> str:
    """What inductor does with a batched float16 @ float32 matmul that eager rejects."""

    def fn(a, b):
        return a @ b

    torch._dynamo.reset()
    try:
        with _quiet():
            out = torch.compile(fn, backend="inductor")(
                torch.ones(2, 4, 8, 8, dtype=torch.float16), torch.ones(2, 4, 8, 16)
            )
    except Exception as err:  # noqa: BLE001 - the exception is the observation
        return raised(err)
    finally:
        torch._dynamo.reset()
    return dtypes.name(out.dtype)


@fact("fp8_e4m3fn_cast_saturates")
def _fp8_cast_overflow() -> str:
    """What a cast to float8_e4m3fn makes of a finite value past its largest (448) and of inf."""
    got = torch.tensor([1000.0, float("inf")]).to(torch.float8_e4m3fn).float().tolist()
    return ", ".join(str(v) for v in got)


@fact("bf16_fft_simulated_cuda")
def _bf16_fft_fake_cuda() -> str:
    """What ``fft.rfft`` of a bf16 tensor gives on a simulated CUDA device (no kernel runs),
    autocast off."""

    try:
        with device.simulate("cuda") as cuda:
            out = torch.fft.rfft(torch.empty(8, dtype=torch.bfloat16, device=cuda))
    except Exception as err:  # noqa: BLE001 - the exception is the observation
        return raised(err)
    return dtypes.name(out.dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mpguide.versions.probes",
        description="Record the version-sensitive facts of this torch as JSON.",
    )
    parser.add_argument("--out", type=Path, help="folder to write <torch>.json into (else stdout)")
    parser.add_argument(
        "--only",
        choices=GROUPS,
        action="append",
        help="record only these groups (repeatable)",
    )
    args = parser.parse_args(argv)
    command = shlex.join(["python", "-m", "mpguide.versions.probes", *(argv or sys.argv[1:])])
    try:
        doc = dumps(record(command, tuple(args.only or GROUPS)))
    except MPGuideError as err:
        print(f"probes: error: {err}", file=sys.stderr)
        return 2
    if args.out is None:
        print(doc)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / filename()
    path.write_text(doc + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

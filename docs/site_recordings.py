"""What the site records on a GPU machine: ``nox -s record`` (or ``python docs/site_recordings.py``).

Each key is a table a page shows beside its live result with :func:`mpguide.core.record.beside`;
the recording lands in ``--out`` (the site's ``docs/recorded/``), named after the device.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from mpguide import MPGuideError
from mpguide.core import device, record
from mpguide.core.table import Table
from mpguide.traces import cast_cost


def _policy(dtype: torch.dtype) -> Callable[[torch.device], Table]:
    def measure(dev: torch.device) -> Table:
        from mpguide.autocast import policy

        return policy.probe(dev, dtype).table()

    return measure


#: The matmul sizes of the error table; a GPU adds the full 10240 x 51200 x 10240 product.
MATMUL_SHAPES = ((256, 2048, 256), (128, 8192, 128))
FULL_MATMUL = (10240, 51200, 10240)


def _matmul_errors(dev: torch.device) -> Table:
    from mpguide.precision import numerics

    shapes = MATMUL_SHAPES + ((FULL_MATMUL,) if dev.type == "cuda" else ())
    return numerics.matmul_errors(shapes, dev=dev).table()


def _matmul_into_fp32(x, y, bias):
    out = torch.empty(32, 7, 1, 1, dtype=torch.float32, device=x.device)
    return torch.matmul(x, y, out=out) + bias


def _compile_backends(dev: torch.device) -> Table:
    from mpguide.compiled import backends

    gen = torch.Generator(device=dev).manual_seed(0)
    args = tuple(
        torch.randn(*shape, device=dev, generator=gen).to(torch.bfloat16)
        for shape in ((32, 7, 1, 8), (32, 7, 8, 1), (32, 7, 1, 1))
    )

    def exact(x, y, bias):
        return torch.matmul(x.double(), y.double()) + bias.double()

    return backends.compare(_matmul_into_fp32, args, reference=exact).table()


def _encoder(dev: torch.device) -> tuple[torch.nn.Module, torch.Tensor]:
    """A seeded transformer-encoder classifier and a batch for it: a size a GPU is timed on
    meaningfully, and a small one on a CPU."""
    from torch import nn

    width, layers, length, batch = (1024, 4, 256, 64) if dev.type == "cuda" else (64, 2, 16, 16)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
    model = nn.Sequential(
        nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
        nn.Flatten(),
        nn.Linear(length * width, 10),
    ).to(dev)
    return model, torch.randn(batch, length, width, device=dev)


def _training_step(dev: torch.device, compiled: bool = False) -> Callable[[], None]:
    """One bf16-autocast training step of the encoder (compiled by inductor with ``compiled``)."""
    model, x = _encoder(dev)
    model = torch.compile(model) if compiled else model
    labels = torch.randint(0, 10, (x.shape[0],), device=dev)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), labels)
        loss.backward()

    return step


def _training_step_casts(dev: torch.device) -> Table:
    from mpguide.traces import casts, profiling

    trace = profiling.profile_fn(_training_step(dev), warmup=2)
    return casts.report(trace.tree()).summary("cause")


def capture_trace(dev: torch.device, path: Path) -> Path:
    """Write the chrome trace of one training step, with the Python stack, to ``path``."""
    from mpguide.traces import profiling

    profiling.profile_fn(_training_step(dev), warmup=2, path=path, with_stack=True)
    return path


def _compiled_step_casts(dev: torch.device) -> Table:
    """The training step eager and with the encoder compiled by inductor: the cast ops left per
    step, their time, the casts fused into kernels, and the cast time's share of the step."""
    from mpguide.traces import casts, profiling

    gpu, steps = dev.type == "cuda", 3
    rows = []
    for name in ("eager", "inductor"):
        step = _training_step(dev, compiled=name == "inductor")
        rep = casts.report(profiling.profile_fn(step, warmup=2, active=steps).tree())
        tensor = ~rep.scalar
        cast_us, _, share = rep.share_of_steps(gpu)
        rows.append(
            (
                name,
                int(tensor.sum()) // steps,
                int((~tensor).sum()) // steps,
                cast_us / steps,
                len(rep.fused) // steps,
                rep.fused.total_us / steps,
                f"{100 * share:.2f}%",
            )
        )
    clock = "kernel" if gpu else "CPU"
    columns = ("step", "tensor casts", "0-d casts", f"cast {clock} us", "fused casts")
    columns += (f"fused {clock} us", "cast share of step")
    caption = (
        f"Casts per bf16-autocast training step of the encoder, {device.describe(dev).caption()}"
    )
    return Table(columns, tuple(rows), caption)


def _recipe_times(dev: torch.device) -> Table:
    from mpguide.training import loop

    return loop.train(list(loop.RECIPES), steps=60, eval_every=30, dev=dev).table()


def _inference_variants(dev: torch.device) -> Table:
    from mpguide.models import inference

    model, x = _encoder(dev)
    return inference.compare(model.eval(), x, inference.standard(dev), dev).table()


#: What a recording measures: a key per table, and the function that measures it on a device.
MEASUREMENTS: dict[str, Callable[[torch.device], Table]] = {
    "autocast.policy.bfloat16": _policy(torch.bfloat16),
    "autocast.policy.float16": _policy(torch.float16),
    "numerics.matmul_errors": _matmul_errors,
    "compile.matmul_into_fp32": _compile_backends,
    "profiler.training_step_casts": _training_step_casts,
    "inference.variants": _inference_variants,
    "profiler.norm_upcasts": cast_cost.norm_upcasts,
    "profiler.cast_bandwidth": cast_cost.cast_bandwidth,
    "compile.training_step_casts": _compiled_step_casts,
    "training.recipes": _recipe_times,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Record the site's measurements; bad input ends with one line and status 2."""
    p = argparse.ArgumentParser(prog="site_recordings.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder the recording is written to")
    p.add_argument("--only", nargs="+", metavar="KEY", help="measure only these keys")
    p.add_argument("--device", help="the device to record (default: cuda when present)")
    p.add_argument("--allow-cpu", action="store_true", help="record on a CPU")
    p.add_argument(
        "--trace", type=Path, metavar="PATH", help="also write one training step's chrome trace"
    )
    args = p.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        dev = device.resolve(args.device) if args.device else device.pick()
        if dev.type != "cuda" and not args.allow_cpu:
            raise MPGuideError(
                f"no CUDA GPU here ({dev.type}): recordings are for GPU machines; "
                "pass --allow-cpu to record this CPU"
            )
        command = shlex.join(["python", "docs/site_recordings.py", *argv])
        if args.trace is not None:
            print(f"wrote {capture_trace(dev, args.trace)}", flush=True)
        keys = args.only or list(MEASUREMENTS)
        unknown = [k for k in keys if k not in MEASUREMENTS]
        if unknown:
            raise MPGuideError(f"unknown key {unknown[0]!r}; choose from {', '.join(MEASUREMENTS)}")
        prov = record.provenance(dev, command)
        path = Path(args.out) / f"{record.slug(prov)}.json"
        tables, failed = {}, []
        for i, key in enumerate(keys, 1):
            print(f"[{i}/{len(keys)}] {key}", file=sys.stderr, flush=True)
            try:
                tables[key] = MEASUREMENTS[key](dev)
            except Exception:  # noqa: BLE001 (one failing measurement keeps the others)
                traceback.print_exc()
                failed.append(key)
            else:  # saved after each key: a run cut short keeps what it measured
                record.save(record.Recording(prov, tables), path)
    except MPGuideError as err:
        print(f"site_recordings.py: error: {err}", file=sys.stderr)
        return 2
    if tables:
        print(f"wrote {path}")
    if failed:
        print(f"site_recordings.py: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

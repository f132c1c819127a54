"""``python -m mpguide``: the guide's probes on the reader's machine and traces.

Every subcommand is a function ``_NAME(args)`` registered in :func:`parser`. Bad input ends
with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mpguide import MPGuideError, __version__
from mpguide.table import FORMATS

DESCRIPTION = "The mixed-precision guide's measurements, on this machine and on your own traces."


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise MPGuideError(message)


def _policy(args: argparse.Namespace) -> str:
    from mpguide import device, policy

    if args.device == "all":
        return policy.across(args.dtype, simulate=args.simulate).table().render(args.format)
    target = device.target(args.device, simulate=args.simulate)
    return policy.probe(target, args.dtype).table().render(args.format)


def _formats(args: argparse.Namespace) -> str:
    from mpguide import formats

    return formats.table().render(args.format)


def _tree(args: argparse.Namespace) -> str:
    import dataclasses

    import msgspec

    from mpguide import trace

    if _is_folder(args):
        if args.id is not None or args.depth is not None:
            raise MPGuideError(
                "--id and --depth show one trace's tree: give a file, not a directory"
            )
        from mpguide import ranks

        found = ranks.trees_of_ranks(args.trace, op=args.op, python=args.python, **_across(args))
        return _ranks_out(found, "table" if args.format == "text" else args.format)
    if args.depth is not None and args.depth < 0:
        raise MPGuideError(f"--depth must be 0 or more, got {args.depth}")
    if args.limit < 0:
        raise MPGuideError(f"--limit must be 0 (no limit) or more, got {args.limit}")
    tree = trace.load(args.trace).tree(python=args.python)
    if args.id is not None:
        roots = tree.find(id=args.id)
    elif args.op is not None:
        found = tree.find(args.op)
        if not found:
            raise MPGuideError(f"no op named {args.op!r} in {args.trace}")
        roots = [n for n in found if all(a.name != args.op for a in n.ancestors())]
    else:
        roots = None
    fields = [f.strip() for f in args.fields.split(",") if f.strip()]
    shape = {"depth": args.depth, "gpu": args.gpu}
    total, limit = tree.count(roots, **shape), args.limit or None
    shown = min(total, limit or total)
    if args.format == "json":
        doc = {
            "source": str(args.trace),
            "nodes": tree.nested(roots, fields=fields, limit=limit, **shape),
            "shown": shown,
            "total": total,
            "anomalies": dataclasses.asdict(tree.anomalies),
        }
        return msgspec.json.encode(doc).decode()
    lines = [tree.render(roots, fields=fields, limit=limit, **shape)]
    if shown < total:
        lines.append(
            f"... {total - shown:,} more nodes not shown ({shown:,} of {total:,}): "
            "--limit 0 shows all; --depth, --op or --id narrows"
        )
    return "\n".join([*lines, repr(tree.anomalies)])


def _is_folder(args: argparse.Namespace) -> bool:
    """Whether the command reads a directory of ranks; --jobs and --scheduler only do."""
    from pathlib import Path

    if Path(args.trace).is_dir():
        return True
    if args.jobs is not None or args.scheduler is not None:
        raise MPGuideError(f"--jobs and --scheduler read a directory of ranks; {args.trace} is not")
    return False


def _across(args: argparse.Namespace) -> dict:
    """How to read a directory of ranks: processes here, or a Dask cluster; a progress
    line per rank on stderr when it is a terminal."""

    def progress(done: int, total: int, row) -> None:
        rank = "unknown rank" if row.rank is None else f"rank {row.rank}"
        print(f"mpguide: {done}/{total} {rank} read ({row.file})", file=sys.stderr, flush=True)

    if args.jobs is not None and args.jobs < 1:
        raise MPGuideError(f"--jobs must be 1 or more, got {args.jobs}")
    shown = progress if sys.stderr.isatty() else None
    return {"jobs": args.jobs, "scheduler": args.scheduler, "progress": shown}


def _ranks_out(found, fmt: str) -> str:
    for row in found.rows:
        for loss in row.losses:
            print(f"mpguide: note: {row.file}: {loss}", file=sys.stderr)
    return found.render(fmt)


def _casts(args: argparse.Namespace) -> str:
    from mpguide import casts, trace

    if _is_folder(args):
        from mpguide import ranks

        by = args.by if args.by in casts.SUMMARY_KEYS else "cause"
        return _ranks_out(ranks.casts_of_ranks(args.trace, by=by, **_across(args)), args.format)
    tree = trace.load(args.trace, args_of=casts.needs_args).tree()
    for loss in tree.anomalies.losses():
        print(f"mpguide: note: {loss}", file=sys.stderr)
    report = casts.report(tree)
    if args.by == "cast":
        return report.table().render(args.format)
    return report.summary(args.by).render(args.format)


def _load_factory(spec: str):
    import importlib

    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr:
        raise MPGuideError(f"--model takes MODULE:FUNCTION, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise MPGuideError(f"cannot import {module_name!r}: {err}") from None
    return _function(module, repr(module_name), attr)


def _inference(args: argparse.Namespace) -> str:
    import torch

    from mpguide import device, inference

    dev = device.resolve(args.device) if args.device else device.pick()
    variants = (
        [inference.variant(n) for n in args.variants.split(",")]
        if args.variants
        else list(inference.standard(dev))
    )
    if args.repeat < 1 or args.warmup < 0:
        raise MPGuideError(
            f"need --repeat >= 1 and --warmup >= 0, got {args.repeat} and {args.warmup}"
        )
    made = _load_factory(args.model)()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise MPGuideError(f"{args.model} must return (model, inputs), got {type(made).__name__}")
    model, inputs = made
    result = inference.compare(model, inputs, variants, dev, warmup=args.warmup, repeat=args.repeat)
    return result.table().render(args.format)


def _load_function(spec: str):
    import importlib.util
    from pathlib import Path

    from mpguide import error_line

    path, colon, name = spec.rpartition(":")
    if not colon or not path or not name:
        raise MPGuideError(f"give FILE.py:FUNCTION, got {spec!r}")
    if not Path(path).is_file():
        raise MPGuideError(f"no file {path!r}")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if module_spec is None or module_spec.loader is None:
        raise MPGuideError(f"{path!r} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001 -- the reader's file: named in one line
        raise MPGuideError(f"{path} raised {error_line(err)} on import") from None
    return _function(module, path, name)


def _function(module, where: str, name: str):
    """``module.name`` if it is callable, else one line saying ``where`` has no such function."""
    fn = getattr(module, name, None)
    if not callable(fn):
        raise MPGuideError(f"{where} has no function {name!r}")
    return fn


def _graph(args: argparse.Namespace) -> str:
    import msgspec
    import torch

    from mpguide import device, dtypes, error_line, graphs

    fn = _load_function(args.function)
    target = device.target(args.device, simulate=True)
    if args.backward and not device.simulates_autograd(target.device.type):
        raise MPGuideError(
            f"no backward graph on a simulated {target.device.type}: torch {torch.__version__} "
            "cannot run autograd there (a build with that device can)"
        )
    try:
        low = None if args.autocast is None else dtypes.autocast_dtype(args.autocast)
    except MPGuideError as err:
        raise MPGuideError(f"--{err}") from None
    with device.tensors(target):
        inputs = graphs.inputs(args.inputs, target.device, requires_grad=args.backward)
        try:
            with device.autocast(target, low):
                captured = graphs.capture(fn, *inputs, backend=args.backend)
        except MPGuideError:
            raise
        except Exception as err:  # noqa: BLE001 -- the reader's function: named in one line
            while err.__cause__ is not None or err.__context__ is not None:
                err = err.__cause__ or err.__context__  # Dynamo wraps the first error
            raise MPGuideError(f"tracing {args.function} raised {error_line(err)}") from None
    which = list(captured.graphs())
    if args.format == "json":
        doc = {
            "function": args.function,
            "backend": captured.backend,
            "device": captured.device,
            "obtained": captured.how,
            "note": captured.note,
            "graphs": {
                w: {"code": captured.render(w), "flow": captured.flow(w).records()} for w in which
            },
        }
        return msgspec.json.encode(doc).decode()
    fmt = "markdown" if args.format == "markdown" else "table"
    parts = []
    for w in which:
        code = captured.render(w)
        header = f"{captured.backend}, {w}, {captured.obtained}"
        if fmt == "markdown":
            parts.append(f"**{header}**\n\n```python\n{code}\n```")
        else:
            parts.append(f"# {header}\n{code}")
        parts.append(captured.flow(w).render(fmt))
    return "\n\n".join(parts)


def _rank_options(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--jobs",
        type=int,
        help="for a directory: traces read at once, one process each (default: one per core)",
    )
    s.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="for a directory: read it on the workers of this Dask scheduler (tcp://HOST:PORT), "
        "which see the directory at the same path; needs pip install mpguide[cluster]",
    )


def parser() -> argparse.ArgumentParser:
    """The command line, with one subparser per subcommand."""
    p = _Parser(prog="python -m mpguide", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"mpguide {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    s = sub.add_parser(
        "policy",
        help="probe autocast's per-op dtype policy on any device this build knows",
        description="Probe autocast's per-op dtype policy. A device this machine has is probed "
        "on hardware; any other device type this torch build has autocast kernels for is "
        "simulated with fake tensors under its autocast (dispatch rules, no kernels run). "
        "Every output says which.",
    )
    s.add_argument(
        "--device",
        help="a device type such as cpu, cuda, mps or xpu, or 'all' for one column per device "
        "(default: cuda when present, else cpu)",
    )
    s.add_argument("--dtype", default="bfloat16", help="bfloat16 or float16 (default bfloat16)")
    s.add_argument(
        "--simulate",
        action="store_true",
        help="simulate the device even when this machine has it",
    )
    s.add_argument("--format", default="table", choices=FORMATS, help="output format")
    s.set_defaults(run=_policy)

    s = sub.add_parser(
        "formats",
        help="the floating-point formats of the installed torch",
        description="Bits, range and precision of fp64, fp32, TF32, bf16, fp16 "
        "and the fp8 formats of the installed torch.",
    )
    s.add_argument("--format", default="table", choices=FORMATS, help="output format")
    s.set_defaults(run=_formats)

    s = sub.add_parser(
        "tree",
        help="print the call tree of a chrome trace from torch.profiler",
        description="Print the call tree of a chrome trace (.json or .json.gz) from "
        "torch.profiler, with the anomalies met while nesting it.",
    )
    s.add_argument("trace", help="path to the trace, or a directory of traces, one per rank")
    which = s.add_mutually_exclusive_group()
    which.add_argument("--op", help="show only the subtrees of the ops with this name")
    which.add_argument("--id", type=int, help="show only the subtree of the event with this id")
    s.add_argument(
        "--fields",
        default="Input Dims,Input type",
        help="comma-separated event args to show (default: %(default)s)",
    )
    s.add_argument("--depth", type=int, help="levels shown below each root (default: all)")
    s.add_argument(
        "--limit",
        type=int,
        default=2000,
        help="most nodes shown, depth first, so that a trace of millions of events prints in "
        "seconds; a last line says how many more there are (default %(default)s; 0 for all)",
    )
    s.add_argument("--python", action="store_true", help="include python_function events")
    s.add_argument("--gpu", action="store_true", help="show GPU kernels and memcpys")
    s.add_argument(
        "--format",
        default="text",
        choices=("text", "json"),
        help="a text tree (default) or JSON: nested nodes with their fields, the counts of "
        "nodes shown and in all, and the anomalies",
    )
    _rank_options(s)
    s.set_defaults(run=_tree)

    s = sub.add_parser(
        "casts",
        help="report the dtype casts in a chrome trace and what they cost",
        description="Report every dtype cast in a chrome trace from torch.profiler: the op "
        "that caused it, source and target dtype, bytes, CPU and GPU time.",
    )
    s.add_argument(
        "trace",
        help="path to the trace (.json or .json.gz), or a directory of traces, one per rank",
    )
    s.add_argument("--format", default="table", choices=FORMATS, help="output format")
    s.add_argument(
        "--by",
        default="cast",
        choices=("cast", "cause", "pair", "direction", "pass"),
        help="one row per cast (default), or a summary by cause, dtype pair, direction or pass",
    )
    _rank_options(s)
    s.set_defaults(run=_casts)

    s = sub.add_parser(
        "inference",
        help="compare serving a classifier in fp32, bf16, fp16 and under autocast",
        description="Run the inputs of your classifier through fp32, bf16 and fp16 weights and "
        "autocast, and measure logit error, agreement of predicted classes, parameter and peak "
        "memory, and latency against fp32.",
    )
    s.add_argument(
        "--model",
        required=True,
        metavar="MODULE:FUNCTION",
        help="a function, importable from here, returning (model, inputs)",
    )
    s.add_argument(
        "--variants",
        metavar="NAMES",
        help="comma-separated, from fp32, bf16, fp16, autocast-bf16, autocast-fp16, "
        "each optionally with +compile (default: all but autocast-fp16 on the CPU)",
    )
    s.add_argument("--device", help="cpu or cuda (default: cuda when present, else cpu)")
    s.add_argument("--warmup", type=int, default=3, help="calls before timing (default 3)")
    s.add_argument("--repeat", type=int, default=15, help="timed calls (default 15)")
    s.add_argument("--format", default="table", choices=FORMATS, help="output format")
    s.set_defaults(run=_inference)

    s = sub.add_parser(
        "graph",
        help="print the graphs torch.compile would hand a backend, on any device, running nothing",
        description="Trace your function with Dynamo and AOTAutograd for a backend and print "
        "the forward (and backward) graph with each node's dtype and shape, then where the "
        "dtype changes. The device is simulated with fake tensors from this build's dispatch "
        "rules, so no kernel runs and any device this build has autocast for can be shown; "
        "every output says so.",
    )
    s.add_argument("function", metavar="FILE.py:FUNCTION", help="the function to trace")
    s.add_argument(
        "--inputs",
        nargs="+",
        required=True,
        metavar="SPEC",
        help="one per argument, as DTYPE[SHAPE]: bf16[32,7,1,8], f32[4096,4096], i64[16]",
    )
    s.add_argument("--device", default="cpu", help="cpu, cuda or another autocast device type")
    s.add_argument(
        "--backend",
        default="aot_eager",
        choices=("aot_eager", "inductor"),
        help="aot_eager: the ATen graphs; inductor: after inductor's decompositions",
    )
    s.add_argument(
        "--backward",
        action="store_true",
        help="make the floating inputs require grad and show the backward graph too",
    )
    s.add_argument("--autocast", metavar="DTYPE", help="trace under the device's autocast")
    s.add_argument(
        "--format",
        default="text",
        choices=("text", "markdown", "json"),
        help="text (default), markdown, or json with each graph's code and dtype changes",
    )
    s.set_defaults(run=_graph)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    try:
        args = parser().parse_args(argv)
        out = args.run(args)
    except (MPGuideError, OSError) as err:
        print(f"mpguide: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mpguide: interrupted", file=sys.stderr)
        return 130
    sys.stdout.write(out if out.endswith("\n") else out + "\n")
    return 0

"""``python -m mpguide``: the guide's probes on the reader's machine and traces.

Every subcommand is a function ``_NAME(args)`` registered in :func:`parser`. Bad input ends
with one line on stderr and exit status 2, never a traceback; so do running out of memory
and an output that cannot be written. Ctrl-C ends with one line and status 130, SIGTERM and
SIGHUP with one line and 128 + the signal, after the command's own clean-up has run; a
reader of the output that stops reading (``| head``) ends it quietly with 141, as a pipe
would.

Each command imports the modules it calls inside its function, not here: this module imports
without torch (2-3 s of start-up), so ``--help`` and the trace commands never load it.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from collections.abc import Iterator, Sequence

from mpguide import MPGuideError, __version__, cli_diff
from mpguide.core import output, terminal
from mpguide.core.readers_code import NOT_THE_READERS, SPEC
from mpguide.core.readers_code import factory as _factory
from mpguide.core.readers_code import load_spec as _load_spec
from mpguide.core.readers_code import reader_error as _reader_error
from mpguide.core.readers_code import readers_code as _readers_code
from mpguide.core.table import ALIASES, FORMATS

DESCRIPTION = "The mixed-precision guide's measurements, on this machine and on your own traces."


_NUMBER = re.compile(r"-\d+(\.\d*)?")


class _Parser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _unknown(self) -> list[str]:
        """The options in the command line that this parser does not know."""
        words = getattr(self, "_argv", [])
        words = words[: words.index("--")] if "--" in words else words
        known = self._option_string_actions
        return [
            w
            for w in words
            if w.startswith("-")
            and w != "-"
            and not _NUMBER.fullmatch(w)
            and not any(k.startswith(w.split("=")[0]) for k in known)
        ]

    def error(self, message: str):
        unknown = self._unknown()
        if unknown and not message.startswith("unrecognized arguments"):
            message = f"unrecognized arguments: {' '.join(unknown)} ({message})"
        raise MPGuideError(message)


def _format_name(value: str) -> str:
    return ALIASES.get(value, value)


def _add_format(s: argparse.ArgumentParser, choices=FORMATS, says: str = "") -> None:
    """``--format``, text by default; ``table`` is another name for text."""
    s.add_argument(
        "--format",
        default="text",
        type=_format_name,
        choices=choices,
        help=f"{', '.join(choices)} (default text, which fits the terminal: COLUMNS, else its "
        f"width, else {terminal.DEFAULT}; table is another name for text){says}",
    )


def _shown(table, fmt: str) -> str:
    """``table`` in ``fmt``; as text, fitting the terminal."""
    return table.render(fmt, terminal.width())


def _policy(args: argparse.Namespace) -> str:
    from mpguide.autocast import policy
    from mpguide.core import device

    if args.device == "all":
        return _shown(policy.across(args.dtype, simulate=args.simulate).table(), args.format)
    target = device.target(args.device, simulate=args.simulate)
    return _shown(policy.probe(target, args.dtype).table(), args.format)


def _formats(args: argparse.Namespace) -> str:
    from mpguide.precision import formats

    return _shown(formats.table(), args.format)


_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)


def _byte_size(text: str) -> int:
    """``--max-bytes``: bytes, or K, M, G, T (binary units): ``4G``, ``512MiB``, ``1.5G``."""
    found = _SIZE.fullmatch(text.strip())
    if found is None:
        raise argparse.ArgumentTypeError(f"give a size such as 4G, 512M or 1000000, not {text!r}")
    return int(float(found[1]) * 1024 ** " KMGT".index(found[2].upper() or " "))


def _add_max_bytes(s: argparse.ArgumentParser) -> None:
    from mpguide.traces.trace import MAX_BYTES, size_text

    s.add_argument(
        "--max-bytes",
        type=_byte_size,
        metavar="SIZE",
        help="refuse a trace larger than SIZE once decompressed, such as 8G "
        f"(default {size_text(MAX_BYTES).replace(' ', '')}; 0 for no cap)",
    )


_TRACE_HELP = "the trace (.json or .json.gz), a directory of traces (one per rank), or - for stdin"


def _cap(args: argparse.Namespace) -> int | None:
    """The largest trace ``--max-bytes`` lets the command read, decompressed; None for any."""
    from mpguide.traces import trace

    return trace.MAX_BYTES if args.max_bytes is None else args.max_bytes or None


def _load(args: argparse.Namespace, args_of=None):
    """The trace that ``args`` names (``-`` for stdin), under the cap ``--max-bytes``."""
    from mpguide.traces import trace

    cap = _cap(args)
    if args.trace != "-":
        return trace.load(args.trace, args_of=args_of, max_bytes=cap)
    if sys.stdin is None or sys.stdin.closed:
        raise MPGuideError("no trace on stdin, which is closed: pipe one in or name a file")
    if sys.stdin.isatty():
        raise MPGuideError("no trace on stdin, which is a terminal: pipe one in or name a file")
    return trace.load(sys.stdin.buffer, args_of=args_of, max_bytes=cap)


def _tree(args: argparse.Namespace) -> str | Iterator[str]:
    import dataclasses

    import msgspec
    import numpy as np

    if _is_folder(args):
        if args.id is not None or args.depth is not None:
            raise MPGuideError(
                "--id and --depth show one trace's tree: give a file, not a directory"
            )
        from mpguide.traces import ranks

        found = ranks.trees_of_ranks(args.trace, op=args.op, python=args.python, **_across(args))
        return _ranks_out(found, args.format)
    if args.depth is not None and args.depth < 0:
        raise MPGuideError(f"--depth must be 0 or more, got {args.depth}")
    if args.limit < 0:
        raise MPGuideError(f"--limit must be 0 (no limit) or more, got {args.limit}")
    tree = _load(args).tree(python=args.python)
    if args.id is not None:
        roots = tree.find(id=args.id)
    elif args.op is not None:
        found = tree.find(args.op)
        if not found:
            raise MPGuideError(f"no op named {args.op!r} in {args.trace}")
        ids = np.array([n.id for n in found], dtype=np.int64)
        (outer,) = tree.nearest(ids, tree.named(args.op.__eq__))
        roots = [n for n, above in zip(found, outer.tolist(), strict=True) if above < 0]
    else:
        roots = None
    fields = [f.strip() for f in args.fields.split(",") if f.strip()]
    shape = {"depth": args.depth, "gpu": args.gpu}
    total, limit = tree.count(roots, **shape), args.limit or None
    if args.format == "json":
        shown = min(total, limit or total)
        doc = {
            "source": str(args.trace),
            "nodes": tree.nested(roots, fields=fields, limit=limit, **shape),
            "shown": shown,
            "total": total,
            "anomalies": dataclasses.asdict(tree.anomalies),
            "hidden": tree.hidden,
        }
        try:
            return msgspec.json.encode(doc).decode()
        except RecursionError:
            raise MPGuideError(
                "the tree nests too deeply for JSON; show fewer levels with --depth"
            ) from None
    return _drawn(tree, roots, fields, limit, shape, total)


def _drawn(tree, roots, fields: list[str], limit: int | None, shape: dict, total: int):
    """The text tree's lines, drawn as they are written, then what was not shown."""
    import shutil

    from mpguide.traces import calltree

    width = max(shutil.get_terminal_size((100, 24)).columns, 20)
    drawn = calltree.Drawn()
    for line in tree.lines(roots, fields=fields, limit=limit, drawn=drawn, **shape):
        yield line if len(line) <= width else line[: width - 1] + "…"
    if drawn.nodes < total:
        chained = f", {drawn.chained:,} of them in chains" if drawn.chained else ""
        more = "--limit 0 shows all; " if limit is not None and drawn.nodes >= limit else ""
        yield (
            f"... {total - drawn.nodes:,} more nodes not shown ({drawn.nodes:,} of {total:,}"
            f"{chained}): {more}--depth, --op or --id narrows"
        )
    for cat, n in tree.hidden.items():
        shows = "--python" if cat == calltree.PYTHON else "the Python API"
        yield f"hidden: {n:,} {cat} events ({shows} shows them)"
    yield repr(tree.anomalies)


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
    return {
        "jobs": args.jobs,
        "scheduler": args.scheduler,
        "progress": shown,
        "max_bytes": _cap(args),
    }


def _ranks_out(found, fmt: str) -> str:
    from mpguide.traces import rank_text

    output.notes(f"{row.file}: {loss}" for row in found.rows for loss in row.losses)
    if fmt == "csv":  # CSV has no place for them
        output.notes(found.skipped)
    return rank_text.render(found, fmt, terminal.width())  # text in units a person reads


def _casts(args: argparse.Namespace) -> str:
    from mpguide.traces import cast_text, casts

    if args.limit < 0:
        raise MPGuideError(f"--limit must be 0 (no limit) or more, got {args.limit}")
    if _is_folder(args):
        from mpguide.traces import ranks

        if args.by not in casts.SUMMARY_KEYS:
            raise MPGuideError(
                f"--by {args.by} shows one trace's casts: give a file, or a summary for a "
                f"directory ({', '.join(casts.SUMMARY_KEYS)})"
            )
        found = ranks.casts_of_ranks(args.trace, by=args.by, **_across(args))
        return _ranks_out(found, args.format)
    tree = _load(args, casts.needs_args).tree(python=True)
    output.notes(tree.anomalies.losses())
    report = casts.report(tree)
    table = report.table(args.by, scalars=args.scalars, limit=args.limit or None)
    if args.format in ("text", "markdown"):
        table = casts.readable(table)
        if not table.rows:  # one line, and the notes
            what = "fused cast kernels" if args.by == "fused" else "casts"
            what = "cast ops" if what == "casts" and len(report.fused) else what
            width = terminal.width() if args.format == "text" else None
            return cast_text.empty(table, what, width)
    if args.format == "text":  # the causes whole, on lines of their own where they must
        return cast_text.fitted(table, terminal.width())
    if args.format == "csv":  # CSV has no place for them
        output.notes(table.notes)
    return _shown(table, args.format)


VARIANTS = "fp32, bf16, fp16, autocast-bf16, autocast-fp16"


def _inference(args: argparse.Namespace) -> str:
    import torch

    from mpguide.core import device
    from mpguide.models import inference, per_module, progress

    dev = device.resolve(args.device) if args.device else device.pick()
    if args.variants is None:  # fp16 matmuls are slow on a CPU: named, not by default
        variants = [
            v for v in inference.standard(dev) if dev.type != "cpu" or v.weights != torch.float16
        ]
    else:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
        if not names:
            raise MPGuideError(f"--variants names none: give some of {VARIANTS}, or leave it out")
        variants = [inference.variant(n) for n in names]
    if args.repeat < 1 or args.warmup < 0:
        raise MPGuideError(
            f"need --repeat >= 1 and --warmup >= 0, got {args.repeat} and {args.warmup}"
        )
    model, inputs = _factory(args.model)
    try:
        per_module.arguments(inputs)
    except MPGuideError as err:
        raise MPGuideError(f"{args.model}: {err}") from None
    shown = progress.to_terminal()
    try:
        with _readers_code(f"running the model of {args.model} on its inputs"):
            result = inference.compare(
                model, inputs, variants, dev, warmup=args.warmup, repeat=args.repeat, progress=shown
            )
    finally:
        if shown is not None:
            shown.done()
    return _shown(result.table(), args.format)


def _model(args: argparse.Namespace) -> str:
    from mpguide.core import device
    from mpguide.models import per_module, progress

    if args.limit < 0:
        raise MPGuideError(f"--limit must be 0 (no limit) or more, got {args.limit}")
    if args.target is not None:
        from mpguide.models import lowbit_report

        return lowbit_report.main(args, _factory, _readers_code)
    target = device.target(args.device, simulate=args.simulate)
    model, inputs = _factory(args.spec)
    shown = progress.to_terminal()
    try:
        with _readers_code(f"running the model of {args.spec} on its inputs"):
            report = per_module.report(
                model,
                inputs,
                autocast=_option("autocast", args.autocast),
                dtype=_option("dtype", args.dtype),
                device=target,
                backward=args.backward,
                progress=shown,
            )
    finally:
        if shown is not None:
            shown.done()
    columns = args.columns
    if columns is None and args.format in ("json", "csv"):
        columns = "all"  # for programs: every column, under keys that stay
    elif columns not in (None, "all"):
        columns = [c.strip() for c in columns.split(",") if c.strip()]
    table = report.table(limit=args.limit or None, columns=columns, nested=args.format == "text")
    if args.format == "json":
        return per_module.json_document(report, table)
    if args.format == "csv":
        output.notes((table.caption, *table.notes))
    return _shown(table, args.format)


def _option(flag: str, value: str | None):
    """A dtype option, its error naming the flag."""
    from mpguide.core import dtypes

    if value is None:
        return None
    try:
        return dtypes.autocast_dtype(value) if flag == "autocast" else dtypes.parse(value)
    except MPGuideError as err:
        raise MPGuideError(f"--{flag}: {err}") from None


def _first_error(err: BaseException, fn, inputs, target, low) -> BaseException:
    """The error behind a failed capture: the first one Dynamo wrapped, and where Dynamo saw
    the reader's function raise (torch 2.11 keeps only the exception's type), that function's
    own error, from running it once more without compiling (on the same inputs)."""
    from torch._dynamo.exc import ObservedException

    from mpguide.core import device

    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__  # Dynamo wraps the first error
    if isinstance(err, ObservedException):
        try:
            with device.autocast(target, low):
                fn(*inputs)
        except BaseException as own:  # the reader's function
            if isinstance(own, NOT_THE_READERS):
                raise
            return own
    return err


def _graph(args: argparse.Namespace) -> str:
    import msgspec

    from mpguide.compiled import graphs
    from mpguide.core import device, dtypes

    fn = _load_spec(args.function)
    target = device.target(args.device, simulate=True)
    if args.backward and not device.simulates_autograd(target.device.type):
        raise MPGuideError(f"no backward graph: {device.no_autograd_reason(target.device.type)}")
    try:
        low = None if args.autocast is None else dtypes.autocast_dtype(args.autocast)
    except MPGuideError:
        raise MPGuideError(
            f"--autocast takes bfloat16 or float16 (bf16, fp16), got {args.autocast!r}"
        ) from None
    with device.tensors(target, graphs.modules_of(fn)):
        inputs = graphs.inputs(args.inputs, target.device, requires_grad=args.backward)
        try:
            with device.autocast(target, low):
                captured = graphs.capture(fn, *inputs, backend=args.backend)
        except BaseException as err:  # the reader's function
            if isinstance(err, NOT_THE_READERS):
                raise
            err = _first_error(err, fn, inputs, target, low)
            raise MPGuideError(f"tracing {args.function} raised {_reader_error(err)}") from None
    which = list(captured.graphs()) if args.backward else ["forward"]
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
    fmt = args.format
    parts = []
    for w in which:
        code = captured.render(w)
        header = f"{captured.backend}, {w}, {captured.obtained}"
        if fmt == "markdown":
            parts.append(f"**{header}**\n\n```python\n{code}\n```")
        else:
            width = terminal.width()
            code = "\n".join(
                part for line in code.splitlines() for part in terminal.code_line(line, width)
            )
            parts.append("\n".join(terminal.wrap(f"# {header}", width, "#   ")) + f"\n{code}")
        flow = captured.flow(w)
        if flow.rows:
            parts.append(_shown(flow, fmt))
        else:
            said = f"no node of the {w} graph changes the dtype ({captured.label})"
            parts.append("\n".join(terminal.wrap(said, terminal.width())))
    return "\n\n".join(parts)


def _rank_options(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--jobs",
        type=int,
        help="for a directory: traces read at once, one process each (default and most: one "
        "per core, fewer where the free memory would not hold that many of its largest trace)",
    )
    s.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="for a directory: read it on the workers of this Dask scheduler (tcp://HOST:PORT), "
        "which see the directory at the same path; needs pip install mpguide[cluster]",
    )


def _casts_legend() -> str:
    from mpguide.traces.casts import LEGEND

    return LEGEND


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
    _add_format(s)
    s.set_defaults(run=_policy)

    s = sub.add_parser(
        "formats",
        help="the floating-point formats of the installed torch",
        description="Bits, range and precision of fp64, fp32, TF32, bf16, fp16 "
        "and the fp8 formats of the installed torch.",
    )
    _add_format(s)
    s.set_defaults(run=_formats)

    s = sub.add_parser(
        "tree",
        help="print the call tree of a chrome trace from torch.profiler",
        description="Print the call tree of a chrome trace (.json or .json.gz) from "
        "torch.profiler: each node with its duration and fields, lines cut to the terminal's "
        "width, long chains of single children collapsed; then how many events of the layers "
        "left out are hidden and the anomalies met while nesting it.",
    )
    s.add_argument("trace", help=_TRACE_HELP)
    _add_max_bytes(s)
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
        default=50,
        help="most nodes shown, depth first; a line then says how many more there are "
        "(default %(default)s; 0 for all)",
    )
    s.add_argument("--python", action="store_true", help="include python_function events")
    s.add_argument("--gpu", action="store_true", help="show GPU kernels and memcpys")
    _add_format(
        s,
        ("text", "json"),
        "; JSON: nested nodes with their fields, the counts of nodes shown and in all, and "
        "the anomalies",
    )
    _rank_options(s)
    s.set_defaults(run=_tree)

    s = sub.add_parser(
        "casts",
        help="report the dtype casts in a chrome trace and what they cost",
        description="Report the dtype casts in a chrome trace from torch.profiler: what "
        "caused them (the module and source line when the trace has the Python stack, else "
        "the op), source and target dtype, bytes, CPU and GPU time; and apart, the casts fused "
        "into compiled or vendor kernels.",
        epilog=_casts_legend(),
    )
    s.add_argument("trace", help=_TRACE_HELP)
    _add_max_bytes(s)
    _add_format(s)
    s.add_argument(
        "--by",
        default="cause",
        choices=("cause", "module", "pair", "direction", "pass", "cast", "fused"),
        help="a summary by cause (default), module, dtype pair, direction or pass; one row "
        "per cast (cast); or the casts fused into kernels (fused)",
    )
    s.add_argument(
        "--limit",
        type=int,
        default=25,
        help="most rows shown, largest first (one row per cast: in time order); a note says "
        "how many more there are (default %(default)s; 0 for all)",
    )
    s.add_argument(
        "--scalars",
        action="store_true",
        help="show the casts of 0-d tensors (an optimizer's step counts and scales, a few "
        "bytes each) as rows of their own instead of folded into one",
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
        metavar="SPEC",
        help=f"{SPEC}: a function returning (model, inputs), the inputs a tensor, a tuple of "
        "arguments or a dict of keyword arguments (a transformers model's); the model returns "
        "logits, or an output with logits; importing it runs its top-level code",
    )
    s.add_argument(
        "--variants",
        metavar="NAMES",
        help=f"comma-separated, from {VARIANTS}, each optionally with +compile (default: fp32, "
        "bf16, autocast-bf16, and on CUDA fp16 and autocast-fp16 too; fp16 matmuls are slow on "
        "most CPUs, so name fp16 to run it)",
    )
    s.add_argument("--device", help="cpu or cuda (default: cuda when present, else cpu)")
    s.add_argument("--warmup", type=int, default=3, help="calls before timing (default 3)")
    s.add_argument("--repeat", type=int, default=15, help="timed calls (default 15)")
    _add_format(s)
    s.set_defaults(run=_inference)

    s = sub.add_parser(
        "graph",
        help="print the graphs torch.compile would hand a backend, on any device, no kernel run",
        description="Trace your function with Dynamo and AOTAutograd for a backend and print "
        "the forward (and backward) graph with each node's dtype and shape, then where the "
        "dtype changes. The device is simulated with fake tensors from this build's dispatch "
        "rules, so no kernel runs and any device this build has autocast for can be shown; "
        "every output says so. FILE.py is imported, so its top-level code runs.",
    )
    s.add_argument(
        "function",
        metavar="SPEC",
        help=f"{SPEC}: the function to trace; importing it runs its top-level code, and the "
        "parameters and buffers of the modules it reaches follow the simulated device",
    )
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
    _add_format(s, ("text", "markdown", "json"), "; json: each graph's code and dtype changes")
    s.set_defaults(run=_graph)

    s = sub.add_parser(
        "model",
        help="your model module by module: dtypes, casts, and error against float64",
        description="Run your model on its inputs under autocast (or cast to one dtype) and "
        "report every module call in call order: input, output and parameter dtypes, the ops "
        "and dtype casts it ran (forward, and backward with --backward), and, on a device this "
        "machine has, its error against a float64 copy of the model on the same inputs, with "
        "the infinities and NaNs it returned, the values it flushed to zero and the reference "
        "values beyond the format's range. The first module with a non-finite output and the "
        "one whose error grows most from input to output are named. Another device is "
        "simulated: dtypes and casts only.",
    )
    s.add_argument(
        "spec",
        metavar="SPEC",
        help=f"{SPEC}: a function returning (model, inputs), the inputs a tensor, a tuple of "
        "arguments or a dict of keyword arguments; importing it runs its top-level code",
    )
    low = s.add_mutually_exclusive_group()
    low.add_argument(
        "--autocast", metavar="DTYPE", help="bfloat16 (the default) or float16: run under autocast"
    )
    low.add_argument(
        "--dtype", metavar="DTYPE", help="cast the model and its floating inputs to this dtype"
    )
    s.add_argument(
        "--device",
        help="cpu, cuda, mps, xpu, ...: live where this machine has it, else simulated "
        "(default: cuda when present, else cpu)",
    )
    s.add_argument("--simulate", action="store_true", help="simulate the device even when present")
    s.add_argument(
        "--target",
        metavar="FORMAT",
        help="report every linear layer (torch.nn.Linear, transformers' Conv1D) quantized to "
        "a low-bit recipe or format instead (tensorwise, rowwise, blockwise_1x128, mxfp8, "
        "mxfp4, nvfp4, float8_e4m3fn, ...): values flushed to zero or past the max, error "
        "against float64, layers to keep; other layers with 2-D or larger weights "
        "(convolutions, embeddings) are named as left out",
    )
    s.add_argument(
        "--backward",
        action="store_true",
        help="run the backward pass too (ones as output gradients) and count its ops and casts",
    )
    s.add_argument(
        "--limit",
        type=int,
        default=200,
        help="most module calls shown, in call order; a last line says how many more there "
        "are (default %(default)s; 0 for all)",
    )
    s.add_argument(
        "--columns",
        metavar="NAMES",
        help="comma-separated columns, or all (default for text and markdown: module, in, "
        "out, casts, bwd casts, out err, inf, nan, to zero, type; json and csv: all). The "
        "others: params, ops, autocast casts, bwd ops, bwd autocast casts, in err, and "
        "|ref| > max (reference values beyond the low-precision format's largest)",
    )
    _add_format(s, says="; csv: the notes go to stderr")
    s.set_defaults(run=_model)

    cli_diff.add(sub, _add_format)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    output.STARTED[0] = os.getpid()
    try:
        with output.signals_end_the_command():
            args = parser().parse_args(argv)
            return output.write(args.run(args))
    except (MPGuideError, OSError) as err:
        return output.said(f"error: {err}", 2)
    except MemoryError:
        return output.said(
            "error: out of memory: this input needs more than the process may take", 2
        )
    except KeyboardInterrupt:
        return output.said("interrupted", 128 + signal.SIGINT)
    except output.Ended as end:
        return output.said(f"terminated by {signal.Signals(end.signum).name}", 128 + end.signum)

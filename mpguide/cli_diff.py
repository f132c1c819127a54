"""``python -m mpguide diff SPEC``: where a model's error comes from, op by op.

Its arguments and its run, kept beside :mod:`mpguide.cli` (which registers it with
:func:`add`) so that module stays small; :mod:`mpguide.models.diff` and
:mod:`mpguide.models.fixes` do the work.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from mpguide import MPGuideError
from mpguide.core import output, terminal
from mpguide.core.readers_code import SPEC
from mpguide.core.readers_code import factory as _factory
from mpguide.core.readers_code import readers_code as _readers_code

VIEWS = ("sources", "ops", "modules", "grads")
"""The rankings of :data:`mpguide.models.diff.VIEWS`, named here so that building the parser
(``--help``, and every other command) does not import torch."""

HELP = "where your model's error comes from, op by op, and what keeping one op in float32 buys"

DESCRIPTION = (
    "Run your model in a low precision (under autocast, cast whole with --pure, or with its "
    "linear layers quantized to a low-bit --target) and, beside "
    "it, a float64 shadow fed the same values at every op. For every op: its local error (what "
    "it adds itself: the run's output against the op run in float64 on the run's own "
    "inputs), its inherited error (that float64 result against the shadow's) and its total; "
    "errors are ||error|| / ||ref|| (Euclidean norms), so |local - inherited| <= total <= "
    "local + inherited, checked for every op. Ops are named by module and by the line of your "
    "code that ran them; a source is one module call's line, and sources rank by the sum of "
    "their ops' local errors. --backward compares every parameter's gradient too; --fix K "
    "re-runs the K worst sources kept in float32 and says what each buys and costs."
)

COLUMNS = (
    "Columns: local, inherited, total as above (for a module call, of its output, with the "
    "call re-run in float64 on the run's inputs; empty where it could not be re-run); worst "
    "op: the largest local error of a source's ops; created (modules): the sum of the local "
    "errors of the forward ops it ran; in err: its first floating input against the shadow; "
    "grad err: "
    "a parameter's gradient against the shadow's. Fix list: error (the final output's, with "
    "that row and every earlier one kept), logprob nats (for logits), drop (the share of the "
    "first error it removes), alone (with only that row kept), casts + and bytes + (the "
    "conversions it adds to the run), time x (against the same run with nothing kept)."
)


def add(sub, add_format: Callable[..., None]) -> None:
    """The ``diff`` subcommand, on ``sub`` (the CLI's subparsers); ``add_format`` adds the
    CLI's ``--format``."""
    s = sub.add_parser("diff", help=HELP, description=DESCRIPTION, epilog=COLUMNS)
    s.add_argument(
        "spec",
        metavar="SPEC",
        help=f"{SPEC}: a function returning (model, inputs), the inputs a tensor, a tuple of "
        "arguments or a dict of keyword arguments; importing it runs its top-level code",
    )
    s.add_argument(
        "--dtype",
        metavar="DTYPE",
        help="bfloat16 (the default) or float16: run under autocast in it",
    )
    s.add_argument(
        "--pure",
        action="store_true",
        help="cast the model and its floating inputs to --dtype instead of autocast",
    )
    s.add_argument(
        "--target",
        metavar="FORMAT",
        help="run the model in its own dtype with every linear layer (torch.nn.Linear, "
        "transformers' Conv1D) computing on its input and weight quantized to a low-bit recipe "
        "or format, as model --target does (nvfp4, mxfp4, mxfp8, tensorwise, float8_e4m3fn, "
        "...): each quantization is an op of its own, 'quantize FORMAT (input)' or '(weight)'; "
        "with --fix, a kept layer runs unquantized; no --backward",
    )
    s.add_argument(
        "--device", help="cpu, cuda, ...: a device this machine has (default: cuda, else cpu)"
    )
    s.add_argument(
        "--backward",
        action="store_true",
        help="run the backward pass too (seeded standard-normal output gradients): the local "
        "error of its ops and every parameter's gradient error",
    )
    s.add_argument(
        "--by",
        choices=VIEWS,
        default="sources",
        help="what the table ranks: sources (module and line; the default), ops, modules "
        "(module calls) or grads (parameters, with --backward)",
    )
    s.add_argument(
        "--fix",
        type=int,
        default=0,
        metavar="K",
        help="re-run the K worst sources kept in float32 (with --pure, and the K parameters, "
        "buffers and inputs whose rounding errs most), alone and one after another: the "
        "final error each removes and what it costs (casts, bytes, time)",
    )
    s.add_argument(
        "--reference",
        default="float64",
        choices=("float64", "float32"),
        help="the shadow's dtype: float64 (the default), or float32 for a model with an op "
        "that has no float64 kernel",
    )
    s.add_argument(
        "--logprobs",
        action="store_true",
        help="the output's last dimension is a vocabulary: report the log-probability error in "
        "nats (the default where the output names logits)",
    )
    s.add_argument(
        "--limit",
        type=int,
        default=20,
        help="most rows shown, the worst first; a last line says how many more there are "
        "(default %(default)s; 0 for all)",
    )
    add_format(s, says="; json: one document, with the fix list under fix_list")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> str:
    """The command: the ranking (and the fix list) in the chosen format."""
    from mpguide.core import dtypes
    from mpguide.models import diff, fixes, progress
    from mpguide.precision import lowbit_errors

    if args.limit < 0:
        raise MPGuideError(f"--limit must be 0 (no limit) or more, got {args.limit}")
    if args.fix < 0:
        raise MPGuideError(f"--fix must be 0 or more sources, got {args.fix}")
    if args.by == "grads" and not args.backward:
        raise MPGuideError("--by grads needs --backward")
    if args.target is not None:
        if args.pure or args.dtype is not None:
            raise MPGuideError("--target runs the model in its own dtype: no --dtype or --pure")
        if args.backward:
            raise MPGuideError(f"--backward: {diff.NO_TARGET_BACKWARD}")
        lowbit_errors.check_target(args.target)
        precision = {"target": args.target}
    else:
        try:
            low = dtypes.autocast_dtype(args.dtype or "bfloat16")
        except MPGuideError as err:
            raise MPGuideError(f"--dtype: {err}") from None
        precision = {"dtype": low} if args.pure else {"autocast": low}
    model, inputs = _factory(args.spec)
    shown = progress.to_terminal()
    try:
        with _readers_code(f"running the model of {args.spec} on its inputs"):
            found = diff.diff(
                model,
                inputs,
                **precision,
                device=args.device,
                backward=args.backward,
                reference=args.reference,
                logprobs=args.logprobs or None,
                progress=shown,
            )
            fixed = (
                fixes.fix_list(
                    model, inputs, found, args.fix, device=args.device, progress=shown, **precision
                )
                if args.fix
                else None
            )
    finally:
        if shown is not None:
            shown.done()
    table = found.table(args.by, limit=args.limit or None)
    if args.format == "json":
        doc = json.loads(table.to_json())
        if fixed is not None:
            doc["fix_list"] = json.loads(fixed.table().to_json())
        return json.dumps(doc, indent=2)
    tables = [table] if fixed is None else [table, fixed.table()]
    if args.format == "csv":
        for t in tables:
            output.notes((t.caption, *t.notes))
    return "\n\n".join(t.render(args.format, terminal.width()) for t in tables)

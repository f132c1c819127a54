"""What inductor writes for a function: the code of its compiled module, and the precision
facts read from it (which kernels it calls, the accumulator type of its loops, the precision
its Triton dots ask for), so a page can show them per precision setting, on a CPU too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mpguide.core import state
from mpguide.core.table import Table

_EXTERN = re.compile(r"\b(extern_kernels\.\w+|torch\.ops\.\w+\.\w+)\(")
_CPP_KERNEL = re.compile(r"^(cpp_fused_\w+) = async_compile\.cpp", re.MULTILINE)
_TRITON_KERNEL = re.compile(r"^(triton_\w+) = async_compile\.triton", re.MULTILINE)
_CPP_ACC = re.compile(r"\b(float|double|at::BFloat16|at::Half)\s+tmp_acc\d+\s*=")
_TRITON_ACC = re.compile(r"_acc\w*\s*=\s*tl\.full\([^)]*?(tl\.\w+)\)")
_DOT_PRECISION = re.compile(r"input_precision=\"(\w+)\"|allow_tf32=(\w+)")
_TEMPLATE_FLAGS = re.compile(r"\b(ALLOW_TF32|ACC_TYPE)\s*[:=]\s*'?([\w.]+)'?")


def generated(fn: Callable[..., Any], args: Sequence[Any], **compile_kwargs: Any) -> str:
    """The source of the module inductor compiles ``fn(*args)`` to (the first, for a graph
    without breaks), compiled afresh (``torch._dynamo.reset()`` before)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    try:
        _, codes = run_and_get_code(torch.compile(fn, **compile_kwargs), *args)
    finally:
        torch._dynamo.reset()
    return codes[0]


@dataclass(frozen=True)
class CodeFacts:
    """The precision-relevant facts of one generated module."""

    extern: tuple[str, ...]
    kernels: tuple[str, ...]
    accumulators: tuple[str, ...]
    dot_precision: tuple[str, ...]
    template_flags: tuple[str, ...]

    def row(self) -> tuple[str, str, str, str]:
        return (
            ", ".join(self.extern) or "none",
            ", ".join(self.kernels) or "none",
            ", ".join(self.accumulators) or "none",
            ", ".join(self.dot_precision + self.template_flags) or "none",
        )


def facts(code: str) -> CodeFacts:
    """What ``code`` (a module from :func:`generated`) calls and accumulates in."""

    def unique(found: list[str]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(found))

    dots = [
        f"input_precision={p}" if p else f"allow_tf32={t}" for p, t in _DOT_PRECISION.findall(code)
    ]
    return CodeFacts(
        extern=unique(_EXTERN.findall(code)),
        kernels=unique(_CPP_KERNEL.findall(code) + _TRITON_KERNEL.findall(code)),
        accumulators=unique(_CPP_ACC.findall(code) + _TRITON_ACC.findall(code)),
        dot_precision=unique(dots),
        template_flags=unique(f"{k}={v}" for k, v in _TEMPLATE_FLAGS.findall(code)),
    )


def per_setting(
    cases: Mapping[str, tuple[Callable[..., Any], Sequence[Any]]],
    settings: Mapping[str, Mapping[str, Any]],
    caption: str = "",
    **compile_kwargs: Any,
) -> Table:
    """A row per case and precision setting (switch paths as :func:`mpguide.core.state.put`
    takes them, each set for the compile and restored after): what inductor generated."""
    rows = []
    for setting, switches in settings.items():
        for case, (fn, args) in cases.items():
            with state.preserved():
                for path, value in switches.items():
                    state.put(path, value)
                found = facts(generated(fn, args, **compile_kwargs))
            rows.append((case, setting, *found.row()))
    return Table(
        ("case", "setting", "calls", "generated kernels", "accumulator", "dot precision"),
        tuple(rows),
        caption,
    )

"""The torch releases the guide supports, and the facts that changed inside that window.

Each fact names the release it changed in, so a page states what the running torch does ("since
2.12: ...") and asserts the side of the change that belongs to it; a torch bump edits this one
table. ``nox -s versions`` records the facts on every release of the window.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

WINDOW = ("2.11", "2.14")
"""The oldest and the newest torch release the guide is tested on (both inclusive)."""


def release(version: str = torch.__version__) -> tuple[int, int]:
    """``(major, minor)`` of a version string: ``"2.14.1+cu130"`` gives ``(2, 14)``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match[1]), int(match[2])


def at_least(version: str) -> bool:
    """Whether the running torch is ``version`` (``"2.12"``) or newer."""
    return release() >= release(version)


@dataclass(frozen=True)
class Change:
    """A behaviour of torch that changed in release ``since``: ``before`` holds on older
    releases of the window, ``after`` from ``since`` on."""

    name: str
    since: str
    before: str
    after: str

    @property
    def holds(self) -> bool:
        """Whether the running torch has the new behaviour."""
        return at_least(self.since)

    @property
    def now(self) -> str:
        """What the running torch does."""
        return self.after if self.holds else self.before

    def describe(self) -> str:
        """One sentence for a page: what this torch does, and what changed in which release."""
        if self.holds:
            return f"since torch {self.since}: {self.after} (before: {self.before})"
        return f"before torch {self.since}: {self.before} (from {self.since}: {self.after})"


CHANGES: dict[str, Change] = {}
"""Every fact that changed inside the window, by name."""


def _change(name: str, since: str, before: str, after: str) -> Change:
    CHANGES[name] = Change(name, since, before, after)
    return CHANGES[name]


def change(name: str) -> Change:
    """The change called ``name``."""
    return CHANGES[name]


# Each ``since`` was found by running the fact's probe on 2.11.0, 2.12.1, 2.13.0 and 2.14.1 (the
# standard builds, and 2.13.0's CPU-only build); ``nox -s versions`` records them again.

# -- autocast and dtype rules ----------------------------------------------------------------
_change(
    "rms_norm_cuda_autocast",
    "2.12",
    before="rms_norm has no CUDA autocast rule: under CUDA autocast it keeps its input dtype",
    after="rms_norm is on CUDA autocast's float32 list: under CUDA autocast it returns float32",
)
_change(
    "addmv_cpu_mixed_bias",
    "2.12",
    before="CPU addmv with a bf16 bias and a float32 matrix and vector returns float32",
    after="CPU addmv with a bf16 bias and a float32 matrix and vector raises",
)
_change(
    "quantile_fake_tensor",
    "2.12",
    before="quantile raises on fake tensors (the fake tensor mode calls its output "
    "data-dependent), so a simulated device has no dtype for it",
    after="quantile runs on fake tensors, so a simulated device gives its dtype",
)
_change(
    "quantile_internal_float64",
    "2.14",
    before="float32 quantile computes in float32",
    after="float32 quantile casts its input to float64 and the result back to float32 inside",
)
_change(
    "bf16_fft_simulated_cuda",
    "2.14",
    before="a bf16 fft.rfft on a fake CUDA tensor raises (BFloat16 is not supported), as the CPU "
    "does",
    after="a bf16 fft.rfft on a fake CUDA tensor returns complex64; the CPU kernel still raises",
)

# -- profiler -----------------------------------------------------------------------------------
_change(
    "profiler_acc_events",
    "2.13",
    before="torch.profiler.profile without acc_events=True warns on its first cycle that it "
    "clears events at the end of each cycle",
    after="torch.profiler.profile without acc_events=True warns only when a second cycle starts",
)

# -- torch.compile -----------------------------------------------------------------------------
_change(
    "dynamo_user_error_type",
    "2.12",
    before="an exception raised in a compiled function reaches the caller as Unsupported, its "
    "type and message shown only inside Dynamo's description of the variables, not as raised",
    after="an exception raised in a compiled function reaches the caller as Unsupported, with "
    "the exception as raised (type and message) further down the error text",
)
_change(
    "inductor_cpu_bf16_round_trip",
    "2.13",
    before="inductor's CPU code skips a float32 -> bf16 -> float32 rounding even with "
    "emulate_precision_casts: its CPU code generator ignores the setting, and its "
    "pointless_convert pass removes such a round trip from the graph",
    after="with emulate_precision_casts inductor's CPU code keeps a float32 -> bf16 -> float32 "
    "rounding, and its pointless_convert pass leaves a round trip through a narrower dtype in "
    "the graph",
)
_change(
    "compile_rejects_mixed_matmul",
    "2.12",
    before="inductor compiles a float16 @ float32 matmul that eager rejects, and returns float32",
    after="tracing rejects a float16 @ float32 matmul as eager does",
)

# -- formats -------------------------------------------------------------------------------------
# Measured on the CPU with 2.11.0, 2.12.1, 2.13.0 and 2.14.1 (torchao's float8 code says 2.12).
# The probe casts 1000 and inf; the boundary of the rounding before 2.13 is half a step past 448
# (the next step, 480, is e4m3fn's NaN code): 464 is a tie and rounds to even, 448.
_change(
    "fp8_e4m3fn_cast_saturates",
    "2.13",
    before="a cast to float8_e4m3fn rounds to nearest without saturating: finite values in "
    "(448, 464] round to ±448, larger ones and infinities become NaN",
    after="a cast to float8_e4m3fn saturates every finite value past 448 and infinities to ±448",
)

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


# -- autocast policy (mpguide.autocast.policy and examples/autocast) --------------------------
_change(
    "rms_norm has a CUDA autocast kernel",
    "2.12",
    "rms_norm has no autocast kernel on CUDA, XPU or MTIA: it keeps its input dtype",
    "rms_norm is on the float32 list of CUDA, XPU and MTIA autocast",
)
_change(
    "cpu addmv takes a bf16 bias with float32 operands",
    "2.12",
    "the CPU's addmv with a bf16 bias and a float32 matrix and vector returns float32",
    "the CPU's addmv with a bf16 bias and a float32 matrix and vector raises (one dtype only)",
)
_change(
    "quantile computes in float64",
    "2.14",
    "quantile of a float32 tensor computes in float32",
    "quantile of a float32 tensor casts it to float64 and the result back to float32",
)
_change(
    "bf16 fft on simulated cuda",
    "2.14",
    "a bf16 fft.rfft on a fake CUDA tensor raises (Unsupported dtype BFloat16), as the CPU does",
    "a bf16 fft.rfft on a fake CUDA tensor returns complex64; the CPU kernel still raises",
)

"""Memory a model report needs before it runs, against what the machine has.

:func:`report_needs` adds up the copies :func:`mpguide.models.per_module.report` keeps: a
float64 copy of the model for the reference, a copy in the low dtype where the model is cast
or moved, gradients where it runs backward; :func:`check` refuses in one line where that is
more than the device has available (:func:`available`), which ``MPGUIDE_MEMORY_GB`` overrides.
"""

from __future__ import annotations

import math
import os

import torch

from mpguide import MPGuideError

ENV = "MPGUIDE_MEMORY_GB"
"""The memory, in GB, a report may use: overrides what the machine says it has available."""
GB = 1e9


def available(dev: torch.device) -> tuple[int, str] | None:
    """The bytes ``dev`` has available and where that figure comes from: :data:`ENV`, else
    ``MemAvailable`` in /proc/meminfo (the CPU) or the CUDA driver's free memory; ``None``
    where none of them says."""
    given = os.environ.get(ENV)
    if given:
        try:
            gb = float(given)
        except ValueError:
            gb = math.nan
        if not (math.isfinite(gb) and gb > 0):
            raise MPGuideError(f"{ENV} must be a number of GB above 0, got {given!r}")
        return int(gb * GB), ENV
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0], "free CUDA memory"
    if dev.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    return None


def _bytes(tensors, dtype: torch.dtype | None = None) -> int:
    """Their bytes, each floating one as ``dtype`` where given."""
    return sum(
        t.numel() * (dtype.itemsize if dtype and t.is_floating_point() else t.element_size())
        for t in tensors
    )


def report_needs(
    model: torch.nn.Module, dtype: torch.dtype | None, copied: bool, backward: bool
) -> dict[str, int]:
    """The bytes of each copy a report of ``model`` keeps beyond the model itself: the float64
    reference, the run's own copy (cast to ``dtype`` or moved, where ``copied``), and the
    gradients of its parameters (``backward``). Activations come on top."""
    tensors = [*model.parameters(), *model.buffers()]
    needs = {"float64 copy": _bytes(tensors, torch.float64)}
    if copied:
        needs["cast copy" if dtype else "moved copy"] = _bytes(tensors, dtype)
    if backward:
        grads = [p for p in model.parameters() if p.requires_grad]
        needs["gradients"] = _bytes(grads, dtype)
    return needs


def check(needs: dict[str, int], dev: torch.device) -> None:
    """Refuse in one line where ``needs`` add up to more than ``dev`` has available."""
    have = available(dev)
    total = sum(needs.values())
    if have is None or total <= have[0]:
        return
    parts = ", ".join(f"{name} {size_text(size)}" for name, size in needs.items())
    raise MPGuideError(
        f"the report needs about {size_text(total)} on {dev.type} before activations "
        f"({parts}) and {dev.type} has {size_text(have[0])} available ({have[1]}); set "
        f"{ENV} to the GB it may use to run anyway"
    )


def size_text(n: int) -> str:
    """Bytes in decimal units a person reads: ``1.69 kB``, ``3.4 GB``."""
    for unit, scale in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"

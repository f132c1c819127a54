"""What casts cost on a device: a norm's float32 upcast against the norm itself, and cast
kernels against the bandwidth of a plain copy.

:func:`norm_upcasts` profiles LayerNorm and RMSNorm on a bf16 activation, under autocast and
computed in float32 by hand; :func:`cast_bandwidth` times ``tensor.to(dtype)`` against
``clone()`` of the same bytes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from statistics import median

import torch
import torch.nn.functional as F

from mpguide.core import device as _device
from mpguide.core import dtypes, timing
from mpguide.core.table import Table
from mpguide.traces import casts
from mpguide.traces.profiling import profile_fn

_NORMS = {"LayerNorm": "aten::layer_norm", "RMSNorm": "aten::rms_norm"}


def _norm_calls(dev: torch.device, x: torch.Tensor) -> dict[tuple[str, str], Callable]:
    """Each norm, under autocast and in float32 by hand, as a call on ``x``."""
    features = x.shape[-1]
    layer = torch.nn.LayerNorm(features, device=dev)
    rms = torch.nn.RMSNorm(features, device=dev)

    def autocast(module):
        def call():
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                return module(x)

        return call

    def by_hand_layer():
        return F.layer_norm(x.float(), (features,), layer.weight, layer.bias).to(x.dtype)

    def by_hand_rms():
        return F.rms_norm(x.float(), (features,), rms.weight).to(x.dtype)

    return {
        ("LayerNorm", "autocast"): autocast(layer),
        ("LayerNorm", "float32 by hand"): by_hand_layer,
        ("RMSNorm", "autocast"): autocast(rms),
        ("RMSNorm", "float32 by hand"): by_hand_rms,
    }


def norm_upcasts(
    dev: torch.device | str | None = None, rows: int = 512, features: int = 1024, steps: int = 5
) -> Table:
    """Per norm call, medians over ``steps`` profiled steps: the norm's own time (kernel time
    on a GPU, op time elsewhere) without the casts inside it, and the casts up to float32 and
    back, for a ``rows x features`` bf16 activation."""
    dev = _device.pick() if dev is None else torch.device(dev)
    gpu = dev.type == "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, features, device=dev, generator=gen).to(torch.bfloat16)
    out = []
    for (norm, way), call in _norm_calls(dev, x).items():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Mismatch dtype between input and weight")
            out_dtype = call().dtype
            tree = profile_fn(call, active=steps).tree()
        found = [c for c in casts.report(tree) if c.shape]
        nodes = [n for n in tree.find(_NORMS[norm]) if n.parent is None or n.parent.name != n.name]
        cast_us = {c.id: c.gpu_us if gpu else c.cpu_us for c in found}
        own = [
            (n.gpu_time if gpu else n.dur) - sum(cast_us.get(m.id, 0.0) for m in n.walk())
            for n in nodes
        ]
        up = [cast_us[c.id] for c in found if c.target == "float32"]
        down = [cast_us[c.id] for c in found if c.source == "float32"]
        norm_us = median(own) if own else None
        up_us = median(up) if up else None
        out.append(
            (
                norm,
                way,
                dtypes.short(out_dtype),
                len(found) // steps,
                norm_us,
                up_us,
                median(down) if down else None,
                f"{up_us / norm_us:.2f}" if up_us and norm_us else None,
            )
        )
    clock = "kernel" if gpu else "op"
    columns = ("norm", "how", "output", "casts/call", f"norm {clock} us", "upcast us")
    columns += ("downcast us", "upcast / norm")
    caption = (
        f"A norm on a {rows} x {features} bf16 activation, medians over {steps} steps, "
        f"{clock} time: {_device.describe(dev).caption()}"
    )
    notes = ("Tensor casts only: 0-d conversions of Python scalars are left out.",)
    return Table(columns, tuple(out), caption, notes)


PAIRS = (
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float16),
    (torch.float32, torch.float8_e4m3fn),
)


def cast_bandwidth(
    dev: torch.device | str | None = None,
    sizes: Sequence[int] | None = None,
    pairs: Sequence[tuple[torch.dtype, torch.dtype]] = PAIRS,
    repeat: int = 20,
) -> Table:
    """Time of ``x.to(target)`` for ``x`` of each size and source dtype, the bytes it reads and
    writes, and its bandwidth against a ``clone()`` of the source timed in the same run."""
    dev = _device.pick() if dev is None else torch.device(dev)
    if sizes is None:
        sizes = (1 << 20, 1 << 24, 1 << 27) if dev.type == "cuda" else (1 << 18, 1 << 22)
    rows = []
    for n in sizes:
        for source, target in pairs:
            x = torch.randn(n, device=dev).to(source)
            runs = timing.compare_latency(
                {"copy": x.clone, "cast": lambda x=x, target=target: x.to(target)},
                dev,
                warmup=3,
                repeat=repeat,
            )
            moved = n * (source.itemsize + target.itemsize)
            copy_rate = 2 * n * source.itemsize / runs["copy"].median
            rate = moved / runs["cast"].median
            rows.append(
                (
                    f"{dtypes.short(source)} -> {dtypes.short(target)}",
                    n,
                    moved,
                    runs["cast"].median * 1e6,
                    rate / 1e9,
                    copy_rate / 1e9,
                    f"{rate / copy_rate:.2f}",
                )
            )
    columns = ("cast", "elements", "bytes moved", "median us", "GB/s", "copy GB/s", "vs copy")
    caption = (
        f"tensor.to(dtype) against clone() of its source, medians of {repeat}: "
        f"{_device.describe(dev).caption()}"
    )
    notes = ("Bytes moved: the source read and the target written; a copy moves twice the source.",)
    return Table(columns, tuple(rows), caption, notes)

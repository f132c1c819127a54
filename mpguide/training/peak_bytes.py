"""The peak bytes of the tensors a call allocates, on any device, counted at the dispatcher.

:class:`PeakBytes` is a dispatch mode that adds up the storage of every tensor an op returns
on a storage not seen before, and subtracts it when that storage is freed; its ``peak`` is
the most that was alive at once. Inputs made before the block are not counted, nor memory a
kernel uses internally without returning it (workspaces): on CUDA,
``torch.cuda.max_memory_allocated`` is the figure that includes them.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakBytes(TorchDispatchMode):
    """``with PeakBytes() as mem: ...`` then ``mem.peak`` (bytes) and ``mem.live`` (bytes
    still alive at the end)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._seen or storage.nbytes() == 0:
                continue
            self._seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

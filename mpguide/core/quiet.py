"""Keep the lines torchao prints while it imports off mpguide's output.

transformers imports torchao, where installed, when its models load (its torchao quantizer), so
a reader's model module imported by the CLI, or a page building a transformers model, prints:

- ``Failed to load .../torchao/_C_mxfp8...so: ...``, one line per kernel library that does not
  load here (built for another Python or for CUDA), logged at WARNING by torchao's
  ``__init__`` (torchao 0.18) to a logger without handlers, so Python's last resort writes it
  to stderr;
- ``<enum 'KernelPreference'> is an Enum subclass ... register_constant() on Enum subclasses is
  deprecated``, logged at WARNING by ``torch.utils._pytree`` (torch 2.13 and 2.14, not 2.11)
  for each Enum torchao registers as a pytree constant.

:func:`library_imports` drops exactly these records inside its block; everything else those
loggers say still shows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

NOISE = {
    "torchao": ("Failed to load ", ".so"),
    "torch.utils._pytree": ("is an Enum subclass", "register_constant()"),
}
"""Logger name: two parts of the message of each record :func:`library_imports` drops."""


class _Drop(logging.Filter):
    def __init__(self, *parts: str) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not all(p in text for p in self.parts)


@contextmanager
def library_imports() -> Iterator[None]:
    """Inside, the import-time lines of :data:`NOISE` are not logged (a filter on each of those
    loggers, removed on leaving)."""
    added = [(logging.getLogger(name), _Drop(*parts)) for name, parts in NOISE.items()]
    for log, drop in added:
        log.addFilter(drop)
    try:
        yield
    finally:
        for log, drop in added:
            log.removeFilter(drop)

"""The reader's own code, named on the command line: found, imported and called, its errors
and ``SystemExit`` told in one line that says what was being done.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from mpguide import MPGuideError, error_line
from mpguide.core import output, quiet

SPEC = "FILE.py:NAME or package.module:NAME"
"""How every command names the reader's code; importing it runs its top-level code."""
NOT_THE_READERS = (MPGuideError, KeyboardInterrupt, output.Ended)
"""What passes through the reader's code untold: mpguide's own errors, Ctrl-C and the
signals that end the command. Any other ``BaseException`` (``SystemExit``, ``GeneratorExit``,
a class of the reader's own) is the reader's code failing."""


def reader_error(err: BaseException) -> str:
    """An error of the reader's code in one line; ``SystemExit`` with its code."""
    if isinstance(err, SystemExit):
        return f"SystemExit({err.code!r})"
    return error_line(err)


@contextmanager
def readers_code(doing: str) -> Iterator[None]:
    """An exception raised by the reader's code inside, ``SystemExit`` and any other
    ``BaseException`` but :data:`NOT_THE_READERS`: one line saying what was being done.
    torchao's import-time lines (transformers imports it) are dropped."""
    try:
        with quiet.library_imports():
            yield
    except BaseException as err:  # the reader's code: named in one line
        if isinstance(err, NOT_THE_READERS):
            raise
        raise MPGuideError(f"{doing} raised {reader_error(err)}") from None


def load_spec(spec: str):
    """The function ``spec`` names: ``FILE.py:NAME`` (the file is imported with its folder
    first on ``sys.path``, as ``python FILE.py`` would run it) or ``package.module:NAME``
    (imported from here). Importing runs the module's top-level code."""
    import importlib
    import importlib.util
    from pathlib import Path

    where, colon, name = spec.rpartition(":")
    if not colon or not where or not name:
        raise MPGuideError(f"give {SPEC}, got {spec!r}")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise MPGuideError(f"no file {where!r}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise MPGuideError(f"{where!r} is not a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.resolve().parent))
        with readers_code(f"importing {where}"):
            module_spec.loader.exec_module(module)
    else:
        with readers_code(f"importing {where}"):
            try:
                found = importlib.util.find_spec(where)  # imports the parent packages
            except ModuleNotFoundError as err:
                raise MPGuideError(f"cannot import {where!r}: {err}") from None
            if found is None:
                raise MPGuideError(f"cannot import {where!r}: no module of that name from here")
            module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise MPGuideError(f"{where} has no function {name!r}")
    return fn


def factory(spec: str):
    """``(model, inputs)`` from the factory ``spec`` names, called once."""
    import torch

    factory = load_spec(spec)
    with readers_code(f"calling {spec}"):
        made = factory()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise MPGuideError(f"{spec} must return (model, inputs), got {type(made).__name__}")
    return made

"""Results worth keeping between processes: a probe that takes seconds and gives the same
answer on the same torch build and the same mpguide, asked again by another command or page.

Nothing is kept unless ``$MPGUIDE_CACHE`` names a folder (the site's build sets it to
``build/cache``). A result is kept there under a key of what it depends on, which always
includes the torch build, the Python version, the machine and a hash of this package's
source, so that a changed torch, machine or mpguide computes it again. Processes that ask
for one result at once take turns (a lock file per key): one computes, the others read.
Results are pickled: the folder must be one you trust, as for any cache.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import platform
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

try:
    import fcntl
except ImportError:  # Windows: no locks, a result may be computed twice at once
    fcntl = None

ENV = "MPGUIDE_CACHE"
log = logging.getLogger(__name__)
T = TypeVar("T")
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO would wait for its other end


@functools.cache
def _source_hash() -> str:
    """A hash of every Python file of the package (names and contents)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _folder() -> Path | None:
    named = os.environ.get(ENV)
    return Path(named) if named else None


def kept(kind: str, key: tuple, compute: Callable[[], T], of: type) -> T:
    """``compute()``, or the result of type ``of`` a process kept for the same ``kind`` and
    ``key`` (plus the torch build, Python and mpguide source) in ``$MPGUIDE_CACHE``. Without
    that folder, where it cannot be written, or where what is kept cannot be read back as an
    ``of`` (a damaged file, a FIFO, a folder in its place): ``compute()``, and nothing half
    written is left."""
    folder = _folder()
    if folder is None:
        return compute()
    machine = (platform.node(), platform.machine())  # not processor(): a subprocess on Linux
    whole = (kind, key, torch.__version__, torch.version.git_version, sys.version, machine)
    whole += (_source_hash(),)
    name = f"{kind}-{hashlib.sha256(repr(whole).encode()).hexdigest()[:24]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = _open_regular(folder / f"{name}.lock", os.O_WRONLY | os.O_CREAT, "wb")
    except OSError as err:
        log.info("%s: not kept: %s", folder, err)
        return compute()
    with lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        path = folder / f"{name}.pickle"
        try:
            with _open_regular(path, os.O_RDONLY, "rb") as f:
                value = pickle.load(f)
            if isinstance(value, of):
                return value
            log.info("%s: computed again: a %s, not a %s", path, type(value).__name__, of.__name__)
        except FileNotFoundError:
            pass
        except Exception as err:  # noqa: BLE001 - whatever a damaged pickle raises: compute
            log.info("%s: computed again: %s", path, err)
        value = compute()
        _keep(value, folder, path)
        return value


def _open_regular(path: Path, flags: int, mode: str):
    """``path`` opened without waiting (a FIFO would block); OSError unless a regular file."""
    fd = os.open(path, flags | _NONBLOCK, 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        if _NONBLOCK:
            os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def _keep(value: object, folder: Path, path: Path) -> None:
    """Write ``value`` to ``path`` through a ``.part`` file, or log why not and remove it."""
    part = None
    try:
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".part", delete=False) as out:
            part = out.name
            pickle.dump(value, out)
        os.replace(part, path)
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as err:
        log.info("%s: not kept: %s", path, err)
        if part is not None:
            Path(part).unlink(missing_ok=True)

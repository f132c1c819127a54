"""Recorded results: tables measured on another machine (a GPU), with their provenance.

A recording is one JSON file: its :class:`Provenance` and tables by key, written by
:func:`save`; :func:`beside` shows a live table with every
recording of the same key, so a page built on a CPU still shows what a GPU measured. What the
site records, and where, lives with the site (``docs/site_recordings.py``, ``nox -s record``).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from dataclasses import asdict, dataclass, field
from html import escape
from pathlib import Path

import torch

from mpguide import MPGuideError
from mpguide.core import device as _device
from mpguide.core.table import Table, _plain

SCHEMA = 1
ENVIRONMENT = "MPGUIDE_RECORDED"
"""The variable naming the folder of recordings that :func:`beside` shows by default."""


@dataclass(frozen=True)
class Provenance:
    """Where and how a recording was made."""

    device: str
    name: str
    driver: str | None
    cuda: str | None
    torch: str
    date: str
    command: str

    def label(self) -> str:
        parts = [f"{self.name} ({self.device})", f"torch {self.torch}"]
        parts += [f"CUDA {self.cuda}"] if self.cuda else []
        parts += [f"driver {self.driver}"] if self.driver else []
        return f"recorded on {', '.join(parts)}, {self.date}, by `{self.command}`"


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def provenance(dev: torch.device, command: str) -> Provenance:
    """The provenance of a recording made now on ``dev``."""
    machine = _device.describe(dev)
    cuda = dev.type == "cuda"
    return Provenance(
        device=dev.type,
        name=machine.name,
        driver=_driver() if cuda else None,
        cuda=torch.version.cuda if cuda else None,
        torch=torch.__version__,
        date=datetime.date.today().isoformat(),
        command=command,
    )


@dataclass(frozen=True)
class Recording:
    """Tables measured on one machine, by key, with their provenance."""

    provenance: Provenance
    tables: dict[str, Table] = field(repr=False)

    def to_json(self) -> str:
        results = {
            key: {
                "caption": t.caption,
                "notes": list(t.notes),
                "columns": list(t.columns),
                "rows": [[_plain(v) for v in row] for row in t.rows],
            }
            for key, t in self.tables.items()
        }
        doc = {"schema": SCHEMA, "provenance": asdict(self.provenance), "results": results}
        return json.dumps(doc, indent=1)


def slug(p: Provenance) -> str:
    """A file name for a recording: the device's name in lower case and dashes."""
    return re.sub(r"[^a-z0-9]+", "-", p.name.lower()).strip("-") or p.device


def save(rec: Recording, path: Path | str) -> Path:
    """Write ``rec`` as JSON, whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(rec.to_json())
    os.replace(tmp, path)
    return path


def load(path: Path | str) -> Recording:
    """Read a recording, checking its schema; raise ``MPGuideError`` naming what is wrong."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise MPGuideError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MPGuideError(f"{path}: not JSON ({err})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise MPGuideError(f"{path}: not an mpguide recording of schema {SCHEMA}")
    try:
        prov = Provenance(**doc["provenance"])
        tables = {
            key: Table(
                tuple(r["columns"]),
                tuple(tuple(row) for row in r["rows"]),
                r["caption"],
                tuple(r["notes"]),
            )
            for key, r in doc["results"].items()
        }
    except (KeyError, TypeError, ValueError) as err:
        raise MPGuideError(f"{path}: malformed recording ({err})") from None
    return Recording(prov, tables)


def recordings(directory: Path | str | None = None) -> list[Recording]:
    """Every recording in ``directory`` (default: the folder ``MPGUIDE_RECORDED`` names; none
    when it is unset)."""
    directory = directory or os.environ.get(ENVIRONMENT)
    if not directory:
        return []
    return [load(p) for p in sorted(Path(directory).glob("*.json"))]


@dataclass(frozen=True)
class Beside:
    """A live table and the recorded tables of the same key, each labelled."""

    key: str
    live: Table | None
    recorded: tuple[tuple[Provenance, Table], ...]
    machine: _device.Machine | None = None

    def _none(self) -> str:
        where = os.environ.get(ENVIRONMENT)
        if not where:
            return f"No recording of {self.key!r}: set {ENVIRONMENT} to a folder of recordings."
        return (
            f"No recording of {self.key!r} in {Path(where).name}/ yet: "
            "`nox -s record` on a GPU machine makes one."
        )

    def _parts(self) -> list[tuple[str, Table]]:
        parts = []
        if self.live is not None:
            where = self.machine.caption() if self.machine else "this build"
            parts.append((f"measured live while this page was built: {where}", self.live))
        parts += [(p.label(), t) for p, t in self.recorded]
        return parts

    def __repr__(self) -> str:
        if not self._parts():
            return self._none()
        return "\n\n".join(f"{label}\n{t.to_text()}" for label, t in self._parts())

    def _repr_html_(self) -> str:
        if not self._parts():
            return f"<p><em>{escape(self._none())}</em></p>"
        return "".join(
            f"<p><strong>{escape(label)}</strong></p>{t.to_html()}" for label, t in self._parts()
        )


def beside(
    key: str,
    live: Table | None = None,
    *,
    machine: _device.Machine | None = None,
    directory: Path | str | None = None,
) -> Beside:
    """The live table of ``key`` with every recording of it: a CPU build shows what a GPU
    measured, and a GPU build shows its live results beside the recorded ones."""
    found = tuple((r.provenance, r.tables[key]) for r in recordings(directory) if key in r.tables)
    return Beside(key, live, found, machine)

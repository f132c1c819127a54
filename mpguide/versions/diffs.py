"""What changed from one torch release to the next, read from the recordings of
:mod:`mpguide.versions.probes` (JSON only: no torch of the window needs to be installed).

Each recording flattens to rows ``(group, where, key) -> value``: a switch, a fact, or one op's
class and output dtypes on one device and dtype. :func:`compare` lines up consecutive
releases and keeps only the rows whose value changed, with counts of the rows that stayed the
same; :func:`check_changes` checks the table of :mod:`mpguide.core.versions` against what the
recordings observed, and :func:`disagreements` a live probe against its own recording.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpguide.core import versions
from mpguide.core.table import Table
from mpguide.versions import probes

ABSENT = "(not recorded)"
Row = tuple[str, str, str]
"""``(group, where, key)``: ``("autocast", "cuda/bf16", "rms_norm")``, ``("switches", "",
"backends.cudnn.allow_tf32")``."""


def release_key(doc: Mapping) -> tuple[int, ...]:
    """Sort key of a recording: its torch version as numbers (``2.12.1`` -> ``(2, 12, 1)``)."""
    base = doc["provenance"]["torch"].split("+")[0]
    return tuple(int(p) for p in base.split(".") if p.isdigit())


def recordings(directory: Path | str) -> list[dict]:
    """Every recording in ``directory``, oldest release first."""
    docs = [probes.load(p) for p in sorted(Path(directory).glob("*.json"))]
    return sorted(docs, key=release_key)


def name(doc: Mapping) -> str:
    """A recording's torch version without the build tag."""
    return doc["provenance"]["torch"].split("+")[0]


def torch_of(doc: Mapping) -> str:
    """A recording's torch version with its build tag (``2.13.0+cpu``)."""
    return doc["provenance"]["torch"]


def standard(doc: Mapping) -> bool:
    """Whether a recording is of the standard build (CUDA libraries, with or without a GPU)."""
    return doc["provenance"]["build"].startswith("CUDA")


def series(docs: Sequence[dict]) -> list[dict]:
    """One recording per release, oldest first: the standard build where a release has one,
    so that every step between releases compares the same build."""
    first: dict[tuple[int, ...], dict] = {}
    for d in sorted(docs, key=lambda d: (release_key(d), not standard(d), torch_of(d))):
        first.setdefault(release_key(d), d)
    return list(first.values())


def builds(docs: Sequence[dict]) -> tuple[Step, ...]:
    """Each recording left out of :func:`series` against the series' recording of its
    release: what the build, not the release, changes."""
    chosen = {release_key(d): d for d in series(docs)}
    return tuple(
        step(chosen[release_key(d)], d)
        for d in sorted(docs, key=release_key)
        if chosen[release_key(d)] is not d
    )


def op_value(entry: Mapping) -> str:
    """One op as a cell: its class, the output dtypes of its float32, low and mixed runs, and
    the casts autocast inserted."""
    outs = " / ".join(o or "-" for o in entry["out"])
    casts = f"; casts {', '.join(entry['casts'])}" if entry["casts"] else ""
    return f"{entry['class']} ({outs}){casts}"


def flatten(doc: Mapping) -> dict[Row, Any]:
    """A recording as rows ``(group, where, key) -> value`` (the groups it holds)."""
    rows: dict[Row, Any] = {}
    for group in ("switches", "facts"):
        rows.update({(group, "", k): v for k, v in doc.get(group, {}).items()})
    for where, probed in doc.get("autocast", {}).items():
        rows[("autocast", where, "(how)")] = probed["how"]
        for op, entry in probed.get("ops", {}).items():
            rows[("autocast", where, op)] = op_value(entry)
    return rows


@dataclass(frozen=True)
class Step:
    """From one release's recording to the next: the rows that changed, and how many did not."""

    before: str
    after: str
    changed: tuple[tuple[Row, Any, Any], ...]
    same: Mapping[str, int]

    @property
    def title(self) -> str:
        return f"torch {self.before} -> {self.after}"

    def counts(self) -> dict[str, tuple[int, int]]:
        """Per group: ``(changed, same)``."""
        changed = Counter(row[0] for row, _, _ in self.changed)
        groups = sorted(set(changed) | set(self.same))
        return {g: (changed.get(g, 0), self.same.get(g, 0)) for g in groups}

    def summary(self) -> str:
        """``switches: 2 changed, 14 same; ...``."""
        return "; ".join(f"{g}: {c} changed, {s} same" for g, (c, s) in self.counts().items())

    def table(self, group: str | None = None) -> Table:
        """The rows that changed (of one group, or all)."""
        rows = tuple(
            (g, where, key, _cell(a), _cell(b))
            for (g, where, key), a, b in self.changed
            if group is None or g == group
        )
        return Table(
            ("group", "where", "what", self.before, self.after),
            rows,
            f"{self.title}: {self.summary()}",
        )

    def __repr__(self) -> str:
        return self.table().to_text()

    def _repr_html_(self) -> str:
        return self.table().to_html()


def _cell(value: Any) -> str:
    return ABSENT if value is None else value if isinstance(value, str) else str(value).lower()


def step(a: Mapping, b: Mapping, groups: Iterable[str] | None = None) -> Step:
    """Compare two recordings row by row (only the groups both hold, or ``groups``)."""
    common = set(probes.GROUPS if groups is None else groups)
    common &= set(a) & set(b)
    ra = {k: v for k, v in flatten(a).items() if k[0] in common}
    rb = {k: v for k, v in flatten(b).items() if k[0] in common}
    changed, same = [], Counter()
    for row in sorted(set(ra) | set(rb)):
        va, vb = ra.get(row), rb.get(row)
        if va == vb:
            same[row[0]] += 1
        else:
            changed.append((row, va, vb))
    labels = (name(a), name(b)) if name(a) != name(b) else (torch_of(a), torch_of(b))
    return Step(*labels, tuple(changed), dict(same))


@dataclass(frozen=True)
class History:
    """Consecutive releases' recordings and the steps between them."""

    docs: tuple[dict, ...] = field(repr=False)
    steps: tuple[Step, ...]

    def provenance(self) -> Table:
        """Where each recording was made."""
        keys = ("torch", "build", "python", "machine", "date", "command")
        commands = {d["provenance"]["command"] for d in self.docs}
        if len(commands) == 1:  # said once, under the table, so the table fits a page
            keys = keys[:-1]
        rows = tuple(tuple(d["provenance"][k] for k in keys) for d in self.docs)
        notes = [f"each made by: {next(iter(commands))}"] if len(commands) == 1 else []
        caption = f"{len(self.docs)} releases, one recording each, oldest first"
        return Table(keys, rows, caption, notes)

    def counts(self) -> Table:
        """Per step and group: how many rows changed and how many stayed the same."""
        rows = tuple((s.title, g, c, n) for s in self.steps for g, (c, n) in s.counts().items())
        return Table(("releases", "group", "changed", "same"), rows, "what changed, by group")

    def timeline(self, group: str) -> Table:
        """Each row of ``group`` that changed anywhere in the window, with its value on every
        release and the releases it changed in: answers "since which release does X"."""
        flat = [flatten(d) for d in self.docs]
        changed = sorted({row for s in self.steps for row, _, _ in s.changed if row[0] == group})
        rows = []
        for row in changed:
            values = [_cell(f.get(row)) for f in flat]
            steps = [
                ".".join(map(str, release_key(d)[:2]))
                for d, a, b in zip(self.docs[1:], values, values[1:], strict=False)
                if a != b
            ]
            rows.append((row[1], row[2], *values, ", ".join(steps)))
        return Table(
            ("where", "what", *(name(d) for d in self.docs), "changed in"),
            tuple(rows),
            f"{group}: the {len(rows)} rows that changed inside the window",
        )


def compare(docs: Sequence[dict]) -> History:
    """The steps between consecutive releases, one recording each (:func:`series`)."""
    docs = tuple(series(docs))
    return History(docs, tuple(step(a, b) for a, b in itertools.pairwise(docs)))


@dataclass(frozen=True)
class Check:
    """One change of :data:`mpguide.core.versions.CHANGES` against the recordings."""

    change: versions.Change
    seen: tuple[tuple[str, str | None], ...]
    verdict: str

    @property
    def ok(self) -> bool:
        return self.verdict.startswith("agrees")


def _verdict(change: versions.Change, seen: Sequence[tuple[str, str | None]]) -> str:
    observed = [(v, o) for v, o in seen if o is not None]
    if not observed:
        return "not probed: add a probe with probes.fact"
    since = versions.release(change.since)
    before = {o for v, o in observed if versions.release(v) < since}
    after = {o for v, o in observed if versions.release(v) >= since}
    if len(before) > 1 or len(after) > 1:
        return "disagrees: the probe's answer changes inside one side of the change"
    if before and after and before == after:
        return f"disagrees: no change at {change.since} in the recordings"
    return f"agrees: {' -> '.join(sorted(before) + sorted(after))}"


def check_changes(
    docs: Sequence[dict], changes: Mapping[str, versions.Change] | None = None
) -> tuple[Check, ...]:
    """For every change: what each recording's probe observed, and whether the observations
    switch exactly at the release the change names."""
    changes = versions.CHANGES if changes is None else changes
    out = []
    for key, ch in sorted(changes.items()):
        seen = tuple((name(d), d.get("facts", {}).get(key)) for d in docs)
        out.append(Check(ch, seen, _verdict(ch, seen)))
    return tuple(out)


def checks_table(checks: Sequence[Check], docs: Sequence[dict]) -> Table:
    """The checks of :func:`check_changes` as a table, one column per recording."""
    rows = tuple(
        (c.change.name, c.change.since, *(_cell(o) for _, o in c.seen), c.verdict) for c in checks
    )
    return Table(
        ("change", "since", *(name(d) for d in docs), "verdict"),
        rows,
        "the facts of mpguide.core.versions against the recordings",
    )


def disagreements(live: Mapping, recorded: Mapping) -> list[tuple[Row, Any, Any]]:
    """The rows where a live probe of the running torch differs from its recording (only the
    groups the live probe holds)."""
    return list(step(recorded, live, groups=[g for g in probes.GROUPS if g in live]).changed)


def matching(docs: Sequence[dict], version: str, build: str) -> dict | None:
    """The recording of exactly this torch: its version, build tag and build (a CUDA build
    with a GPU simulates nothing, so it does not match one recorded without)."""
    return next(
        (
            d
            for d in docs
            if (d["provenance"]["torch"], d["provenance"]["build"]) == (version, build)
        ),
        None,
    )

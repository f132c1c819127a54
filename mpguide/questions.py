"""Readers' questions: the collected list (``mpguide/data/questions.json``, package data, so an
installed mpguide reads it too), ranked by how often a confusion recurs, with the page section
that answers each one.

A question's ``answered_by`` is ``path/to/plot_page.py#anchor``: the anchor is the HTML id
Sphinx gives the section heading (:func:`anchor`), so :func:`sections` of the page must list it.
To add a question, append an entry to the data file (its threads in ``links``, ``count`` equal
to their number, a ``group`` shared with the questions that ask the same thing, ``coverage``
and, unless it is full, a ``note`` saying what is missing); ``tests/test_questions.py`` checks
the entry and that its section exists.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from html import escape
from pathlib import Path

from mpguide import MPGuideError
from mpguide.core.table import Table

DATA = Path(__file__).with_name("data") / "questions.json"
"""The collected questions, shipped with the package (``package-data`` in pyproject.toml)."""
COVERAGE = ("full", "part", "none")
THEMES = ("compile", "switches", "attention", "autocast", "training", "fsdp2", "inference")
LINK = re.compile(
    r"^https://(github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+"
    r"|discuss\.pytorch\.org/t/[\w-]+/\d+)$"
)
"""A GitHub issue or pull request, or a PyTorch forums topic."""
GALLERY = "examples"


@dataclass(frozen=True)
class Question:
    """One question as readers asked it, with the threads that asked it."""

    id: str
    theme: str
    group: str
    asked: str
    question: str
    links: tuple[str, ...]
    count: int
    answered_by: str | None
    coverage: str
    note: str = ""

    @property
    def page(self) -> str | None:
        """The answering page's path, without its anchor."""
        return None if self.answered_by is None else self.answered_by.partition("#")[0]

    @property
    def anchor(self) -> str | None:
        return None if self.answered_by is None else self.answered_by.partition("#")[2]


def load(path: str | Path = DATA) -> tuple[Question, ...]:
    """The questions in ``path``, or ``MPGuideError`` naming the first bad entry."""
    try:
        raw = json.loads(Path(path).read_text())["questions"]
    except (OSError, KeyError, json.JSONDecodeError) as err:
        raise MPGuideError(f"cannot read questions from {path}: {err}") from None
    out = []
    for entry in raw:
        try:
            q = Question(**{**entry, "links": tuple(entry["links"])})
        except TypeError as err:
            raise MPGuideError(f"question {entry.get('id', '?')}: {err}") from None
        if q.coverage not in COVERAGE or (q.answered_by is None) != (q.coverage == "none"):
            raise MPGuideError(f"question {q.id}: coverage {q.coverage!r} with {q.answered_by}")
        out.append(q)
    return tuple(out)


def anchor(title: str) -> str:
    """The id Sphinx (docutils' ``make_id``) gives a section called ``title``: lower case,
    runs of other characters as one hyphen, no leading digits or hyphens."""
    text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode().lower()
    text = re.sub(r"[^a-z0-9]+", "-", text)
    return re.sub(r"^[^a-z]+", "", text).strip("-")


_HEADING = re.compile(r"^# %%\n# (?P<title>[^\n]+)\n# (?P<rule>-+)$", re.MULTILINE)


def sections(page: str | Path) -> dict[str, str]:
    """``{anchor: title}`` of the dashed ``# %%`` headings of a sphinx-gallery script."""
    text = Path(page).read_text()
    return {
        anchor(m["title"]): m["title"]
        for m in _HEADING.finditer(text)
        if len(m["rule"]) >= len(m["title"])
    }


def ranked(questions: tuple[Question, ...]) -> tuple[Question, ...]:
    """Most recurring confusion first: by the threads of the question's group, then its own."""
    size = Counter()
    for q in questions:
        size[q.group] += q.count
    return tuple(sorted(questions, key=lambda q: (-size[q.group], q.group, -q.count, q.id)))


def group_sizes(questions: tuple[Question, ...]) -> dict[str, int]:
    """Threads per group, largest first."""
    size = Counter()
    for q in questions:
        size[q.group] += q.count
    return dict(size.most_common())


def href(answered_by: str) -> str:
    """The built page's URL for ``answered_by``, relative to the questions' own folder."""
    page, _, frag = answered_by.partition("#")
    parts = Path(page).with_suffix(".html").parts
    if len(parts) != 3 or parts[0] != GALLERY:
        raise MPGuideError(f"{answered_by}: not a page of a chapter of the {GALLERY}/ gallery")
    url = parts[2] if parts[1] == "questions" else f"../{parts[1]}/{parts[2]}"
    return f"{url}#{frag}" if frag else url


@dataclass(frozen=True)
class Collected:
    """The ranked list, as a table: a row per question, its group's size, and its answer."""

    questions: tuple[Question, ...]

    def coverage(self) -> dict[str, int]:
        """How many questions the site answers fully, in part, or not at all."""
        counts = Counter(q.coverage for q in self.questions)
        return {c: counts[c] for c in COVERAGE}

    def table(self) -> Table:
        sizes = group_sizes(self.questions)
        rows = tuple(
            (
                i,
                q.theme,
                q.group,
                sizes[q.group],
                q.count,
                q.asked,
                q.question,
                q.answered_by or "",
                q.coverage,
            )
            for i, q in enumerate(ranked(self.questions), 1)
        )
        cov = self.coverage()
        return Table(
            (
                "rank",
                "theme",
                "group",
                "group threads",
                "threads",
                "asked",
                "question",
                "answered by",
                "coverage",
            ),
            rows,
            f"{len(self.questions)} questions from {sum(q.count for q in self.questions)} "
            f"threads: {cov['full']} answered, {cov['part']} in part, {cov['none']} not yet",
        )

    def __repr__(self) -> str:
        full = self.table()
        keep = ("rank", "group threads", "coverage", "question")
        idx = [full.columns.index(c) for c in keep]
        return Table(
            keep, tuple(tuple(r[i] for i in idx) for r in full.rows), full.caption
        ).to_text()

    def _repr_html_(self) -> str:
        sizes = group_sizes(self.questions)
        rows = []
        for i, q in enumerate(ranked(self.questions), 1):
            threads = " ".join(f'<a href="{escape(u)}">{escape(_short(u))}</a>' for u in q.links)
            answer = (
                f'<a href="{escape(href(q.answered_by))}">{escape(q.coverage)}</a>'
                if q.answered_by
                else "none"
            )
            rows.append(
                f"<tr><td>{i}</td><td>{escape(q.group)} ({sizes[q.group]})</td>"
                f"<td>{escape(q.question)}</td><td>{threads}</td><td>{answer}</td></tr>"
            )
        head = "".join(
            f"<th>{h}</th>" for h in ("#", "confusion (threads)", "question", "asked in", "answer")
        )
        return (
            f'<div class="mpguide-table mpguide-wrapping"><table class="table">'
            f"<caption>{escape(self.table().caption)}</caption>"
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
        )


def _short(url: str) -> str:
    """``pytorch/pytorch#150638`` or ``forums#197299``."""
    m = re.match(r"https://github\.com/([\w.-]+/[\w.-]+)/(?:issues|pull)/(\d+)$", url)
    if m:
        return f"{m[1]}#{m[2]}"
    return f"forums#{url.rsplit('/', 1)[-1]}"


def collected(path: str | Path = DATA) -> Collected:
    """The questions in ``path`` as a :class:`Collected`."""
    return Collected(load(path))

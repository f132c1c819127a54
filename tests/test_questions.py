"""The readers' questions data file and its links to the pages that answer them."""

import json
from pathlib import Path

import pytest
from helpers import ROOT

from mpguide import MPGuideError, questions

COLLECTED = questions.load()


def test_the_data_file_is_package_data_so_an_installed_mpguide_reads_it():
    tomllib = pytest.importorskip("tomllib")
    package = Path(questions.__file__).parent
    assert questions.DATA.is_relative_to(package) and questions.DATA.is_file()
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = setuptools["package-data"]["mpguide"]
    assert any(questions.DATA.relative_to(package).match(g) for g in globs), globs


def test_at_least_sixty_questions_from_2024_to_2026():
    assert len(COLLECTED) >= 60
    assert all("2024-01" <= q.asked <= "2026-12" for q in COLLECTED)
    assert len({q.id for q in COLLECTED}) == len(COLLECTED)


@pytest.mark.parametrize("q", COLLECTED, ids=lambda q: q.id)
def test_entry_is_well_formed(q):
    assert q.theme in questions.THEMES
    assert q.question.strip() and q.group.strip()
    assert q.links and q.count == len(q.links) == len(set(q.links))
    for url in q.links:
        assert questions.LINK.match(url), url
    assert q.coverage in questions.COVERAGE
    if q.coverage != "full":
        assert q.note, "a partial or missing answer says why"


@pytest.mark.parametrize("q", [q for q in COLLECTED if q.answered_by], ids=lambda q: q.id)
def test_answer_points_at_an_existing_section(q):
    page = ROOT / q.page
    assert page.name.startswith("plot_") and page.is_file(), q.page
    assert q.anchor in questions.sections(page), f"{q.answered_by}: no such section"


def test_every_answer_page_of_the_section_answers_a_question():
    pages = sorted(
        p
        for p in (ROOT / "examples" / "questions").glob("plot_*.py")
        if not p.name.startswith("plot_00_")
    )
    answered = {q.answered_by for q in COLLECTED if q.answered_by}
    for page in pages:
        rel = page.relative_to(ROOT).as_posix()
        for anchor in questions.sections(page):
            if anchor not in ("setup", "what-we-saw"):
                assert f"{rel}#{anchor}" in answered, f"{rel}#{anchor} answers no question"


def test_ranking_puts_the_largest_group_first():
    ranked = questions.ranked(COLLECTED)
    sizes = questions.group_sizes(COLLECTED)
    assert [sizes[q.group] for q in ranked] == sorted(
        (sizes[q.group] for q in ranked), reverse=True
    )
    assert ranked[0].group == next(iter(sizes))


@pytest.mark.parametrize(
    ("title", "anchor"),
    [
        (
            "Why does compile give different bf16 numbers than eager?",
            "why-does-compile-give-different-bf16-numbers-than-eager",
        ),
        (
            "allow_tf32 or fp32_precision: which one do I set?",
            "allow-tf32-or-fp32-precision-which-one-do-i-set",
        ),
        (
            "Does compile accept an fp16 @ fp32 matmul that eager rejects?",
            "does-compile-accept-an-fp16-fp32-matmul-that-eager-rejects",
        ),
        ("2. A numbered heading", "a-numbered-heading"),
    ],
)
def test_anchor_is_the_id_sphinx_gives(title, anchor):
    assert questions.anchor(title) == anchor
    from docutils import nodes  # in the test extra: the check runs wherever the tests do

    assert nodes.make_id(title) == anchor


def test_href_is_relative_to_the_questions_folder():
    assert questions.href("examples/questions/plot_01_x.py#a") == "plot_01_x.html#a"
    assert questions.href("examples/compile/plot_02_y.py#b") == "../compile/plot_02_y.html#b"
    with pytest.raises(MPGuideError, match="not a page"):
        questions.href("docs/index.md#c")


def test_bad_file_is_one_error_naming_the_entry(tmp_path):
    path = tmp_path / "q.json"
    entry = {
        "id": "q01",
        "theme": "compile",
        "group": "g",
        "asked": "2025-01",
        "question": "?",
        "links": [],
        "count": 0,
        "answered_by": None,
        "coverage": "full",
    }
    path.write_text(json.dumps({"questions": [entry]}))
    with pytest.raises(MPGuideError, match="question q01: coverage"):
        questions.load(path)
    path.write_text("{")
    with pytest.raises(MPGuideError, match="cannot read questions"):
        questions.load(path)


def test_table_counts_coverage():
    collected = questions.collected()
    table = collected.table()
    assert len(table.rows) == len(COLLECTED)
    assert sum(collected.coverage().values()) == len(COLLECTED)
    assert "<a href=" in collected._repr_html_()

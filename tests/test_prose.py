"""The prose check (docs/prose_facts.py, run on every executed example by docs/prose_check.py).

Every number, dtype and op an example's text blocks state must appear in that page's output or
be a literal of its code, and a sentence with any, every, always, never, all, anything or
everything must name the set it was checked on (the rules, in detail, are prose_facts's docstring). The
docs build applies it to each example it runs and fails (``-W``) on a finding that
``tests/data/prose_unchecked.txt`` does not list (a listed one that is backed now is logged).

Running the 50 examples here would take the docs build's minutes, so these tests execute small
planted pages and check the checker on their real output: a true page passes, a planted false
number, dtype, op or unnamed generalisation is caught. The list of exceptions is checked
against the pages' prose: an entry whose page, token or sentence is gone must be removed, so
the list only shrinks. After a docs build, ``python tests/test_prose.py`` rewrites the list
from the generated pages (docs/auto_examples).
"""

from __future__ import annotations

import contextlib
import io
import runpy
import sys

import pytest
from helpers import ROOT

# pytest puts docs/ on the path (pyproject's pythonpath); ``python tests/test_prose.py`` does not.
sys.path.insert(0, str(ROOT / "docs"))

import prose_facts

LISTED = ROOT / "tests" / "data" / "prose_unchecked.txt"

PAGE = '''"""
A running total in bf16
=======================

We add {step} to a bf16 total a thousand times and print where it stops; in float32 the sum
is exact.
"""

# %%
# The total
# ---------
import torch

total = torch.zeros((), dtype=torch.bfloat16)
for _ in range(1000):
    total += {step}
print(f"bf16 total after 1000 additions of {step}: {{total.item():g}} ({{total.dtype}})")
share = (1000 * {step} - total.item()) / (1000 * {step})
print(f"lost: {{share:.4f}} of the sum")
exact = torch.full((1000,), {step}).sum()
print(f"the same sum in one call: {{exact.item():g}} ({{exact.dtype}})")

# %%
# What we saw
# -----------
# - {claim}
'''


def run_page(tmp_path, claim: str, step: float = 1.0) -> list[prose_facts.Finding]:
    """Write a page stating ``claim``, execute it, and check its prose against its output."""
    path = tmp_path / "plot_planted.py"
    source = PAGE.format(step=step, claim=claim)
    path.write_text(source)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(path), run_name="__main__")
    return prose_facts.check("examples/planted/plot_planted.py", source, out.getvalue())


def tokens(findings) -> list[tuple[str, str]]:
    return [(f.kind, f.token) for f in findings]


def test_a_true_page_passes(tmp_path):
    # bf16 has 8 significant bits: 256 + 1 rounds back to 256, so the total stops there.
    claim = "The bf16 total stops at 256, and 74.4 % of the sum is lost."
    assert run_page(tmp_path, claim) == []


def test_a_planted_false_number_is_caught(tmp_path):
    found = run_page(tmp_path, "The bf16 total stops at 512.")
    assert tokens(found) == [("number", "512")]
    assert found[0].key() == "examples/planted/plot_planted.py: 512: The bf16 total stops at 512."
    assert "examples/planted/plot_planted.py:" in str(found[0])


def test_a_number_is_backed_only_at_the_precision_written(tmp_path):
    # The page prints 0.7440: 74.4 % and 0.744 are it, 74.5 % and 0.75 are not.
    assert tokens(run_page(tmp_path, "About 0.744 of it is lost, 74.4 %.")) == []
    found = run_page(tmp_path, "About 0.75 of it is lost, 74.5 %.")
    assert tokens(found) == [("number", "0.75"), ("number", "74.5 %")]


def test_a_share_is_backed_by_the_bound_the_code_asserts(tmp_path):
    source = PAGE.format(step=1.0, claim="Over 70% of the sum is lost, not 80%.")
    source = source.replace('print(f"lost:', 'assert share > 0.7\nprint(f"lost:')
    found = prose_facts.check("examples/planted/plot_planted.py", source, "lost: 0.7440")
    assert [t for t in tokens(found) if t[0] == "number"] == [("number", "80%")]


def test_a_release_is_backed_by_the_version_printed():
    source = PAGE.format(step=1.0, claim="On torch 2.13 it stops at 256; on 2.12 at 128.")
    found = prose_facts.check("examples/planted/plot_planted.py", source, "torch 2.13.0+cpu: 256")
    assert [t for t in tokens(found) if t[0] == "number"] == [("number", "2.12"), ("number", "128")]


def test_a_number_the_code_sets_is_backed(tmp_path):
    # 1000 is the page's own input (a literal of its code), not a result.
    assert run_page(tmp_path, "After 1000 additions the total is 256.") == []


def test_a_number_in_a_code_comment_backs_nothing():
    source = PAGE.format(step=1.0, claim="It stops at 512.").replace(
        "import torch\n", "import torch  # stops at 512\n# 512 again\n"
    )
    found = prose_facts.check("examples/planted/plot_planted.py", source, "stopped at 256")
    assert ("number", "512") in tokens(found)


def test_another_step_changes_the_output_and_the_finding(tmp_path):
    # With steps of 0.5 the total stops at 128: the same claim is now false.
    found = run_page(tmp_path, "The bf16 total stops at 256.", step=0.5)
    assert tokens(found) == [("number", "256")]


def test_a_dtype_the_output_never_names_is_caught(tmp_path):
    found = run_page(tmp_path, "An fp16 total stops at 256.")
    assert tokens(found) == [("dtype", "fp16")]


def test_an_op_the_page_never_runs_is_caught(tmp_path):
    assert tokens(run_page(tmp_path, "``torch.cumsum`` stops at 256.")) == [("op", "cumsum")]
    assert tokens(run_page(tmp_path, "``torch.zeros`` starts the total.")) == []


@pytest.mark.parametrize(
    ("claim", "caught"),
    [
        ("A bf16 total always stops at 256.", True),
        ("Any running total loses the small steps.", True),
        ("Every total we ran here stops at 256.", False),
        ("On the CPU a bf16 total always stops at 256.", False),
        ("All 1000 additions after the 256th are lost.", False),
        ("It is not a rounding error at all.", False),
    ],
)
def test_a_generalisation_names_its_set(tmp_path, claim, caught):
    assert ("general" in {f.kind for f in run_page(tmp_path, claim)}) == caught


@pytest.mark.parametrize(
    "claim",
    [
        'A reader wrote "the total stops at 512", and it stops at 300.',
        "A reader wrote \u201cthe total stops at 512\u201d, and it stops at 300.",
    ],
)
def test_a_quotation_is_not_the_pages_claim(tmp_path, claim):
    # The quoted 512 is a thread's words; the unquoted 300 in the same sentence is the page's.
    assert tokens(run_page(tmp_path, claim)) == [("number", "300")]


def test_a_quotation_the_splitter_cut_in_two_is_skipped_and_quotes_in_code_are_not_quotes():
    first = 'Asked in a thread ("it drops from 61% to 30% on math.'
    second = 'In fp16 it drops to 54%"), and ``GradScaler("cuda")`` returns 2 in bf16.'
    assert prose_facts.stated(first) == []
    assert prose_facts.stated(second) == [("number", "2"), ("dtype", "bf16")]


@pytest.mark.parametrize(
    ("claim", "numbers"),
    [
        ("Asked in 2025-2026: the bf16 total stops at 256.", []),
        ("Asked in 2025, the bf16 total stops at 256.", []),
        ("The bf16 total stops at 2048.", ["2048"]),
        ("It stops in 2048 additions, 2025-ish.", ["2048", "2025"]),
    ],
)
def test_a_year_that_dates_a_question_is_not_a_number(tmp_path, claim, numbers):
    assert tokens(run_page(tmp_path, claim)) == [("number", n) for n in numbers]


def test_the_prose_is_the_text_blocks_without_headings_links_or_references():
    source = '''"""
Title 3
=======

A 7 in the docstring; see `issue 8 <https://example.com/9>`__ and pytorch#136082.
"""
x = 10  # a code comment with 11 is code
# %%
# Heading 12
# ----------
# A 13 in a text block, ``torch.ones(14)`` in a literal.
#
# .. admonition:: References
#
#    Paper 15, 2022.
'''
    stated = [fact for _, s in prose_facts.sentences(source) for fact in prose_facts.stated(s)]
    assert stated == [("number", "7"), ("number", "8"), ("number", "13"), ("op", "ones")]


def test_output_of_rst_reads_printed_text_and_html_reprs():
    rst = """
Prose with 1 number
-------------------

.. code-block:: Python

    print(2)

.. rst-class:: sphx-glr-script-out

 .. code-block:: none

    printed 3

.. raw:: html

    <div><table><tr><td>4&nbsp;%</td></tr></table></div>

More prose with 5.
"""
    out = prose_facts.output_of_rst(rst)
    assert "printed 3" in out and "4\xa0%" in out
    assert "1" not in out and "2" not in out and "5" not in out


def test_an_unlisted_finding_is_new_and_a_listed_one_backed_now_is_told_apart(tmp_path):
    page = "examples/planted/plot_planted.py"
    found = run_page(tmp_path, "The bf16 total stops at 512.")
    listed = [found[0].key()]
    assert prose_facts.against_list(page, found, listed) == ([], [])
    new, backed = prose_facts.against_list(page, found, [])
    assert len(new) == 1 and "'512'" in new[0] and backed == []
    fixed = run_page(tmp_path, "The bf16 total stops at 256.")
    assert prose_facts.against_list(page, fixed, listed) == ([], listed)
    # Another page's entries are not this page's to judge.
    assert prose_facts.against_list(page, fixed, ["examples/x/plot_y.py: 1: A"]) == ([], [])


def current_facts() -> set[str]:
    """The key each stated fact of the pages would have as a finding: a listed finding must
    still be stated (the check of its backing needs the page's output, in the docs build)."""
    keys = set()
    for path in sorted((ROOT / "examples").glob("*/plot_*.py")):
        page = path.relative_to(ROOT).as_posix()
        for line, sentence in prose_facts.sentences(path.read_text()):
            for kind, token in prose_facts.stated(sentence):
                keys.add(prose_facts.Finding(page, line, kind, token, sentence).key())
    return keys


def test_the_list_of_unchecked_prose_only_shrinks():
    known = prose_facts.listed(LISTED)
    assert known == sorted(set(known)), f"{LISTED.name}: keep it sorted, one line per finding"
    stated = current_facts()
    gone = [k for k in known if k not in stated]
    assert not gone, f"no longer on the page, remove from {LISTED.name}:\n" + "\n".join(gone)


def test_the_docs_build_runs_the_check():
    conf = (ROOT / "conf.py").read_text()
    assert '"prose_check"' in conf, "conf.py's extensions must name docs/prose_check.py"


if __name__ == "__main__":
    pages = sorted((ROOT / "examples").glob("*/plot_*.py"))
    findings = []
    for path in pages:
        rst = ROOT / "docs" / "auto_examples" / path.parent.name / f"{path.stem}.rst"
        if not rst.exists():
            sys.exit(f"{rst.relative_to(ROOT)} is missing: build the docs first (nox -s docs)")
        output = prose_facts.output_of_rst(rst.read_text())
        findings += prose_facts.check(path.relative_to(ROOT).as_posix(), path.read_text(), output)
    keys = sorted({f.key() for f in findings})
    LISTED.write_text("".join(f"{k}\n" for k in keys))
    print(f"{len(keys)} findings listed in {LISTED.relative_to(ROOT)}", file=sys.stderr)

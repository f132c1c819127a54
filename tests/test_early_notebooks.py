"""docs/early_notebooks.py: how many notebook pages run at once beside the gallery."""

import importlib
import importlib.util
import logging
import sys
import types
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture
def early_notebooks(monkeypatch):
    """The extension module, imported with stand-ins for the two Sphinx helpers it imports
    (the tests session has no Sphinx)."""
    if importlib.util.find_spec("sphinx") is None:
        util = types.ModuleType("sphinx.util")
        util.logging = types.SimpleNamespace(getLogger=logging.getLogger)
        util.matching = types.SimpleNamespace(Matcher=object)
        for name, module in {
            "sphinx": types.ModuleType("sphinx"),
            "sphinx.util": util,
            "sphinx.util.logging": util.logging,
            "sphinx.util.matching": util.matching,
        }.items():
            monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.syspath_prepend(str(DOCS))
    monkeypatch.delitem(sys.modules, "early_notebooks", raising=False)
    return importlib.import_module("early_notebooks")


@pytest.mark.parametrize(
    ("jobs", "pages", "expected"),
    [
        ("16", 4, 4),  # the lent GPU machine: every page at once
        ("2", 4, 2),  # the project's CPU machine: two, as before
        ("1", 4, 2),  # a serial gallery still has two pages beside it
        ("64", 4, 4),  # never more than the pages
        ("16", 1, 1),
        ("16", 0, 1),  # a thread pool needs one worker
    ],
)
def test_a_quarter_of_the_gallery_cores_at_least_two(
    early_notebooks, monkeypatch, jobs, pages, expected
):
    monkeypatch.setenv("MPGUIDE_DOCS_JOBS", jobs)
    assert early_notebooks.workers(pages) == expected


def test_without_the_variable_the_machine_cores_count(early_notebooks, monkeypatch):
    monkeypatch.delenv("MPGUIDE_DOCS_JOBS", raising=False)
    monkeypatch.setattr(early_notebooks.os, "cpu_count", lambda: 32)
    assert early_notebooks.workers(10) == 8

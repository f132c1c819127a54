"""Check the prose of every example the build ran against what it printed (``prose_facts``).

Connected after sphinx-gallery has run the examples: for each example this build executed (the
examples ``filename_pattern`` selects; an unchanged one keeps its last run's output), the
numbers, dtypes and ops its text blocks state are looked up in the output captured in its
generated ``.rst`` and in its code. A finding that ``tests/data/prose_unchecked.txt`` does not
list is a warning naming the page, line, token and sentence, so the ``-W`` build fails. A
listed finding of an executed page that is backed now is logged, not warned about: a page whose
output varies between runs (a thread's count of events) may back a listed number in one build
and not the next; ``python tests/test_prose.py`` rewrites the list from a build, and the tests
keep it from growing.

The list is the CPU build's (CI's): on a GPU the examples take their CUDA paths and print
other things, so there the findings are logged, not warned about, and the log says why.
"""

from __future__ import annotations

import re
from pathlib import Path

import prose_facts
from sphinx.util import logging

from mpguide.core import device

logger = logging.getLogger(__name__)
LISTED = Path(__file__).resolve().parents[1] / "tests" / "data" / "prose_unchecked.txt"


def executed_pages(app) -> list[tuple[Path, Path]]:
    """``(example, generated rst)`` for each example this build ran or kept from a run."""
    conf = app.config.sphinx_gallery_conf
    if str(conf.get("plot_gallery", True)).lower() == "false":
        return []
    src_dirs, out_dirs = conf["examples_dirs"], conf["gallery_dirs"]
    if isinstance(src_dirs, str):
        src_dirs, out_dirs = [src_dirs], [out_dirs]
    root = Path(app.srcdir)
    pages = []
    for src_dir, out_dir in zip(src_dirs, out_dirs, strict=True):
        for example in sorted((root / src_dir).rglob("*.py")):
            rst = root / out_dir / example.relative_to(root / src_dir).with_suffix(".rst")
            if re.search(conf["filename_pattern"], str(example)) and rst.exists():
                pages.append((example, rst))
    return pages


def check_pages(app) -> None:
    """``builder-inited``, after sphinx-gallery: warn about each unlisted finding; log each
    listed one that is backed now."""
    known = prose_facts.listed(LISTED)
    root = Path(app.srcdir)
    dev = device.pick()
    enforced = dev.type == "cpu"
    report = logger.warning if enforced else logger.info
    if not enforced:
        logger.info(
            f"prose check: the examples ran on {dev.type}, and {LISTED.name} lists the CPU "
            "build's findings: this build's are logged, not warned about"
        )
    for example, rst in executed_pages(app):
        page = example.relative_to(root).as_posix()
        output = prose_facts.output_of_rst(rst.read_text())
        found = prose_facts.check(page, example.read_text(), output)
        new, backed = prose_facts.against_list(page, found, known)
        for message in new:
            report(f"prose not backed by the page's output: {message}")
        for key in backed:
            logger.info(f"prose backed now, remove from {LISTED.name}: {key}")


def setup(app):
    # After sphinx-gallery's generate_gallery_rst (default priority 500) has run the examples.
    app.connect("builder-inited", check_pages, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

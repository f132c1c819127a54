"""Execute the site's notebook pages (myst-nb) while sphinx-gallery runs the examples.

Sphinx runs the gallery when the build starts and myst-nb executes a page when it reads it,
later: one after the other, each leaving a core idle much of the time. This extension starts
the pages in threads when the configuration is read, before the gallery, and stores their
results in jupyter-cache (``nb_execution_mode = "cache"``) before Sphinx reads the pages;
myst-nb then takes them from there. Started are the pages the cache does not hold yet, and
the pages that set ``execution_mode: force`` (their results depend on more than their code)
and that Sphinx will read again (no doctree, or one older than the page): such a page is
read as a ``cache`` page in this build only, so it shows what ran in this build. A page that
fails is not stored: myst-nb executes it again when it reads it and reports the error.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sphinx.util import logging
from sphinx.util.matching import Matcher

logger = logging.getLogger(__name__)


def workers(pages: int) -> int:
    """How many of ``pages`` to execute at once, beside the gallery's workers: a quarter of the
    cores, counted as the gallery counts them (``MPGUIDE_DOCS_JOBS`` when set, as on a GPU
    build, else the machine's), but at least two, and no more than there are pages."""
    cores = int(os.environ.get("MPGUIDE_DOCS_JOBS") or os.cpu_count() or 1)
    return max(1, min(pages, max(2, cores // 4)))


def _pages(app) -> list[Path]:
    """The myst notebook pages of the project, largest first (the longest to run, roughly)."""
    from myst_nb.core.read import is_myst_markdown_notebook

    excluded = Matcher(app.config.exclude_patterns)
    root = Path(app.srcdir)
    pages = [
        path
        for path in (root / "docs").rglob("*.md")
        if not excluded(path.relative_to(root).as_posix())
        and is_myst_markdown_notebook(path.read_text(encoding="utf-8"))
    ]
    return sorted(pages, key=lambda p: p.stat().st_size, reverse=True)


def _read(app, path: Path):
    """The notebook myst-nb reads from ``path``, as it reads it (the cache matches on it)."""
    from myst_nb.core.config import NbParserConfig
    from myst_nb.core.read import create_nb_reader
    from myst_parser.config.main import MdParserConfig

    md = MdParserConfig(
        **{
            name: app.config[f"myst_{name}"]
            for name, _, field in MdParserConfig().as_triple()
            if "sphinx" not in field.metadata.get("omit", [])
        }
    )
    text = path.read_text(encoding="utf-8")
    reader = create_nb_reader(str(path), md, NbParserConfig(), text)
    return reader.read(text), reader.read_fmt


def _execute(app, path: Path):
    from jupyter_cache.executors.utils import single_nb_execution

    notebook, read_fmt = _read(app, path)
    result = single_nb_execution(
        notebook,
        cwd=str(path.parent),
        allow_errors=app.config.nb_execution_allow_errors,
        timeout=app.config.nb_execution_timeout,
        meta_override=True,
    )
    return notebook, read_fmt, result


def start(app, config) -> None:
    """``config-inited``: start the pages missing from the cache, before the gallery runs."""
    app._early_notebooks, app._early_executed = {}, set()
    if config.nb_execution_mode != "cache" or config.nb_execution_in_temp:
        return
    from jupyter_cache import get_cache

    cache = get_cache(config.nb_execution_cache_path)
    todo = []
    for path in _pages(app):
        notebook = _read(app, path)[0]
        mode = notebook.metadata.get("mystnb", {}).get("execution_mode", "cache")
        if mode == "force" and _read_again(app, path):
            todo.append(path)
        elif mode == "cache":
            try:
                cache.match_cache_notebook(notebook)
            except KeyError:
                todo.append(path)
    if not todo:
        return
    at_once = workers(len(todo))
    logger.info(f"executing {len(todo)} notebook pages beside the gallery, {at_once} at once")
    pool = ThreadPoolExecutor(at_once, thread_name_prefix="early-notebook")
    app._early_notebooks = {path: pool.submit(_execute, app, path) for path in todo}
    pool.shutdown(wait=False)


def store(app, env, docnames) -> None:
    """``env-before-read-docs``: wait for the pages and store those that ran in the cache."""
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    started = time.perf_counter()
    cache = get_cache(app.config.nb_execution_cache_path)
    for path, future in app._early_notebooks.items():
        notebook, read_fmt, result = future.result()
        if result.err is not None:
            continue  # myst-nb runs it again and reports the error
        record = cache.add_nb_to_project(str(path), read_data=read_fmt)
        bundle = CacheBundleIn(notebook, record.uri, data={"execution_seconds": result.time})
        cache.cache_notebook_bundle(bundle, check_validity=False, overwrite=True)
        app._early_executed.add(path)
        logger.info(f"{path.name}: executed beside the gallery in {result.time:.1f} s")
    if app._early_notebooks:
        waited = time.perf_counter() - started
        logger.info(f"waited {waited:.1f} s for the notebook pages after the gallery")
    app._early_notebooks = {}


def _read_again(app, path: Path) -> bool:
    """Whether Sphinx reads ``path`` again in this build, as far as files tell."""
    doctree = Path(app.doctreedir, path.relative_to(app.srcdir).with_suffix(".doctree"))
    return not doctree.exists() or doctree.stat().st_mtime < path.stat().st_mtime


def cached_this_build(app, docname, source) -> None:
    """``source-read``: a ``force`` page executed beside the gallery takes its outputs from
    the cache, where this build just stored them."""
    if Path(app.env.doc2path(docname)) in app._early_executed:
        head, sep, rest = source[0].partition("\n---")
        source[0] = head.replace("execution_mode: force", "execution_mode: cache") + sep + rest


def setup(app):
    app.connect("config-inited", start)
    app.connect("env-before-read-docs", store)
    app.connect("source-read", cached_this_build)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

"""The API reference, one page per folder of the mpguide package, made from the package tree.

When the build starts, every package (a folder with ``__init__.py``) gets a page
``docs/api/<package>.rst`` holding its docstring and an ``automodule`` for each module in the
folder, found on disk: a module added, split or moved shows up without an edit here. The
pages are build outputs (``docs/api/`` is ignored by git), rewritten only when they change.

Each documented function and class ends with the examples that use it: sphinx-gallery
records, per object, the examples naming it (``backreferences_dir``); a name an example
imports from elsewhere (a package re-exporting it) is matched to the object it resolves to.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from functools import cache
from pathlib import Path

PACKAGE = "mpguide"
PAGES = Path("docs", "api")
SKIP = {"__main__"}


def packages(root: Path) -> dict[str, list[str]]:
    """Each package under ``root``'s ``PACKAGE`` folder, with the modules (not packages) of
    its folder, sorted."""
    found: dict[str, list[str]] = {}
    for init in sorted((root / PACKAGE).rglob("__init__.py")):
        folder = init.parent
        name = ".".join(folder.relative_to(root).parts)
        found[name] = [
            f"{name}.{m.name}"
            for m in pkgutil.iter_modules([str(folder)])
            if not m.ispkg and m.name not in SKIP
        ]
    return found


def _heading(text: str, underline: str) -> list[str]:
    return [text, underline * len(text), ""]


def page(package: str, modules: list[str]) -> str:
    """The reStructuredText of one folder's page."""
    lines = [".. Written by docs/api_pages.py from the package tree: edits are lost.", ""]
    lines += _heading(package, "=")
    # Each page shows what a module defines; what a module re-exports (its __all__: a
    # package's __init__, or a module split by job) is shown once, under the module defining it.
    lines += [f".. automodule:: {package}", "   :ignore-module-all:", ""]
    for module in modules:
        lines += _heading(module, "-")
        lines += [f".. automodule:: {module}", "   :ignore-module-all:", ""]
    return "\n".join(lines)


def write_pages(app) -> None:
    """Write the folders' pages (at ``builder-inited``); drop the pages of folders gone."""
    root = Path(app.srcdir)
    out = root / PAGES
    out.mkdir(parents=True, exist_ok=True)
    wanted = {f"{name}.rst": page(name, modules) for name, modules in packages(root).items()}
    for old in out.glob("*.rst"):
        if old.name not in wanted:
            old.unlink()
    for name, text in wanted.items():
        path = out / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


@cache
def _used_in_examples(backrefs: Path) -> dict[tuple[str, str], tuple[str, ...]]:
    """The names examples use (sphinx-gallery's ``backreferences_all.json``), by the object
    each resolves to: (``__module__``, ``__qualname__``)."""
    index = backrefs / "backreferences_all.json"
    used = json.loads(index.read_text()) if index.exists() else {}
    found: dict[tuple[str, str], list[str]] = {}
    for name, examples in sorted(used.items()):
        key = _key(_resolve(name)) if examples and name.startswith(f"{PACKAGE}.") else None
        if key is not None:
            found.setdefault(key, []).append(name)
    return {key: tuple(names) for key, names in found.items()}


def _resolve(name: str):
    """The object a dotted name names, or None."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
        return obj
    return None


def _key(obj) -> tuple[str, str] | None:
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str)):
        return None
    return module, qualname


def add_examples(app, what, name, obj, options, lines) -> None:
    """``autodoc-process-docstring``: end a function's or class's text with the examples
    using it."""
    if what not in ("function", "class"):
        return
    backrefs = Path(app.srcdir) / app.config.sphinx_gallery_conf["backreferences_dir"]
    names = _used_in_examples(backrefs).get(_key(obj))
    if names:
        short = name.rsplit(".", 1)[-1]
        lines += ["", f".. rubric:: Examples using ``{short}``", ""]
        lines += [f".. minigallery:: {' '.join(names)}", ""]


def setup(app):
    app.connect("builder-inited", write_pages)
    app.connect("autodoc-process-docstring", add_examples)
    return {"parallel_read_safe": True, "parallel_write_safe": True}

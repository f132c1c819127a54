"""Sphinx configuration of the mpguide site (the source root is the repository root)."""

import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs"))
# Compiled examples reuse inductor's cache across builds; it lives with the build's outputs.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / "build" / "inductor_cache"))
# Pages show the GPU recordings of docs/recorded/ beside their live results.
os.environ.setdefault("MPGUIDE_RECORDED", str(ROOT / "docs" / "recorded"))

_needed = {
    "sphinx_gallery": "sphinx-gallery",
    "myst_nb": "myst-nb",
    "pydata_sphinx_theme": "pydata-sphinx-theme",
    "sphinx_copybutton": "sphinx-copybutton",
    "sphinx_design": "sphinx-design",
    "torch": "torch",
    "matplotlib": "matplotlib",
}
_missing = [pkg for mod, pkg in _needed.items() if importlib.util.find_spec(mod) is None]
if _missing:
    raise RuntimeError(
        f"the docs need {', '.join(_missing)}: install them, or build with `nox -s docs`"
    )

import torch

import mpguide
from mpguide.core import device, record, versions

_machine = device.describe()

project = "mpguide"
author = "the mpguide maintainers"
copyright = "the mpguide maintainers"
release = mpguide.__version__
root_doc = "docs/index"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.extlinks",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
    "sphinx_design",
    "sphinx_gallery.gen_gallery",
    "myst_nb",
    # One page per folder of the package, made from the package tree (docs/api/).
    "api_pages",
    # The notebook pages (docs/*.md) execute while the gallery runs, not after it.
    "early_notebooks",
    # Each executed example's prose against its output (docs/prose_check.py).
    "prose_check",
    # Each example's GPU output (docs/recorded/gallery/), in tabs beside the live output.
    "gallery_recordings",
]

exclude_patterns = [
    "README.md",
    "build",
    "_build",
    ".nox",
    ".venv",
    "venv",
    "tests",
    "mpguide",
    ".ci",
    ".github",
    "examples",
    "**/.ipynb_checkpoints",
    ".pytest_cache",
    ".hypothesis",
    # sphinx-gallery's outputs: the notebooks are downloads, not pages for myst-nb.
    "docs/auto_examples/**/*.ipynb",
    "docs/auto_examples/**/*.md",
    "docs/auto_examples/*.md",
    "docs/_extra",
]

# myst / myst-nb
myst_enable_extensions = ["colon_fence", "deflist", "substitution"]
myst_heading_anchors = 3
myst_substitutions = {
    "torch_version": torch.__version__,
    "build_device": _machine.caption(),
    "torch_oldest": versions.WINDOW[0],
    "torch_newest": versions.WINDOW[1],
}
nb_execution_mode = "cache"
nb_execution_cache_path = str(ROOT / "build" / "jupyter_cache")
nb_execution_raise_on_error = True
nb_execution_timeout = 300
nb_merge_streams = True

# sphinx-gallery
CHAPTERS = [
    "autocast",
    "profiler",
    "compile",
    "autograd",
    "numerics",
    "inference",
    "training",
    "model",
    "lowbit",
    # Readers' questions, answered as asked: after the chapters their answers link to.
    "questions",
]
sphinx_gallery_conf = {
    "examples_dirs": "examples",
    "gallery_dirs": "docs/auto_examples",
    "subsection_order": [f"examples/{c}" for c in CHAPTERS],
    "within_subsection_order": "FileNameSortKey",
    "filename_pattern": r"/plot_",
    "reset_modules": ("matplotlib", "sphinx_helpers.reset_torch_state"),
    "reset_modules_order": "both",
    # A GPU build (docs/gpu_site.sh) runs every example, a failing one included, and reports
    # them all at the end: MPGUIDE_GALLERY_KEEP_GOING=1.
    "abort_on_example_error": os.environ.get("MPGUIDE_GALLERY_KEEP_GOING") != "1",
    "only_warn_on_example_error": False,
    "remove_config_comments": True,
    "download_all_examples": False,
    "show_memory": False,
    "min_reported_time": 1,
    "capture_repr": ("_repr_html_", "__repr__"),
    "matplotlib_animations": False,
    "image_scrapers": ("sphinx_helpers.figures",),
    "write_computation_times": True,
    # Which examples use each function and class of mpguide: the API pages list them.
    "doc_module": ("mpguide",),
    "backreferences_dir": "docs/_generated/backreferences",
    # A chapter's examples run in parallel, one worker per core (at most four; a GPU build
    # sets MPGUIDE_DOCS_JOBS to its cores); MPGUIDE_DOCS_JOBS=1 runs them one after another
    # in this process.
    "parallel": int(os.environ.get("MPGUIDE_DOCS_JOBS", min(os.cpu_count() or 1, 4))),
}

# Links to the PyTorch docs are plain URLs, so an offline build neither fails nor warns.
# Online builds may add intersphinx for Python, NumPy and PyTorch names in docstrings.
extlinks = {
    "torchdoc": ("https://docs.pytorch.org/docs/stable/%s", "%s"),
    "torchapi": ("https://docs.pytorch.org/docs/stable/generated/%s.html", "%s"),
}
if os.environ.get("MPGUIDE_INTERSPHINX") == "1":
    extensions.append("sphinx.ext.intersphinx")
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "numpy": ("https://numpy.org/doc/stable", None),
        "torch": ("https://docs.pytorch.org/docs/stable", None),
    }

# autodoc
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False}
napoleon_google_docstring = True

# HTML
html_theme = "pydata_sphinx_theme"
html_title = "mpguide"
templates_path = ["docs/_templates"]
html_static_path = ["docs/_static"]
html_extra_path = ["docs/_extra"]
html_css_files = ["mpguide.css"]
# The pages outside the guide have no section navigation: their content takes its width.
html_sidebars = {
    f"docs/{page}": []
    for page in ("install", "cli", "api", "benchmarks", "contributing", "publishing")
}
# An example page's tables and trees need the width: its "on this page" list moves from the
# right-hand sidebar (see html_theme_options) into the left one, under the chapters.
EXAMPLE_PAGES = "docs/auto_examples/*/plot_*"
html_sidebars[EXAMPLE_PAGES] = ["sidebar-nav-bs", "page-toc"]
html_sidebars["docs/api/*"] = []
html_theme_options = {
    "navigation_depth": 2,
    "header_links_before_dropdown": 5,
    "show_toc_level": 2,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
    # What every page was computed on, stated once by the theme (docs/_templates).
    "article_header_end": ["mpguide-provenance"],
    # Only the reference pages keep the right-hand sidebar (a page matching no pattern has
    # none): the landing page's cards and the example pages take its width.
    "secondary_sidebar_items": {"docs/*": ["page-toc", "sourcelink"], "docs/index": []},
}
html_context = {
    "default_mode": "light",
    "mpguide_build": _machine.caption(),
    "mpguide_simulated": ", ".join(t for t in device.simulated_types() if t != device.pick().type),
    "mpguide_recorded": ", ".join(r.provenance.name for r in record.recordings())
    or "none in this build",
}
html_show_sourcelink = False
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True

nitpicky = False
suppress_warnings: list[str] = []

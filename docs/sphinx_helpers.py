"""Callables that conf.py names by string, so the Sphinx configuration stays picklable."""

import contextlib
import warnings

from mpguide.core import quiet, state

# Taken when Sphinx imports this module, before any example has run.
_PRISTINE = state.snapshot()
_FILTERS = list(warnings.filters)
_EXAMPLE = contextlib.ExitStack()


def reset_torch_state(gallery_conf, fname, when=None):
    """Run before and after every example: switches, dynamo, autocast cache and seeds reset.

    A Python warning raised inside an example is an error, as in the tests: the example stops
    and the build fails, instead of a warning scrolling past in the build log."""
    state.reset(_PRISTINE)
    _EXAMPLE.close()

    import matplotlib.pyplot as plt

    plt.close("all")
    warnings.filters[:] = _FILTERS
    if when == "before":
        warnings.simplefilter("error")
        # Raised by torch's own import of inductor (torch.utils.mkldnn), not by an example.
        warnings.filterwarnings(
            "ignore", r"`torch\.jit\.script_method` is deprecated", DeprecationWarning
        )
        # torchao, which transformers imports when a page builds its model, logs lines that
        # sphinx-gallery would put in the page's output.
        _EXAMPLE.enter_context(quiet.library_imports())


def figures(block, block_vars, gallery_conf):
    """sphinx-gallery's matplotlib scraper, each cell's figures in a ``mpguide-figure`` box.

    The box lets the stylesheet keep a figure at its drawn size on a narrow screen (it scrolls
    sideways there, so its labels stay legible) and follow the dark theme."""
    import textwrap

    from sphinx_gallery.scrapers import matplotlib_scraper

    rst = matplotlib_scraper(block, block_vars, gallery_conf)
    if not rst.strip():
        return rst
    return f"\n\n.. container:: mpguide-figure\n\n{textwrap.indent(rst.strip(), '   ')}\n\n"

"""Callables that conf.py names by string, so the Sphinx configuration stays picklable."""

from mpguide import state

# Taken when Sphinx imports this module, before any example has run.
_PRISTINE = state.snapshot()


def reset_torch_state(gallery_conf, fname, when=None):
    """Run before and after every example: switches, dynamo, autocast cache and seeds reset."""
    state.reset(_PRISTINE)

    import matplotlib.pyplot as plt

    plt.close("all")

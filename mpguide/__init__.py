"""mpguide: measure what PyTorch does with dtypes in mixed precision."""

__version__ = "0.1.0"


class MPGuideError(ValueError):
    """Bad input from a reader: the message names the problem in one line."""

"""mpguide: measure what PyTorch does with dtypes in mixed precision."""

__version__ = "0.1.0"


class MPGuideError(ValueError):
    """Bad input from a reader: the message names the problem in one line."""


def error_line(err: BaseException) -> str:
    """An exception as one line: its type and the first non-empty line of its message."""
    text = [line for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {text[0] if text else ''}"

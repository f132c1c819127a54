import signal
import subprocess

import pytest


def pytest_collection_modifyitems(config, items):
    # torch is imported here, where tests are collected: xdist's controller never needs it.
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def terminal_of_100_columns(monkeypatch):
    """Text output fits COLUMNS: every test sees the default width, whatever terminal ran
    pytest (xdist's workers get the controller's COLUMNS)."""
    monkeypatch.setenv("COLUMNS", "100")


@pytest.fixture
def mpguide_main(capsys, monkeypatch):
    """Run ``python -m mpguide ARGS`` in this process, from ``cwd`` (its folder first on
    ``sys.path``, as for a process), and capture its output as ``helpers.mpguide_process`` does."""
    from mpguide.cli import main

    def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
        if cwd is not None:
            monkeypatch.chdir(cwd)
            monkeypatch.syspath_prepend(str(cwd))
        status = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), status, out, err)

    return run


@pytest.fixture
def ctrl_c_heard():
    """Children that hear Ctrl-C, even when this run was started in the background by a
    shell (which ignores SIGINT, and ignored signals are inherited through exec)."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

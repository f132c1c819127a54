"""The docs' forked command line (docs/forked_cli.py) prints what ``python -m mpguide`` prints."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ROOT, mpguide_process

sys.path.insert(0, str(ROOT / "docs"))

import forked_cli

# Each test starts interpreters (the server, python -m mpguide) that import torch.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not hasattr(os, "fork"), reason="forks")]


@pytest.fixture(autouse=True)
def server(monkeypatch):
    """A server started by the test, in its environment (pytest names the running test in
    ``PYTEST_CURRENT_TEST``: a server of an earlier test would hand every command to a plain
    subprocess), ended after it."""
    monkeypatch.setattr(forked_cli, "_server", None)
    yield
    if forked_cli._server is not None:
        forked_cli._server.close()


MINE = """import torch


def double(x):
    return x * 2
"""


@pytest.mark.parametrize(
    ("args", "columns"),
    [
        (("--help",), None),
        (("formats",), 60),
        (("policy", "--device", "tpu"), 100),
        (("graph", "mine.py:double", "--inputs", "f32[4]"), 100),
        (("graph", "mine.py:nope", "--inputs", "f32[4]"), None),
        (("model", "mine"), 80),
    ],
)
def test_prints_what_python_m_prints(tmp_path, monkeypatch, args, columns):
    (tmp_path / "mine.py").write_text(MINE)
    forked_cli.run("--help")  # the server starts in another folder than the reader's
    monkeypatch.chdir(tmp_path)  # the reader's folder: mine.py is found there
    forked = forked_cli.run(*args, columns=columns)
    if columns is not None:
        monkeypatch.setenv("COLUMNS", str(columns))
    plain = mpguide_process(*args)
    assert forked_cli._server is not None and forked_cli._server.quiet  # it ran forked
    assert forked_cli._server.takes(dict(os.environ))
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        plain.returncode,
        plain.stdout,
        plain.stderr,
    )
    assert forked.stdout or forked.stderr


def test_another_environment_runs_as_a_subprocess(monkeypatch):
    forked_cli.run("--help")  # the server started
    monkeypatch.setenv("MPGUIDE_FORKED_TEST", "1")
    assert not forked_cli._server.takes(dict(os.environ))
    assert forked_cli._server.takes({**forked_cli._server.env, "COLUMNS": "40"})
    assert forked_cli.run("--help").stdout == mpguide_process("--help").stdout


def test_check_raises_on_an_error_status(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(subprocess.CalledProcessError) as caught:
        forked_cli.run("policy", "--device", "tpu", check=True)
    assert caught.value.returncode == 2

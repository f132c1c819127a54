"""Sessions: ``nox -s tests`` (default), ``nox -s docs``, ``nox -s lint``, ``nox -s screenshots``,
``nox -s record``, ``nox -s bench``.

Arguments after ``--`` pass through to the tool: ``nox -s tests -- -k policy``,
``nox -s docs -- -D sphinx_gallery_conf.filename_pattern=plot_01``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nox

ROOT = Path(__file__).parent
BUILD = ROOT / "build"

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

RUFF = "ruff==0.17.6"


def _install(session: nox.Session, *extras: str) -> None:
    """Install mpguide with ``extras``, reusing the torch of the Python running nox if it has one.

    A GPU runner's CUDA build of torch is linked into the session through a ``.pth`` file; a
    fresh machine gets the CPU build pinned by pyproject's ``pinned`` extra, never an unpinned
    torch and its CUDA packages.
    """
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        site = Path(next(iter(spec.submodule_search_locations))).parent
        purelib = session.run(
            "python",
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            silent=True,
        ).strip()
        Path(purelib, "_mpguide_host_torch.pth").write_text(f"{site}\n")
        session.log(f"using the torch already installed in {site}")
    else:
        extras = ("pinned", *extras)
    spec_extras = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", spec_extras)


@nox.session(default=True)
def tests(session: nox.Session) -> None:
    """Run the test suite, one worker per core (at most four); ``-- -n 0`` runs it in this
    process."""
    _install(session, "test")
    workers = ("-n", "auto", "--maxprocesses", "4", "--dist", "worksteal")
    session.run("python", "-m", "pytest", *workers, *session.posargs)


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """Build the HTML site into build/html; with ``-- serve`` rebuild and reload on change."""
    _install(session, "docs")
    args = list(session.posargs)
    out = BUILD / "html"
    env = {"MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"}
    if args[:1] == ["serve"]:
        session.install("sphinx-autobuild")
        session.run(
            "python",
            "-m",
            "sphinx_autobuild",
            "-j",
            "1",
            ".",
            str(out),
            "--watch",
            "mpguide",
            "--ignore",
            "docs/auto_examples",
            "--ignore",
            "build",
            *args[1:],
            env=env,
        )
        return
    session.run(
        "python",
        "-m",
        "sphinx",
        "-b",
        "html",
        "-W",
        "--keep-going",
        "-d",
        str(BUILD / "doctrees"),
        ".",
        str(out),
        *args,
        env=env,
    )
    session.log(f"the site is at {out / 'index.html'}")


@nox.session(default=False)
def screenshots(session: nox.Session) -> None:
    """Build the site and screenshot every page in headless Chromium; fail where a page is
    wider than its column.

    Screenshots go to build/screenshots/ at 1400 and 390 px, and in the dark theme at 1400 px
    (needs Debian's ``chromium``)."""
    docs(session)
    session.install("playwright")
    shots = BUILD / "screenshots"
    session.run("python", "docs/screenshots.py", str(BUILD / "html"), str(shots), "--dark")


@nox.session(default=False)
def lint(session: nox.Session) -> None:
    """Check style with ruff, at the one version pinned here (rules differ between releases)."""
    session.install(RUFF)
    session.run("python", "-m", "ruff", "check", ".", *session.posargs)
    session.run(
        "python", "-m", "ruff", "format", "--check", "--diff", "mpguide", "tests", *session.posargs
    )


@nox.session(default=False)
def record(session: nox.Session) -> None:
    """Record the site's GPU measurements into docs/recorded/ (``-- --allow-cpu`` on a CPU)."""
    _install(session)
    out = ROOT / "docs" / "recorded"
    session.run("python", "docs/site_recordings.py", "--out", str(out), *session.posargs)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Time ``python -m mpguide casts`` and ``tree`` on large synthetic traces beside the parse
    limit (a typed msgspec decode of the same file), and profile casts phase by phase; the
    results go to docs/benchmarks/trace_casts.json for the site (``-- --help`` for options).
    Then time the per-module report of ``python -m mpguide model`` on a 12-layer transformer
    beside a float32 forward and backward plus a float64 forward, into
    docs/benchmarks/model_report.json; and check the kernel times of the real GPU traces in
    tests/data/gpu against HolisticTraceAnalysis's kernel breakdown, into
    docs/benchmarks/hta_kernels.json."""
    _install(session)
    session.run("python", "benchmarks/trace_casts.py", *session.posargs)
    session.run("python", "benchmarks/model_report.py")
    session.install("HolisticTraceAnalysis")
    session.run("python", "benchmarks/hta_kernels.py")

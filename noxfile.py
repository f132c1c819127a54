"""Sessions: ``nox -s tests`` (default), ``nox -s docs``, ``nox -s lint``, ``nox -s screenshots``,
``nox -s record``, ``nox -s bench``, ``nox -s versions``, ``nox -s compat``.

Arguments after ``--`` pass through to the tool: ``nox -s tests -- -k policy``,
``nox -s docs -- -D sphinx_gallery_conf.filename_pattern=plot_01``.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
BUILD = ROOT / "build"

nox.options.default_venv_backend = "uv|venv"  # uv where nox finds it: seconds, not minutes
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

RUFF = "ruff==0.17.6"
BYTECODE = {"PYTHONDONTWRITEBYTECODE": ""}
"""Modules compiled once and kept, as Python does by default, where the machine's environment
turns that off: the package, and the test modules pytest rewrites, are not compiled again by
every process of every run (the quick test loop: 43-44 s -> 38-39 s on two cores)."""
RELEASES = ("2.11.0", "2.12.*", "2.13.0", "2.14.1")
"""The torch releases of the supported window (``mpguide.core.versions.WINDOW``), oldest first:
``nox -s versions`` records each, ``nox -s compat`` tests the first and the last."""


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
    env = _uv_settings() if session.venv_backend == "uv" else {}
    session.install("-e", spec_extras, env=env)


def _uv_settings() -> dict[str, str]:
    """uv's settings to install as this machine's pip does: bytecode compiled at install, and
    the wheel folders and constraint files pip is configured with (its config files and
    ``PIP_*`` variables, which uv reads neither of): where pip finds torch's CPU build in a
    local folder, uv must look there too."""
    try:
        listed = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    found = {}
    for line in listed.splitlines():  # "global.find-links='/opt/wheels'", later lines win
        key, _, value = line.partition("=")
        found[key.rpartition(".")[2]] = value.strip().strip("'\"")
    # Compiled at install as pip does: a module compiled at import warns where its source has
    # an invalid escape (torchao's quant_api.py), an error where warnings are errors.
    env = {"UV_COMPILE_BYTECODE": "1"}
    if found.get("find-links"):
        env["UV_FIND_LINKS"] = ",".join(found["find-links"].split())
    if found.get("constraint"):
        env["UV_CONSTRAINT"] = found["constraint"]
    return env


@nox.session(default=True)
def tests(session: nox.Session) -> None:
    """Run the test suite, one worker per core (at most four); ``-- -n 0`` runs it in this
    process."""
    _install(session, "test")
    workers = ("-n", "auto", "--maxprocesses", "4", "--dist", "worksteal")
    session.run("python", "-m", "pytest", *workers, *session.posargs, env=BYTECODE)


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """Build the HTML site into build/html; with ``-- serve`` rebuild and reload on change.

    A whole build (no arguments) ends with the CPU rehearsal of the GPU run's harvest
    (docs/gpu_site.sh): every example's output and seconds into build/gallery_rehearsal/,
    failing unless every example passed, and each chapter's slowest example."""
    _install(session, "docs")
    args = list(session.posargs)
    out = BUILD / "html"
    # Simulated autocast policies, asked for by several pages, are computed once per build.
    env = {"MPLBACKEND": "Agg", "PYTHONHASHSEED": "0", "MPGUIDE_CACHE": str(BUILD / "cache")}
    env |= BYTECODE
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
        # Pages are read and written by one process per core; the examples and the notebook
        # pages run before that (conf.py: sphinx-gallery's workers and docs/early_notebooks.py).
        "-j",
        "auto",
        "-d",
        str(BUILD / "doctrees"),
        ".",
        str(out),
        *args,
        env=env,
    )
    session.log(f"the site is at {out / 'index.html'}")
    if not args:  # every example ran: rehearse the GPU build's harvest on them (gpu_site.sh)
        rehearsal = BUILD / "gallery_rehearsal"
        shutil.rmtree(rehearsal, ignore_errors=True)
        harvest = ("harvest", "--out", str(rehearsal), "--command", "nox -s docs", "--allow-cpu")
        session.run("python", "docs/gallery_recordings.py", *harvest, env=env)
        (manifest,) = rehearsal.glob("*.json")
        session.run("python", "docs/gallery_recordings.py", "times", str(manifest), env=env)


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
    session.run("python", "benchmarks/diff.py")
    session.install("HolisticTraceAnalysis")
    session.run("python", "benchmarks/hta_kernels.py")


def _release(version: str) -> str:
    """``2.14`` for ``2.14.1+cu130`` or ``2.12.*``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def _given_pythons(session: nox.Session) -> tuple[dict[str, list[str]], list[str]]:
    """The interpreters given as ``--python PATH`` (repeatable), by the torch release each
    has (a release may come in two builds), and the other arguments."""
    given: dict[str, list[str]] = {}
    rest: list[str] = []
    args = iter(session.posargs)
    for arg in args:
        if arg != "--python":
            rest.append(arg)
            continue
        python = next(args, None)
        if python is None:
            session.error("--python needs a path to an interpreter with torch")
        version = session.run(
            python, "-c", "import torch; print(torch.__version__)", silent=True, external=True
        )
        given.setdefault(_release(version.strip().splitlines()[-1]), []).append(python)
    return given, rest


def _torch_pythons(
    session: nox.Session, pin: str, given: dict[str, list[str]], extras: str
) -> list[str]:
    """Pythons with torch ``pin``: those given for its release, else a virtual environment
    of its own under .nox/, made once, with ``torch==pin`` and mpguide's ``extras``."""
    if _release(pin) in given:
        session.log(f"torch {pin}: using {', '.join(given[_release(pin)])}")
        return given[_release(pin)]
    env = ROOT / ".nox" / f"torch-{pin.replace('*', 'x')}"
    python = env / "bin" / "python"
    if not python.exists():
        session.run(sys.executable, "-m", "venv", str(env), external=True)
    spec = f".[{extras}]" if extras else "."
    session.run(
        str(python), "-m", "pip", "install", "--quiet", f"torch=={pin}", "-e", spec, external=True
    )
    return [str(python)]


@nox.session(venv_backend="none", default=False)
def versions(session: nox.Session) -> None:
    """Record the version-sensitive facts (autocast policies, switch defaults, the facts of
    mpguide.core.versions) on every torch of the window, one after the other, into
    docs/recorded/versions/<torch>.json.

    Each torch gets an environment of its own under .nox/ (``torch==X`` from the package
    index pip is configured with); ``-- --python PATH`` (repeatable) uses an existing
    interpreter for the release its torch belongs to instead, one per build of a release
    (CPU-only and standard builds are recorded side by side)."""
    given, rest = _given_pythons(session)
    out = Path("docs", "recorded", "versions")  # relative: the recordings quote the command
    for pin in RELEASES:
        for python in _torch_pythons(session, pin, given, ""):
            session.run(
                python,
                "-m",
                "mpguide.versions.probes",
                "--out",
                str(out),
                *rest,
                env={"PYTHONPATH": str(ROOT)},
                external=True,
            )


@nox.session(venv_backend="none", default=False)
@nox.parametrize("pin", [RELEASES[0], RELEASES[-1]], ids=["oldest", "newest"])
def compat(session: nox.Session, pin: str) -> None:
    """Run the tests and every example as a plain script on the window's oldest and newest
    torch (``nox -s "compat(oldest)"`` for one). ``-- --python PATH`` uses an existing
    interpreter for its torch's release; other arguments go to pytest."""
    given, rest = _given_pythons(session)
    python = _torch_pythons(session, pin, given, "test")[0]
    env = {"PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"}
    workers = ("-n", "auto", "--maxprocesses", "4", "--dist", "worksteal")
    session.run(python, "-m", "pytest", *workers, *rest, env=env, external=True)
    for example in sorted(ROOT.glob("examples/*/plot_*.py")):
        session.log(f"example {example.relative_to(ROOT)}")
        session.run(python, str(example), env=env, external=True, silent=True)

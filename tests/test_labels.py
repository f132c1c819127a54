"""Every page paragraph that states a CUDA, MPS or XPU dtype behaviour says how it was obtained.

The rule, checked here: a prose paragraph (a paragraph of an example's docstring, a run of
``#`` comment lines in ``examples/**/plot_*.py``, or a paragraph of ``docs/*.md`` outside code
fences and outside reference lists) that names ``CUDA``, ``MPS`` or ``XPU`` and a dtype word
(bf16, fp16, float32, dtype, ...) must also hold one of the label words: live, simulated (or
simulation), recorded, or hardware ("ran on hardware"). A phrase that says the claim was not
checked ("needs hardware", "without hardware", "not checked") is no label: a paragraph that
states a per-device dtype list and only says that checking it needs hardware is unbacked (the
list of CUDA and MPS dtypes that ``questions/plot_05`` stated this way was false). The
paragraphs that
do not yet are listed in ``tests/data/unlabelled.txt`` (path and first words); a new one fails
the test, and so does a listed one that is labelled now, so the list only shrinks. After
editing pages, ``python tests/test_labels.py`` rewrites the list.
"""

from __future__ import annotations

import re
import sys

from helpers import ROOT

LISTED = ROOT / "tests" / "data" / "unlabelled.txt"
DEVICE = re.compile(r"\b(CUDA|MPS|XPU)\b")
DTYPE = re.compile(
    r"\b(bf16|fp16|fp32|tf32|fp8|float16|float32|bfloat16|float64|dtypes?)\b", re.IGNORECASE
)
LABEL = re.compile(r"\b(live|simulat\w*|recorded|record\w*|hardware)\b", re.IGNORECASE)
NOT_CHECKED = re.compile(
    r"\b(needs?|requires?|required|without|lacks?)\s+(\w+\s+){0,2}?hardware\b"
    r"|\bnot\s+(checked|run|reproduced|simulated)\b",
    re.IGNORECASE,
)
"""Phrases with a label word that say the claim was not checked: they label nothing."""


def labelled(para: str) -> bool:
    """Whether ``para`` says how its claim was obtained (a label word outside a phrase that
    says it was not checked)."""
    return bool(LABEL.search(NOT_CHECKED.sub(" ", para)))


def states_device_dtype(para: str) -> bool:
    """Whether ``para`` names a device type (CUDA, MPS, XPU) and a dtype word."""
    return bool(DEVICE.search(para) and DTYPE.search(para))


def _docstring(text: str) -> list[tuple[int, str]]:
    m = re.match(r'\s*[rR]?"""(.*?)"""', text, re.DOTALL)
    if not m:
        return []
    return [(1, " ".join(p.split())) for p in re.split(r"\n\s*\n", m.group(1)) if p.strip()]


def _comments(text: str) -> list[tuple[int, str]]:
    paras, lines, start = [], [], 0
    for i, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        body = s.lstrip("#").strip()
        if s.startswith("#") and not s.startswith("# %%") and body and set(body) - set("-="):
            start = start if lines else i
            lines.append(body)
        elif s.startswith("#") and body and lines:
            continue  # a heading's underline: the heading belongs to the paragraph below
        elif lines:
            paras.append((start, " ".join(lines)))
            lines = []
    if lines:
        paras.append((start, " ".join(lines)))
    return paras


def _markdown(text: str) -> list[tuple[int, str]]:
    paras, lines, start, fence = [], [], 0, False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        elif not fence and line.strip():
            start = start if lines else i
            lines.append(line.strip())
            continue
        if lines:
            paras.append((start, " ".join(lines)))
            lines = []
    if lines:
        paras.append((start, " ".join(lines)))
    return paras


def paragraphs() -> list[tuple[str, int, str]]:
    """Every prose paragraph of the pages: ``(path, line, text)``."""
    found = []
    for path in sorted((ROOT / "examples").rglob("plot_*.py")):
        text = path.read_text()
        for line, para in _docstring(text) + _comments(text):
            found.append((path.relative_to(ROOT).as_posix(), line, para))
    for path in sorted((ROOT / "docs").glob("*.md")):
        for line, para in _markdown(path.read_text()):
            found.append((path.relative_to(ROOT).as_posix(), line, para))
    return found


def unlabelled() -> list[tuple[str, int, str]]:
    """The paragraphs that name a device's dtype behaviour without a label."""
    return [
        (path, line, para)
        for path, line, para in paragraphs()
        if states_device_dtype(para)
        and not labelled(para)
        and not para.lstrip().startswith((":torch", ".. admonition"))
    ]


def key(path: str, para: str) -> str:
    return f"{path}: {' '.join(para.split()[:10])}"


def listed() -> list[str]:
    return [k for k in LISTED.read_text().splitlines() if k.strip()] if LISTED.exists() else []


# The paragraph questions/plot_05 had (issue 50): a per-device dtype list, false for CUDA and
# MPS on torch 2.13, whose only label word said that it was not checked.
UNCHECKED_LIST = """# ``torch.autocast`` checks the dtype against a per-device list in Python when it is entered:
# CPU bf16 and fp16, CUDA fp16 and bf16 (bf16 only where the GPU supports it), MPS fp16 and bf16
# on recent macOS. The CUDA and MPS lists need hardware, so this page checks only the CPU's."""


def test_the_rule_catches_an_unlabelled_device_claim():
    cases = (
        ("# CUDA autocast runs softmax in float32.", True),
        ("# CUDA autocast runs softmax in float32 (simulated here).", False),
        ("# CUDA autocast runs softmax in float32 (live on a GPU, simulated without one).", False),
        ("# Which CUDA kernel runs needs hardware; autocast casts the mask to bf16.", True),
        ("# CUDA runs it in float32: not checked here, it needs a GPU.", True),
        ("# CUDA runs it in float32 (ran on hardware, recorded on an H100).", False),
        (UNCHECKED_LIST, True),
    )
    for text, want in cases:
        para = _comments(text)[0][1]
        assert (states_device_dtype(para) and not labelled(para)) == want, text


def test_every_device_claim_on_a_page_is_labelled_or_listed():
    found = {key(path, para): f"{path}:{line}" for path, line, para in unlabelled()}
    known = listed()
    new = [f"{where}: {k}" for k, where in found.items() if k not in known]
    fixed = [k for k in known if k not in found]
    assert not new, "CUDA/MPS/XPU dtype claims without live/simulated/recorded:\n" + "\n".join(new)
    assert not fixed, f"labelled now, remove from {LISTED.name}:\n" + "\n".join(fixed)


if __name__ == "__main__":
    keys = sorted({key(path, para) for path, _, para in unlabelled()})
    LISTED.write_text("".join(f"{k}\n" for k in keys))
    print(
        f"{len(keys)} unlabelled paragraphs listed in {LISTED.relative_to(ROOT)}", file=sys.stderr
    )

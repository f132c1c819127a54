"""What an example's prose states, and whether the page's own run backs it.

The prose of an example (``examples/<chapter>/plot_*.py``) is its text blocks: the module
docstring and the comment block after each ``# %%`` (what sphinx-gallery renders as text),
without headings, directive lines, link targets and the references admonition. Its sentences
state three kinds of fact, and each must be backed:

- a **number** (``8.4``, ``1,349.9``, ``0.0039``, ``2.13``; not inside a name such as ``fp16``,
  ``e4m3`` or ``H100``, not an issue number ``#136082``, not inside an inline literal, which is
  code): backed when a number of the page's output rounds to it at the precision the prose
  writes (``0.0841`` backs ``8.4 %`` as a share, ``2.13.0`` backs ``2.13``), or when it is a
  numeric literal of the page's code (the inputs a page chooses, the bounds it asserts; ``0.3``
  backs ``30 %``); text in double quotes (a thread's words) and a year dating a question
  (``2025-2026``, ``asked in 2025.``) state no number;
- a **dtype** (``bf16``, ``torch.float16``, ``e4m3``, ``NVFP4``, ...; aliases count as one):
  backed when the output names it;
- an **op** (an inline literal, or a snake_case word, naming an ATen op or a
  ``torch.nn.functional`` function, and a few op names without an underscore such as
  ``softmax``): backed when the output or the page's code names it ("matmul": any matrix
  product, ``@`` included).

A sentence that **generalises** (any, every, always, never, all, anything, everything) must
name the set it was checked on: a device (CPU, CUDA, GPU, H100, ...), a compile backend (eager,
aot_eager, inductor), a torch release (``2.13``, "this torch", "this build", "release"), a
count after the quantifier ("all 86 ops"), or a pointer to what the page ran ("here", "this
page", "above", "below", "in the table", "listed", "tested", "measured", "of this mask", "in
these rows"). Idioms ("at all", "first of all") do not generalise.

The check matches tokens, not meaning: a number printed anywhere on the page backs the same
number in any sentence, so a sentence can be false with every token backed. It finds what no
run shows: numbers typed into prose, dtypes and ops the page never printed or ran, and
generalisations beyond what was run.

The page's output is what sphinx-gallery captured from the run: its printed text and the text
of its HTML reprs (:func:`output_of_rst` reads them from the generated ``.rst``). This module
imports neither Sphinx nor torch at import time: the tests run it on planted pages without
Sphinx; ``prose_check`` runs it on every example the docs build executes.
"""

from __future__ import annotations

import functools
import html
import re
from dataclasses import dataclass

QUANTIFIER = re.compile(r"\b(any|every|always|never|all|anything|everything)\b(?!-)", re.IGNORECASE)
IDIOM = re.compile(
    r"\b(at all|first of all|above all|all in all|all the same|once and for all|not all)\b",
    re.IGNORECASE,
)
NAMED_SET = re.compile(
    r"\b(CPUs?|CUDA|MPS|XPU|GPUs?|H100|H200|A100|devices?|eager|aot_eager|inductor|cudagraphs"
    r"|backends?|torch \d|\d+\.\d+|this (torch|build|release|machine|page|run)|releases?"
    r"|here|above|below|in the table|listed|tested|checked|measured|we ran|shown|printed"
    r"|(of|in|on) (this|these|those|its) \w+)\b",
    re.IGNORECASE,
)
COUNTED = re.compile(
    r"\b(any|every|all)\b(\W+\w+){0,3}?\W+\d", re.IGNORECASE
)  # "all 86 ops", "every one of the 12"

# Longest names first, so ``float8_e4m3fn`` is one name and not ``e4m3`` inside it.
DTYPES = {
    "float8_e4m3fnuz": "e4m3",
    "float8_e5m2fnuz": "e5m2",
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
    "float8_e8m0fnu": "e8m0",
    "float4_e2m1fn_x2": "e2m1",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
    "e4m3fn": "e4m3",
    "mxfp4": "mxfp4",
    "mxfp8": "mxfp8",
    "nvfp4": "nvfp4",
    "e4m3": "e4m3",
    "e5m2": "e5m2",
    "e8m0": "e8m0",
    "e2m1": "e2m1",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "fp64": "float64",
    "tf32": "tf32",
    "int8": "int8",
    "fp8": "fp8",
    "fp4": "fp4",
}
DTYPE = re.compile(
    r"(?<![A-Za-z0-9])(" + "|".join(sorted(DTYPES, key=len, reverse=True)) + r")(?![A-Za-z0-9])",
    re.IGNORECASE,
)
FAMILY = {"fp8": ("e4m3", "e5m2", "fp8", "mxfp8"), "fp4": ("e2m1", "fp4", "mxfp4", "nvfp4")}
"""A family name is backed by any of its members in the output."""

NUMBER = re.compile(
    r"(?<![\w.#/\\])(\d{1,3}(?:,\d{3})+|\d+)((?:\.\d+)*)([eE][-+]?\d+)?(?![\w])(\s*(%|per ?cent))?"
)
OUTPUT_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)*|\d+(?:\.\d+)*(?:[eE][-+]?\d+)?")
BARE_OPS = frozenset(
    [
        "softmax",
        "matmul",
        "mm",
        "bmm",
        "addmm",
        "baddbmm",
        "gelu",
        "silu",
        "relu",
        "conv1d",
        "conv2d",
        "conv3d",
        "einsum",
        "cumsum",
    ]
)
MATMULS = frozenset(["matmul", "mm", "addmm", "bmm", "baddbmm", "linear", "@"])
""""The matmul" is backed by any matrix product the page shows or runs (``@`` included)."""
LITERAL = re.compile(r"``(.+?)``|(?<![`:\w])`([^`<>]+?)`(?!`|_)")
OP_SHAPE = re.compile(
    r"^(?:torch\.(?:nn\.functional\.|ops\.aten\.)?|F\.|aten(?:::|\.))?"
    r"([a-z_][a-z0-9_]*)(?:\.[a-z_]+)?(?:\(.*\))?$"
)


@dataclass(frozen=True)
class Finding:
    """One stated fact of a page that its run does not back."""

    page: str
    line: int
    kind: str  # number, dtype, op or general
    token: str
    sentence: str

    def key(self) -> str:
        """The line that lists this finding in ``tests/data/prose_unchecked.txt``."""
        return f"{self.page}: {self.token}: {sentence_start(self.sentence)}"

    def __str__(self) -> str:
        what = {
            "number": "a number no output or code backs",
            "dtype": "a dtype the output never names",
            "op": "an op neither the output nor the code names",
            "general": "a generalisation that names no set",
        }[self.kind]
        return f"{self.page}:{self.line}: {what}, {self.token!r}, in {self.sentence!r}"


def sentence_start(sentence: str, words: int = 8) -> str:
    return " ".join(sentence.split()[:words])


# ---------------------------------------------------------------------------------- the prose
def text_blocks(source: str) -> list[tuple[int, str]]:
    """The text blocks of an example, ``(first line, text)``: its docstring and the comment
    block after each ``# %%``, the ``#`` taken off."""
    lines = source.splitlines()
    blocks = []
    m = re.match(r'\s*[rRuU]?("""|\'\'\')(.*?)\1', source, re.DOTALL)
    if m:
        blocks.append((source[: m.start(2)].count("\n") + 1, m.group(2)))
    for i, line in enumerate(lines):
        if not line.startswith("# %%"):
            continue
        body = []
        for follow in lines[i + 1 :]:
            if follow != "#" and not follow.startswith("# "):
                break
            body.append(follow[2:])
        if body:
            blocks.append((i + 2, "\n".join(body)))
    return blocks


def _prose_lines(first: int, text: str) -> list[tuple[int, str]]:
    """The lines of a block that are prose: no headings, directives or their bodies (the
    references admonition included), no code blocks."""
    kept, lines, skip_indent = [], text.splitlines(), None
    for k, line in enumerate(lines):
        nxt = lines[k + 1] if k + 1 < len(lines) else ""
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not line.strip() or indent > skip_indent:
                continue
            skip_indent = None
        s = line.strip()
        if re.fullmatch(r"([-=~^*#])\1{2,}", s) or (
            s and re.fullmatch(r"([-=~^*#])\1{2,}", nxt.strip())
        ):
            continue  # a heading and its underline
        if s.startswith(".. ") or s.endswith("::"):
            # a directive or a literal block: its indented body is not prose (a note's is, but
            # the references admonition and code blocks are what pages put there)
            skip_indent = indent
            continue
        kept.append((first + k, line))
    return kept


def _clean(text: str) -> str:
    """Links reduced to their text, roles to their text, URLs dropped."""
    text = re.sub(r"`([^`<]*?)\s*<[^>]*>`__?", r"\1", text)
    text = re.sub(r":[\w:.-]+:`~?([^`<]*?)(\s*<[^>]*>)?`", r"``\1``", text)
    return re.sub(r"https?://\S+", " ", text)


def sentences(source: str) -> list[tuple[int, str]]:
    """The prose sentences of an example, ``(line, sentence)``; list items are sentences."""
    found = []
    for first, block in text_blocks(source):
        paragraph: list[tuple[int, str]] = []
        for line, text in [*_prose_lines(first, block), (0, "")]:
            item = re.match(r"\s*([-*]|\d+\.)\s", text)
            if (not text.strip() or item) and paragraph:
                found += _split(paragraph)
                paragraph = []
            if text.strip():
                paragraph.append((line, text.strip()))
    return found


def _split(paragraph: list[tuple[int, str]]) -> list[tuple[int, str]]:
    joined, starts = "", []
    for line, text in paragraph:
        starts.append((len(joined), line))
        joined += text + " "
    joined = _clean(joined)
    out, at = [], 0
    for m in re.finditer(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)[.!?:;]\s+(?=[A-Z`*(\"'])|$", joined):
        piece = joined[at : m.end()].strip()
        if piece:
            line = max((ln for pos, ln in starts if pos <= at), default=paragraph[0][0])
            out.append((line, re.sub(r"^([-*]|\d+\.)\s+", "", piece)))
        at = m.end()
    return out


# ------------------------------------------------------------------------- what a sentence states
def stated(sentence: str) -> list[tuple[str, str]]:
    """The facts a sentence states, ``(kind, token)``, each once; quotations and years are
    not the page's facts."""
    named = sentence
    sentence = unquoted(sentence)
    literals = [a or b for a, b in LITERAL.findall(sentence)]
    plain = LITERAL.sub(" ", sentence)
    facts = []
    for m in NUMBER.finditer(plain):
        if not _year(plain, m):
            facts.append(("number", m.group(0).strip()))
    for m in DTYPE.finditer(sentence):
        facts.append(("dtype", m.group(1)))
    for name in literals:
        op = _op(name)
        if op:
            facts.append(("op", op))
    for word in re.findall(r"(?<![\w.`])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w`])", plain):
        if word in op_names():
            facts.append(("op", word))
    for word in re.findall(r"\b[a-z0-9]+\b", plain):
        if word in BARE_OPS:
            facts.append(("op", word))
    q = QUANTIFIER.search(IDIOM.sub(" ", plain))
    if q and not NAMED_SET.search(named) and not COUNTED.search(sentence):
        facts.append(("general", q.group(1)))
    return list(dict.fromkeys(facts))


def unquoted(sentence: str) -> str:
    """The sentence with what it quotes (text in straight or curly double quotes: a thread's
    words, not the page's claim) blanked out. Quotes inside inline literals are code, not
    quotation marks; a quotation the sentence splitter cut in two is blanked to the sentence's
    end (an opening quote left open) or from its start (a closing quote)."""
    masked = LITERAL.sub(lambda m: "x" * len(m.group(0)), sentence)
    spans, start = [], None
    for m in re.finditer(r"[\"\u201c\u201d]", masked):
        i, mark = m.start(), m.group(0)
        opening = mark == "\u201c" or (
            mark == '"' and start is None and (i == 0 or masked[i - 1] in " ([{\u2014-")
        )
        if start is None and opening:
            start = i
        elif start is not None and mark != "\u201c":
            spans.append((start, i + 1))
            start = None
        elif start is None:
            spans.append((0, i + 1))  # the end of a quotation begun in the last sentence
    if start is not None:
        spans.append((start, len(sentence)))
    for a, b in spans:
        sentence = sentence[:a] + " " * (b - a) + sentence[b:]
    return sentence


def _year(plain: str, m: re.Match) -> bool:
    """A year 2000-2099 in a range (``2025-2026``) or after "in" at the end of a clause
    (``asked in 2025.``), which dates a question rather than stating a result."""
    if not re.fullmatch(r"20\d\d", m.group(0)):
        return False
    before, after = plain[: m.start()], plain[m.end() :]
    in_range = re.search(r"20\d\d[-\u2013]$", before) or re.match(r"[-\u2013]20\d\d\b", after)
    dated = re.search(r"\bin $", before) and re.match(r"\s*([.,;:)]|$)", after)
    return bool(in_range or dated)


def _op(literal: str) -> str | None:
    m = OP_SHAPE.match(literal.strip())
    if not m:
        return None
    name = m.group(1)
    return name if name in op_names() or name in BARE_OPS else None


@functools.cache
def op_names() -> frozenset[str]:
    """The names of the ATen ops this torch registers and of ``torch.nn.functional``'s
    functions."""
    import torch
    import torch.nn.functional as F

    aten = {
        n.split("::", 1)[1].split(".", 1)[0]
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("aten::")
    }
    functional = {n for n in dir(F) if not n.startswith("__") and callable(getattr(F, n))}
    # Words that name an op and mean something else in prose, or torch's type names.
    return frozenset((aten | functional) - {"to", "item", "size", "dtype", "float", "device"})


# ------------------------------------------------------------------------------- what backs it
def output_of_rst(rst: str) -> str:
    """The output sphinx-gallery put in an example's ``.rst``: the captured stdout blocks and
    the text of the HTML reprs."""
    out, lines, k = [], rst.splitlines(), 0
    while k < len(lines):
        m = re.match(r"(\s*)\.\. (code-block|raw):: (none|html)\s*$", lines[k])
        k += 1
        if not m:
            continue
        indent, body = len(m.group(1)), []
        while k < len(lines) and (
            not lines[k].strip() or len(lines[k]) - len(lines[k].lstrip()) > indent
        ):
            body.append(lines[k])
            k += 1
        text = "\n".join(body)
        if m.group(3) == "html":
            text = html.unescape(re.sub(r"<[^>]+>", " ", text))
        out.append(text)
    return "\n".join(out)


def _code(source: str) -> str:
    """The page's code: the source without its docstring, text blocks and comments."""
    blocks = {
        ln
        for first, text in text_blocks(source)
        for ln in range(first, first + len(text.splitlines()))
    }
    m = re.match(r'\s*[rRuU]?("""|\'\'\')(.*?)\1', source, re.DOTALL)
    skip = m.group(0).count("\n") + 1 if m else 0
    # Comments are prose too: a number typed into one backs nothing.
    return "\n".join(
        re.sub(r"  # .*$", "", line)
        for n, line in enumerate(source.splitlines(), 1)
        if n > skip and n not in blocks and not line.lstrip().startswith("#")
    )


def _value(token: str) -> tuple[float, int] | None:
    """A written number as ``(value, decimals written)``; None for a version such as 2.13.0."""
    t = token.replace(",", "")
    if t.count(".") > 1:
        return None
    try:
        value = float(t)
    except ValueError:
        return None
    decimals = len(t.split(".")[1].split("e")[0].split("E")[0]) if "." in t else 0
    return value, decimals


class Backing:
    """What a page's run shows (its output) and what its code holds, ready to look up."""

    def __init__(self, output: str, code: str):
        self.output = output
        self.code = code
        self.numbers = [n.replace(",", "") for n in OUTPUT_NUMBER.findall(output)]
        self.values = [v for v in map(_value, self.numbers) if v is not None]
        self.versions = {".".join(n.split(".")[:k]) for n in self.numbers for k in (2, 3)}
        self.literals = {
            v[0]
            for v in map(_value, re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", code))
            if v is not None
        }
        self.dtypes = {DTYPES[m.lower()] for m in DTYPE.findall(output)}
        self.words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", output + "\n" + code))
        if re.search(r"[\w)\]]\s*@\s*[\w(]", code):
            self.words.add("@")

    def backs(self, kind: str, token: str) -> bool:
        if kind == "number":
            return self._number(token)
        if kind == "dtype":
            name = DTYPES[token.lower()]
            return bool(self.dtypes & set(FAMILY.get(name, (name,))))
        if kind == "op":
            return token in self.words or (token == "matmul" and bool(self.words & MATMULS))
        return False

    def _number(self, token: str) -> bool:
        share = token.endswith(("%", "cent"))
        written = re.match(r"[\d.,eE+-]+", token).group(0)
        parsed = _value(written)
        if parsed is None or written in self.versions:  # 2.13.0 backs 2.13 and 2.13.0
            return written in self.versions
        value, decimals = parsed
        if value in self.literals or (
            share and any(abs(n * 100 - value) < 1e-9 for n in self.literals)
        ):
            return True  # an input or a bound of the code (0.3 asserted backs 30 %)
        for seen, _ in self.values:
            for scaled in (seen, seen * 100) if share else (seen,):
                if f"{scaled:.{decimals}f}" == f"{value:.{decimals}f}":
                    return True
        return False


def check(page: str, source: str, output: str) -> list[Finding]:
    """Every fact the prose of ``source`` states that ``output`` (what the page printed and
    showed) and the page's code do not back."""
    backing = Backing(output, _code(source))
    return [
        Finding(page, line, kind, token, sentence)
        for line, sentence in sentences(source)
        for kind, token in stated(sentence)
        if not backing.backs(kind, token)
    ]


def listed(path) -> list[str]:
    """The findings a list file holds, one key a line (blank lines and ``#`` comments aside)."""
    if not path.exists():
        return []
    return [k for k in path.read_text().splitlines() if k.strip() and not k.startswith("#")]


def against_list(page: str, found: list[Finding], known: list[str]) -> tuple[list[str], list[str]]:
    """What a checked page's findings say about the list of exceptions: the findings it does
    not list (each a message), and its listed keys for the page that are backed now."""
    keys = {finding.key() for finding in found}
    new = [str(finding) for finding in found if finding.key() not in known]
    backed = [key for key in known if key.startswith(f"{page}: ") and key not in keys]
    return new, backed

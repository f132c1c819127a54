"""The whole gallery run on a GPU, brought home and shown beside the live output, block by block.

On the GPU machine, after the site is built there (``docs/gpu_site.sh``), ``python
docs/gallery_recordings.py harvest`` reads what sphinx-gallery wrote for each example (the
generated ``.rst``, with every code block's printed output, HTML reprs and figures; the
``.cost.json`` with its seconds) and writes, into ``--out``:

- ``<gpu>.json``, the manifest: a ``provenance`` object (GPU, driver, CUDA, torch, date,
  command) and ``pages``, mapping every ``examples/<chapter>/plot_*.py`` to its ``status``
  (``passed``, ``failed`` with the ``error`` line, or ``not run``), ``seconds`` and ``device``;
- ``<gpu>/<chapter>/<example>.json``: the output of each code block, as reStructuredText,
  keyed by a hash of the block's code; and the figures, as palette PNGs.

Loaded as a Sphinx extension, it shows on each example page, under every code block whose
code a recording holds, the live output and each GPU's recorded output in tabs
(sphinx-design): "this build: CPU, live" beside "NVIDIA H200: recorded on <date>, torch
<version>". Without a recording, a page is left as sphinx-gallery wrote it. Only recordings
made on a GPU are shown: a CPU rehearsal's harvest (``--allow-cpu``) is refused in
``docs/recorded/``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = 1
RECORDED = Path("docs", "recorded", "gallery")
"""Where the site's gallery recordings live, from the source root."""
GALLERY = Path("docs", "auto_examples")
"""Where sphinx-gallery writes the example pages, from the source root."""

_GENERATED = re.compile(r"^\.\. GENERATED FROM PYTHON SOURCE LINES (\d+)-(\d+)\n", re.MULTILINE)
_FOOTER = re.compile(r"^\.\. (rst-class:: sphx-glr-timing|_sphx_glr_download_)", re.MULTILINE)
_IMAGE = re.compile(r"/docs/auto_examples/(?P<chapter>[\w-]+)/images/(?P<file>[\w.-]+\.png)")


# -- reading sphinx-gallery's page ----------------------------------------------------------


def blocks(rst: str) -> tuple[str, list[tuple[str, str, str]]]:
    """``rst`` (a page sphinx-gallery generated) cut into its head and its blocks, each as
    ``(code hash, code and prose, output)``: the hash is ``""`` for a text block, and the
    output is what follows a code block's code (printed text, HTML reprs, figures). The page's
    footer stays in the last block's output: :func:`outputs` and :func:`beside` leave it."""
    parts = _GENERATED.split(rst)
    head, found = parts[0], []
    for i in range(1, len(parts), 3):
        marker = f".. GENERATED FROM PYTHON SOURCE LINES {parts[i]}-{parts[i + 1]}\n"
        body = parts[i + 2]
        lines = body.splitlines(keepends=True)
        start = next((j for j, line in enumerate(lines) if line.strip()), len(lines))
        if start == len(lines) or not lines[start].startswith(".. code-block:: Python"):
            found.append(("", marker + body, ""))
            continue
        end = start + 1
        while end < len(lines) and (not lines[end].strip() or lines[end][0] in " \t"):
            end += 1
        code = textwrap.dedent("".join(lines[start + 1 : end]))
        code = "\n".join(line for line in code.splitlines() if not line.startswith(":"))
        digest = hashlib.sha1(code.strip().encode()).hexdigest()[:16]
        found.append((digest, marker + "".join(lines[:end]), "".join(lines[end:])))
    return head, found


def _without_footer(output: str) -> tuple[str, str]:
    m = _FOOTER.search(output)
    return (output[: m.start()], output[m.start() :]) if m else (output, "")


def _failure(rst: str) -> str | None:
    """The last line of the traceback sphinx-gallery put on a failing example's page."""
    m = re.search(r"^\s*\.\. code-block:: pytb\n\n((?:[ \t]+.*\n|\n)+)", rst, re.MULTILINE)
    if not m:
        return None
    lines = [line.strip() for line in m.group(1).splitlines() if line.strip()]
    return lines[-1] if lines else "failed"


# -- harvesting on the GPU machine ----------------------------------------------------------


def _compress(src: Path, dst: Path) -> None:
    """A figure as a PNG of at most 256 colours (a plot has few), or as it was where that
    is not smaller."""
    import shutil

    from PIL import Image

    with Image.open(src) as img:
        img.convert("RGB").quantize(256).save(dst, optimize=True)
    if dst.stat().st_size >= src.stat().st_size:
        shutil.copyfile(src, dst)


def _stored_output(output: str, slug: str) -> str:
    """A block's output with its figures pointing at the stored copies."""
    output = re.sub(r"^(\s*)\.\. image-sg::", r"\1.. image::", output, flags=re.MULTILINE)
    output = re.sub(r"^\s*:srcset:.*\n", "", output, flags=re.MULTILINE)

    def stored(m: re.Match) -> str:
        return f"/{RECORDED.as_posix()}/{slug}/{m['chapter']}/{_stored_name(slug, m['file'])}"

    return _IMAGE.sub(stored, output)


def _stored_name(slug: str, file: str) -> str:
    """A stored figure's file name: the GPU's slug before sphinx-gallery's, so that Sphinx,
    which copies every image of the site into one folder by its name, keeps it apart from
    the live figure of the same block."""
    return f"{slug}-{file}"


def harvest_page(example: Path, gallery: Path, out: Path, slug: str, dev: str) -> dict:
    """The manifest entry of one example and its stored outputs under ``out/slug``."""
    chapter, stem = example.parent.name, example.stem
    rst_path = gallery / chapter / f"{stem}.rst"
    cost = gallery / chapter / f"{stem}.cost.json"
    rst = rst_path.read_text(encoding="utf-8") if rst_path.exists() else ""
    error = _failure(rst)
    if not error and not cost.exists():  # not executed (filtered out, or the build stopped)
        return {"status": "not run", "error": None, "seconds": None, "device": dev}
    seconds = json.loads(cost.read_text())["time"] if cost.exists() else None
    stored = out / slug / chapter
    stored.mkdir(parents=True, exist_ok=True)
    kept = []
    for digest, _, output in blocks(rst)[1]:
        output = _without_footer(output)[0].strip("\n")
        if digest and output:
            kept.append({"code": digest, "output": _stored_output(output, slug)})
            for m in _IMAGE.finditer(output):
                src = gallery / chapter / "images" / m["file"]
                _compress(src, stored / _stored_name(slug, m["file"]))
    page = {"example": example.as_posix(), "blocks": kept}
    (stored / f"{stem}.json").write_text(json.dumps(page, indent=1) + "\n")
    return {
        "status": "failed" if error else "passed",
        "error": error,
        "seconds": None if seconds is None else round(seconds, 2),
        "device": dev,
        "outputs": f"{slug}/{chapter}/{stem}.json",
    }


def harvest(root: Path, gallery: Path, out: Path, command: str, allow_cpu: bool = False) -> Path:
    """Write the manifest and the stored outputs of every example of ``root/examples`` from
    the gallery sphinx-gallery built in ``gallery``; return the manifest's path."""
    from mpguide import MPGuideError
    from mpguide.core import device, record

    dev = device.pick()
    if dev.type == "cpu":
        if not allow_cpu:
            raise MPGuideError("no GPU here: gallery recordings are made on a GPU machine")
        if (root / RECORDED).resolve() in (out.resolve(), *out.resolve().parents):
            raise MPGuideError(f"a CPU rehearsal is not a GPU recording: not into {RECORDED}/")
    prov = record.provenance(dev, command)
    slug = record.slug(prov)
    machine = device.describe(dev).caption()
    examples = sorted(root.glob("examples/*/plot_*.py"))
    pages = {
        e.relative_to(root).as_posix(): harvest_page(
            e.relative_to(root), gallery, out, slug, machine
        )
        for e in examples
    }
    manifest = {"schema": SCHEMA, "provenance": asdict(prov), "pages": pages}
    path = out / f"{slug}.json"
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


# -- showing the recordings on a CPU-built page ----------------------------------------------


def recordings(folder: Path) -> list[dict]:
    """The GPU gallery recordings in ``folder`` (manifests with ``provenance`` and ``pages``),
    by file name; a CPU's is left out."""
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("schema") == SCHEMA and doc["provenance"]["device"] != "cpu":
            found.append({**doc, "folder": folder})
    return found


def label(prov: dict) -> str:
    return f"{prov['name']}: recorded on {prov['date']}, torch {prov['torch']}"


def _tab(title: str, body: str) -> str:
    body = body.strip("\n") or "*(no output)*"
    return f"   .. tab-item:: {title}\n\n{textwrap.indent(body, ' ' * 6)}\n\n"


def beside(rst: str, example: str, recorded: list[dict], live: str) -> str:
    """``rst`` with each code block's output in tabs: ``live`` (this build) and each
    recording's output of a block with the same code; a note under the title names every
    recording of the page with its provenance and status."""
    shown = []
    for rec in recorded:
        entry = rec["pages"].get(example)
        if entry and entry.get("outputs"):
            stored = json.loads((rec["folder"] / entry["outputs"]).read_text(encoding="utf-8"))
            by_code: dict[str, list[str]] = {}
            for b in stored["blocks"]:
                by_code.setdefault(b["code"], []).append(b["output"])
            shown.append((rec, entry, by_code))
    if not shown:
        return rst
    head, found = blocks(rst)
    lines = []
    for rec, entry, _ in shown:
        p = rec["provenance"]
        state = entry["status"] + (f": ``{entry['error']}``" if entry.get("error") else "")
        took = f" in {entry['seconds']:.1f} s" if entry.get("seconds") is not None else ""
        lines.append(
            f"   - **{label(p)}**, CUDA {p['cuda']}, driver {p['driver']}, by "
            f"``{p['command']}``: {state}{took}."
        )
    note = ".. admonition:: GPU recordings of this page\n\n" + "\n".join(lines) + "\n\n"
    out, noted = [head], False
    for digest, code, output in found:
        out.append(code)
        if digest and not noted:
            out.insert(-1, note)
            noted = True
        recs = [(rec, by_code[digest].pop(0)) for rec, _, by_code in shown if by_code.get(digest)]
        if not digest or not recs:
            out.append(output)
            continue
        mine, footer = _without_footer(output)
        tabs = "\n.. tab-set::\n\n" + _tab(live, mine)
        tabs += "".join(_tab(label(rec["provenance"]), text) for rec, text in recs)
        out.append(tabs + "\n" + footer)
    return "".join(out)


def _live_label() -> str:
    from mpguide.core import device

    dev = device.pick()
    name = "CPU" if dev.type == "cpu" else f"{dev.type.upper()} ({device.describe(dev).name})"
    return f"this build: {name}, live"


def _show(app, docname: str, source: list[str]) -> None:
    """``source-read``: an example page gets the GPU recordings beside its outputs."""
    m = re.fullmatch(rf"{GALLERY.as_posix()}/([\w-]+)/(plot_\w+)", docname)
    if not m or not app.env.mpguide_gallery_recordings:
        return
    example = f"examples/{m[1]}/{m[2]}.py"
    source[0] = beside(source[0], example, app.env.mpguide_gallery_recordings, _live_label())


def _load(app) -> None:
    from mpguide.core import device

    folder = Path(app.srcdir, app.config.mpguide_gallery_recorded)
    here = device.describe(device.pick()).name
    # A GPU build shows other GPUs' recordings, not its own beside itself.
    app.env.mpguide_gallery_recordings = [
        r for r in recordings(folder) if r["provenance"]["name"] != here
    ]


def setup(app):
    app.add_config_value("mpguide_gallery_recorded", RECORDED.as_posix(), "env")
    app.connect("builder-inited", _load)
    app.connect("source-read", _show)
    return {"parallel_read_safe": True, "parallel_write_safe": True}


# -- command line ----------------------------------------------------------------------------


def chain(pages: dict) -> tuple[float, list[str]]:
    """How long the gallery's examples keep a build waiting: sphinx-gallery runs the chapters
    one after the other, each as long as its slowest example (given enough workers); and a
    line per chapter: its slowest example, the sum of its examples, those not passed."""
    chapters: dict[str, list[tuple[float, str, str]]] = {}
    for page, e in pages.items():
        chapters.setdefault(page.split("/")[1], []).append((e["seconds"] or 0.0, page, e["status"]))
    total, lines = 0.0, []
    for chapter, rows in chapters.items():
        rows.sort(reverse=True)
        total += rows[0][0]
        lines.append(
            f"{chapter}: slowest {rows[0][0]:.1f} s ({Path(rows[0][1]).name}), "
            f"all {sum(r[0] for r in rows):.1f} s"
        )
        lines += [f"    {status}: {page}" for _, page, status in rows if status != "passed"]
    return total, lines


def main(argv: list[str] | None = None) -> int:
    """``harvest``: bad input ends with one line and status 2."""
    from mpguide import MPGuideError

    p = argparse.ArgumentParser(prog="gallery_recordings.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("harvest", help="store the gallery the last build ran, with provenance")
    h.add_argument("--gallery", type=Path, default=ROOT / GALLERY, help="sphinx-gallery's output")
    h.add_argument("--out", type=Path, required=True, help="folder of the recording")
    h.add_argument("--command", dest="built_by", required=True, help="the build's command line")
    h.add_argument("--allow-cpu", action="store_true", help="harvest a CPU build (rehearsal)")
    t = sub.add_parser("times", help="the slowest example of each chapter, and their sum")
    t.add_argument("manifest", type=Path)
    args = p.parse_args(argv)
    if args.command == "times":
        try:
            pages = json.loads(args.manifest.read_text())["pages"]
        except (OSError, ValueError, KeyError) as err:
            print(f"gallery_recordings.py: error: {args.manifest}: {err}", file=sys.stderr)
            return 2
        total, lines = chain(pages)
        print("\n".join(lines))
        print(f"the gallery's chain (each chapter waits for its slowest example): {total:.0f} s")
        return 0
    try:
        if not args.gallery.is_dir():
            raise MPGuideError(f"{args.gallery}: no gallery built there")
        args.out.mkdir(parents=True, exist_ok=True)
        path = harvest(ROOT, args.gallery, args.out, args.built_by, args.allow_cpu)
    except MPGuideError as err:
        print(f"gallery_recordings.py: error: {err}", file=sys.stderr)
        return 2
    pages = json.loads(path.read_text())["pages"]
    counts: dict[str, int] = {}
    for entry in pages.values():
        counts[entry["status"]] = counts.get(entry["status"], 0) + 1
    print(f"wrote {path}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return 0 if set(counts) == {"passed"} else 1


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "docs")]
    sys.exit(main())

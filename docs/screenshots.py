"""Screenshot every page of the built site in headless Chromium and check that nothing is wider
than its column: ``nox -s screenshots`` (or ``python docs/screenshots.py build/html OUT``).

A page fails at a width when its article is wider than the article's own box (some table, tree
or figure sticks out instead of scrolling inside its own box), when a figure is shrunk below its
drawn size on a phone-width screen (its labels would be illegible), or when a figure keeps its
white background in the dark theme. Exit status 1 lists them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

SKIP = {"genindex.html", "search.html", "py-modindex.html", "sg_execution_times.html"}
SKIP_DIRS = {"_static", "_sources", "_modules", "_images", "_downloads"}

# The widest descendants of the article that stick out of it, and how far.
_OVERFLOW = """() => {
  const article = document.querySelector('.bd-article') || document.body;
  const limit = article.getBoundingClientRect().right + 1;
  const out = [];
  for (const el of article.querySelectorAll('*')) {
    const right = el.getBoundingClientRect().right;
    if (right <= limit) continue;
    let inside = false;
    for (let p = el.parentElement; p && p !== article; p = p.parentElement) {
      const x = getComputedStyle(p).overflowX;
      if (x === 'auto' || x === 'scroll' || x === 'hidden') { inside = true; break; }
    }
    if (!inside) out.push([el.tagName.toLowerCase() + (el.className ? '.' +
      String(el.className).trim().split(/\\s+/).join('.') : ''), Math.round(right - limit)]);
  }
  return [article.scrollWidth > article.clientWidth + 1, out.slice(0, 3)];
}"""


# Figures that do not follow the page: shrunk on a narrow screen, or not darkened in dark mode.
_FIGURES = """([narrow, dark]) => {
  const bad = [];
  for (const img of document.querySelectorAll('.bd-article .mpguide-figure img')) {
    const name = img.getAttribute('src').split('/').pop();
    if (narrow && img.naturalWidth && img.clientWidth < 0.95 * img.naturalWidth)
      bad.push(`${name} shrunk to ${img.clientWidth} of ${img.naturalWidth}px`);
    if (dark && getComputedStyle(img).filter === 'none') bad.push(`${name} not darkened`);
  }
  return bad;
}"""
NARROW = 720  # px: below this, figures keep their drawn size and scroll (docs/_static)


def pages(root: Path) -> list[Path]:
    """The site's content pages, in path order."""
    found = []
    for path in sorted(root.rglob("*.html")):
        rel = path.relative_to(root)
        if path.name in SKIP or SKIP_DIRS & set(rel.parts) or rel.parts[0] == "index.html":
            continue
        found.append(path)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built HTML site (build/html)")
    parser.add_argument("out", type=Path, help="folder for the screenshots")
    parser.add_argument(
        "--widths", type=int, nargs="+", default=[1400, 390], help="viewport widths in pixels"
    )
    parser.add_argument(
        "--dark",
        action="store_true",
        help="also screenshot every page in the dark theme, at the first width, into OUT/dark",
    )
    parser.add_argument(
        "--chromium",
        default=os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium",
        help="the Chromium executable (default: chromium on PATH)",
    )
    args = parser.parse_args(argv)
    if not Path(args.chromium).exists():
        print(
            f"screenshots: error: no Chromium at {args.chromium}; on Debian: "
            "apt-get install chromium",
            file=sys.stderr,
        )
        return 2
    if not args.site.is_dir():
        print(f"screenshots: error: {args.site} is not a built site", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    todo = pages(args.site)
    failures, figure_failures = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        passes = [(width, str(width), "light") for width in args.widths]
        if args.dark:
            passes.append((args.widths[0], "dark", "dark"))
        for width, folder, mode in passes:
            page = browser.new_page(viewport={"width": width, "height": 900})
            # The theme reads the reader's choice from localStorage before it paints.
            page.add_init_script(f"localStorage.setItem('mode', '{mode}');")
            for i, path in enumerate(todo, 1):
                rel = path.relative_to(args.site)
                page.goto(path.resolve().as_uri())
                wide, culprits = page.evaluate(_OVERFLOW)
                figures = page.evaluate(_FIGURES, [width < NARROW, mode == "dark"])
                shot = args.out / folder / rel.with_suffix(".png")
                shot.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(shot), full_page=True)
                print(
                    f"[{folder} {width}px {i}/{len(todo)}] {rel}"
                    f"{'  TOO WIDE' if wide else ''}{'  FIGURES' if figures else ''}",
                    flush=True,
                )
                if wide:
                    failures.append((width, rel, culprits))
                if figures:
                    figure_failures.append((folder, rel, figures))
            page.close()
        browser.close()
    for width, rel, culprits in failures:
        what = ", ".join(f"{tag} by {px}px" for tag, px in culprits) or "the article itself"
        print(f"{rel} at {width}px: wider than its column ({what})", file=sys.stderr)
    for folder, rel, figures in figure_failures:
        print(f"{rel} ({folder}): {'; '.join(figures[:3])}", file=sys.stderr)
    print(
        f"{len(todo)} pages x {len(passes)} passes into {args.out}; {len(failures)} too wide, "
        f"{len(figure_failures)} with figures that do not follow the page"
    )
    return 1 if failures or figure_failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Screenshots of every HTML report page for the docs, made fresh from the docs' own examples.

Each page is written by the modeltap commands the docs show (run in-process in a scratch folder,
with the models and runs scripts/readme_examples.py builds for the pages: the real MiniLM, a
MiniLM with one weight row scaled, the tiny GPT-2 and its faulted twin, a recorded run that
tripped), opened in headless Chromium (Debian's `chromium`, driven by Playwright, as the report
tests do; `scripts/setup.sh --browser` installs it) once every chart is drawn, and saved as
docs/images/report-NAME.png, where docs/commands/report.md and the guides show it. CI runs it
before `mkdocs build`, so the site's pictures are of the pages this modeltap writes; the PNGs in
git are the last ones taken.

    python scripts/screenshots.py                 # every page, into docs/images/
    python scripts/screenshots.py dump diff       # those pages only
    python scripts/screenshots.py --out DIR       # elsewhere (the test)
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

IMAGES = ROOT / "docs" / "images"
PROMPT = "hello world the quick"


@dataclass(frozen=True)
class Shot:
    """One report page: the builder in render/report that draws it, the commands that write it
    (the last one writes `NAME.html`), and the chart to scroll to, if not the top."""

    builder: str
    commands: tuple[str, ...]
    chart: str | None = None


PAGES = {
    "dump": Shot(
        "dump_page",
        (
            'modeltap dump models/all-MiniLM-L6-v2 "hello world" --hist -o minilm.safetensors',
            "modeltap report minilm.safetensors -o dump.html",
        ),
    ),
    "formats": Shot(
        "dump_page",
        (
            'modeltap dump models/all-MiniLM-L6-v2 "The cat sat on the mat." '
            "--depth 3 --formats fp8_e4m3,mxfp8,nvfp4,int8 --stats-only -o formats.safetensors",
            "modeltap report formats.safetensors -o formats.html",
        ),
        chart="formats-sqnr",
    ),
    "diff": Shot(
        "diff_page",
        (
            'modeltap dump models/all-MiniLM-L6-v2 "hello world" -o minilm.safetensors',
            'modeltap dump ./minilm-fault "hello world" -o minilm-fault.safetensors',
            "modeltap diff minilm-fault.safetensors minilm.safetensors --html diff.html",
        ),
    ),
    "compare": Shot(
        "compare_page",
        (
            'modeltap compare models/all-MiniLM-L6-v2 "hello world" --against bf16 '
            "--html compare.html",
        ),
    ),
    "generation": Shot(
        "generation_page",
        (
            f'modeltap generate ./tiny-gpt2 "{PROMPT}" --max-new-tokens 6 -o gen.safetensors',
            "modeltap report gen.safetensors -o generation.html",
        ),
    ),
    "compare-generate": Shot(
        "compare_generate_page",
        (
            f'modeltap compare ./tiny-gpt2 ./tiny-gpt2-fault "{PROMPT}" --generate 6 --out-dir cg',
            "modeltap report cg/report.json -o compare-generate.html",
        ),
    ),
    "run": Shot("run_page", ("modeltap report runs/exp3 -o run.html",)),
}


def write_pages(names: list[str], folder: Path) -> dict[str, Path]:
    """Run each page's commands in `folder`; page name -> the HTML file written."""
    import readme_examples

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "models").symlink_to(ROOT / "models")
    pages = {}
    for name in names:
        for command in PAGES[name].commands:
            lines, code = readme_examples.run(command, folder)
            if code not in (0, 1):  # 1: a diff or compare that found a difference, page written
                raise SystemExit(f"screenshots: `{command}` failed ({code}):\n" + "\n".join(lines))
        pages[name] = folder / f"{name}.html"
        if not pages[name].is_file():
            raise SystemExit(f"screenshots: `{PAGES[name].commands[-1]}` wrote no {name}.html")
    return pages


def take(pages: dict[str, Path], out: Path) -> list[Path]:
    """Open each page in headless Chromium and save what a 1280×900 window shows."""
    from playwright.sync_api import sync_playwright
    from tests.fixtures.browser import ARGS, CHROMIUM, OpenPage

    out.mkdir(parents=True, exist_ok=True)
    written = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for name, html in pages.items():
            page = OpenPage(browser, html)
            if PAGES[name].chart:  # its section's heading at the top of the window
                page.page.evaluate(
                    f"document.getElementById('{PAGES[name].chart}').scrollIntoView();"
                    "window.scrollBy(0, -130)"
                )
            if page.errors:
                raise SystemExit(f"screenshots: {name}.html logged {page.errors}")
            page.page.wait_for_timeout(300)  # plotly's transitions
            written.append(out / f"report-{name}.png")
            page.page.screenshot(path=str(written[-1]))
            page.close()
        browser.close()
    return written


def main() -> int:
    args = sys.argv[1:]
    if {"-h", "--help"} & set(args):
        print(__doc__.split("\n\n")[2])
        return 0
    out = IMAGES
    if "--out" in args:
        at = args.index("--out")
        out = Path(args[at + 1]).resolve()
        del args[at : at + 2]
    unknown = [a for a in args if a not in PAGES]
    if unknown:
        print(f"screenshots: no page {unknown[0]!r}; pages: {', '.join(PAGES)}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        pages = write_pages(args or list(PAGES), Path(folder))
        written = take(pages, out)
    for path in written:
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    print(f"{len(written)} screenshots in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The documentation site: a page per command, reached from `--help`, its options table made from
the declarations, and `mkdocs build --strict` clean (no broken link or reference)."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from modeltap.cli import app
from modeltap.cli.app import COMMANDS
from modeltap.cli.options import option_table
from tests.conftest import ROOT

DOCS = ROOT / "docs"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_ends_with_the_commands_page_which_tables_its_options(name):
    help_text = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "80"}).stdout
    assert help_text.splitlines()[-1] == f"Docs: docs/commands/{name}.md"
    page = (DOCS / "commands" / f"{name}.md").read_text(encoding="utf-8")
    assert f"<!-- options: {name} -->" in page


def test_help_names_the_docs_index():
    help_text = CliRunner().invoke(app, ["--help"]).stdout
    assert "Docs: docs/index.md" in help_text.splitlines()[-1]
    assert (DOCS / "index.md").is_file()


def test_the_hook_puts_the_declared_options_on_the_page():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = "# modeltap ls\n\n<!-- options: ls -->\n\nmore\n"
    made = hooks.on_page_markdown(page, page=None, config=None, files=None)
    assert made == "# modeltap ls\n\n" + option_table("ls") + "\nmore\n"
    assert "`--no-cache`" in made  # an option of ls alone


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None, reason="the docs extra is not installed"
)
def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "commands" / "dump" / "index.html").is_file()


def test_the_record_page_tables_and_explains_every_keyword():
    """record's keywords come from RecordOptions: the hook tables each one, and the page's
    prose names each (a new keyword without a word on the page fails here)."""
    import dataclasses

    from modeltap.record.options import RecordOptions

    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = (DOCS / "commands" / "record.md").read_text(encoding="utf-8")
    assert "<!-- record-options -->" in page
    table = hooks.on_page_markdown("<!-- record-options -->", page=None)
    names = [f.name for f in dataclasses.fields(RecordOptions)]
    assert re.findall(r"^\| `(\w+)` \|", table, re.M) == names
    prose = page.replace("<!-- record-options -->", "")
    assert [n for n in names if f"`{n}`" not in prose] == []


def _screenshots():
    path = ROOT / "scripts" / "screenshots.py"
    spec = importlib.util.spec_from_file_location("screenshots", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_every_picture_a_page_shows_is_there_and_every_report_page_is_pictured():
    """Each image a docs page links exists; the report screenshots shown are those
    scripts/screenshots.py takes, one per page builder of render/report (a new kind of page
    without its picture fails here)."""
    shown = set()
    for page in DOCS.rglob("*.md"):
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            path = (page.parent / target).resolve()
            assert path.is_file(), f"{page.relative_to(ROOT)} shows {target}, which is not there"
            shown.add(path)
    pages = _screenshots().PAGES
    images = {(DOCS / "images" / f"report-{name}.png").resolve() for name in pages}
    assert images <= shown, sorted(p.name for p in images - shown)
    source = "\n".join(p.read_text() for p in (ROOT / "src/modeltap/render/report").glob("*.py"))
    # the builders: a page from what it shows (write_page writes any of them)
    builders = set(re.findall(r"^def ([a-z]\w*_page)\(", source, re.M)) - {"write_page"}
    assert builders == {shot.builder for shot in pages.values()}


@pytest.mark.slow
def test_the_screenshot_script_writes_a_page_and_pictures_it(tmp_path):
    from tests.fixtures.browser import CHROMIUM, _unavailable

    if importlib.util.find_spec("playwright") is None or not os.path.isfile(CHROMIUM):
        _unavailable("no Chromium or playwright for the screenshots")
    if not (ROOT / "models" / "all-MiniLM-L6-v2" / "model.safetensors").is_file():
        pytest.skip("the real MiniLM is not unpacked; run scripts/setup.sh")
    shots = _screenshots()
    pages = shots.write_pages(["dump"], tmp_path / "pages")
    assert "modeltap dump: models/all-MiniLM-L6-v2" in pages["dump"].read_text()
    (png,) = shots.take(pages, tmp_path / "images")
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(header[16:20], "big") == 1280  # the window's width

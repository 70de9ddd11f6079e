"""Writing a page: the target checked before any work, the command line for its footer, the page
rendered and written whole or not at all; and `report`, the verb that writes one input's page."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any


def check_html_target(path: Path, option: str = "--html") -> None:
    """Before any work: the report extra is installed and `path` can be written."""
    from modeltap.dump import check_writable
    from modeltap.render.report import require

    require()
    check_writable(path, option)


def invocation(command: str, args: list[str]) -> str:
    """The command line that made a page, for its footer: the real one when run as `modeltap`,
    else the command and its arguments as this process received them."""
    if Path(sys.argv[0]).name in ("modeltap", "__main__.py"):
        return shlex.join(["modeltap", *sys.argv[1:]])
    return shlex.join(["modeltap", command, *args])


def write_html(path: Path, page: Any) -> Path:
    """Render `page` and write it atomically (a failure leaves nothing at `path`)."""
    from modeltap.render.report import render, write_page

    return write_page(path, render(page))


def report(source: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """`modeltap.report(source, out)`: write the HTML page of a dump, a `compare --json` report
    (.json) or a run folder of `modeltap.record` to `out` (default: `<source name>.html`, here);
    returns the path. Two dumps' diff: `modeltap report A B`."""
    first = Path(source)
    target = Path(out) if out is not None else Path(first.resolve().name + ".html")
    check_html_target(target, "out=")
    return write_html(target, page_of(first, invocation("report", [str(first), "-o", str(target)])))


def page_of(source: Path, command: str) -> Any:
    """The page of one input of `modeltap report`: a run folder, a compare .json or a dump."""
    if source.is_dir():
        from modeltap.record.index import read_run
        from modeltap.render.report import run_page

        return run_page(read_run(source), command=command)
    if source.suffix == ".json":
        from modeltap.errors import InputError
        from modeltap.render.report import compare_page, read_compare_json
        from modeltap.render.report.compare_page import GENERATE_SCHEMA, compare_generate_page

        if not source.is_file():
            raise InputError(f"no file '{source}'; check the path")
        data = read_compare_json(source)
        build = compare_generate_page if data.get("schema") == GENERATE_SCHEMA else compare_page
        return build(data, command=command)
    from modeltap.dump import load_dump
    from modeltap.render.report import dump_page

    return dump_page(load_dump(source), command=command)

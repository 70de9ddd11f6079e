"""Writing a page: the target checked before any work, the command line for its footer, the page
rendered and written whole or not at all."""

from __future__ import annotations

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

"""MkDocs hook: a command page's `<!-- options: NAME -->` line becomes `modeltap NAME`'s options
table, made from the option declarations as `--help` lists them (`cli.options.option_table`), so
a page can't miss an option or name one that went away."""

from __future__ import annotations

import re
from typing import Any

_MARKER = re.compile(r"^<!-- options: (\w+) -->$", re.M)


def on_page_markdown(markdown: str, **_: Any) -> str:
    from modeltap.cli.options import option_table

    return _MARKER.sub(lambda m: option_table(m.group(1)).rstrip("\n"), markdown)

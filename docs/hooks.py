"""MkDocs hook: a command page's `<!-- options: NAME -->` line becomes `modeltap NAME`'s options
table, made from the option declarations as `--help` lists them (`cli.options.option_table`), so
a page can't miss an option or name one that went away. `<!-- record-options -->` becomes the
table of `modeltap.record`'s keywords, from the fields of `RecordOptions`."""

from __future__ import annotations

import re
from typing import Any

_MARKER = re.compile(r"^<!-- options: (\w+) -->$", re.M)
_RECORD = "<!-- record-options -->"


def record_options_table() -> str:
    """`record(model, out_dir, **options)`'s keywords: the fields of RecordOptions, in order."""
    import dataclasses

    from modeltap.record.options import RecordOptions

    lines = ["| keyword | type | default |", "|---|---|---|"]
    for field in dataclasses.fields(RecordOptions):
        # a | inside backticks does not split the cell (Python-Markdown's tables)
        lines.append(f"| `{field.name}` | `{field.type}` | `{field.default!r}` |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, **_: Any) -> str:
    from modeltap.cli.options import option_table

    if _RECORD in markdown:
        markdown = markdown.replace(_RECORD, record_options_table())
    return _MARKER.sub(lambda m: option_table(m.group(1)).rstrip("\n"), markdown)

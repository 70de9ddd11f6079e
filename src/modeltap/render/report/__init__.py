"""HTML reports: one self-contained page (plotly.js, styles and data inline) for a dump, a diff,
a compare or a recorded run. Builders return a `Page`; `render` makes it HTML; only cli/ writes.

Needs the `report` extra (plotly; Jinja2 comes with transformers): `pip install modeltap[report]`.
"""

from __future__ import annotations

from modeltap.errors import InputError


def require() -> None:
    """Fail with the fix when the report extra is missing."""
    import importlib.util

    missing = [m for m in ("plotly", "jinja2") if importlib.util.find_spec(m) is None]
    if missing:
        raise InputError(
            f"`modeltap report` needs {' and '.join(missing)}; install the extra: "
            "pip install 'modeltap[report]' (or run scripts/setup.sh)"
        )


from modeltap.render.report.compare_page import (  # noqa: E402 - after require, which needs none
    COMPARE_SCHEMA,
    compare_page,
    read_compare_json,
)
from modeltap.render.report.diff_page import diff_page  # noqa: E402
from modeltap.render.report.dump_page import dump_page  # noqa: E402
from modeltap.render.report.page import Page, Section, render, write_page  # noqa: E402
from modeltap.render.report.run_page import run_page  # noqa: E402

__all__ = [
    "COMPARE_SCHEMA",
    "Page",
    "Section",
    "compare_page",
    "diff_page",
    "dump_page",
    "read_compare_json",
    "render",
    "require",
    "run_page",
    "write_page",
]

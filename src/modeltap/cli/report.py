"""`modeltap report`: one self-contained HTML page of a dump, a diff, a compare or a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from modeltap.cli.app import app, handle_errors
from modeltap.cli.options import DIFF, as_settings, command
from modeltap.cli.printing import write_html
from modeltap.config.declare import CliOption
from modeltap.errors import InputError

INPUTS = CliOption(
    argument=True,
    help="A dump; two dumps A B (a diff, with the options of `modeltap diff`); a "
    "`compare --json` report (.json); or a run folder written by modeltap.record.",
    metavar="INPUT...",
    show_default=False,
    type=list[Path],
    required=True,
)


@app.command("report")
@handle_errors
@command(
    "report",
    ("inputs", INPUTS),
    "out",
    *DIFF,
    "config",
    settings=False,  # read only for a diff page, as `modeltap diff` reads them
)
def report_command(
    *, inputs: list[Path], out: Path | None, config: Path | None, **diff_options: Any
) -> None:
    """Write one self-contained HTML page (opens offline) of a dump, a diff, a compare or a run."""
    if len(inputs) > 2:
        raise InputError(
            f"{len(inputs)} inputs; give one (a dump, a compare .json or a run folder) or two "
            "dumps to diff"
        )
    from modeltap.render.report.write import check_html_target, invocation

    first = inputs[0]
    target = out or Path(first.resolve().name + ".html")
    check_html_target(target, "-o/--out")
    command = invocation("report", [str(p) for p in inputs] + ["-o", str(target)])
    if len(inputs) == 2:
        page = _diff_page(
            inputs[0], inputs[1], command, config=config, **as_settings("report", diff_options)
        )
    else:
        from modeltap.render.report.write import page_of

        page = page_of(first, command)
    write_html(target, page)


def _diff_page(a: Path, b: Path, command: str, *, config: Path | None, **flags: Any) -> Any:
    from modeltap.diff.from_settings import diff_report, diff_settings
    from modeltap.render.report import diff_page

    s, values = diff_settings(config, **flags)
    report = diff_report(a, b, s, values)
    if not report.pairs:
        raise InputError(
            f"'{a}' and '{b}' have no key in common; check that they come from the same "
            "model, or match names with --map OLD=NEW"
        )
    return diff_page(report, command=command)

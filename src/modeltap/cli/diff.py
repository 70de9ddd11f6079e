"""`modeltap diff`: compare two dumps, exit 0 within tolerance and 1 beyond."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from modeltap.cli.app import app, given, handle_errors, refuse, stdout, write_atomically
from modeltap.cli.options import DIFF, Given, command
from modeltap.config import Settings
from modeltap.config.declare import path_argument
from modeltap.diff.from_settings import diff_report, diff_tolerances
from modeltap.errors import InputError

A = path_argument("First dump, e.g. the candidate.", "A")
B = path_argument("Second dump; rtol is relative to |B|, as torch.allclose(A, B).", "B")


@app.command("diff")
@handle_errors
@command(
    "diff",
    ("a", A),
    ("b", B),
    *DIFF,
    "show_all",
    "json_out",
    "junit",
    "html",
    "config",
    apart=("atol", "rtol"),  # over the preset
)
def diff_command(
    s: Settings,
    flags: Given,
    *,
    a: Path,
    b: Path,
    show_all: bool,
    json_out: bool,
    junit: Path | None,
    html: Path | None,
) -> None:
    """Compare two dumps, or two run folders of modeltap.record step by step; exit 0 when every
    tensor is within tolerance, 1 when not."""
    from modeltap.diff.dumps import junit_xml
    from modeltap.diff.tolerance import Tolerance
    from modeltap.dump import check_writable

    if a.is_dir() or b.is_dir():
        refuse(
            given(junit=junit, html=html)
            + flags.flags("strict", "upcast", "equal_nan", "map_", "include", "exclude"),
            "can't apply to run folders (their steps are compared by statistics first)",
        )
        return _diff_runs(a, b, s, flags, show_all, json_out)

    values = diff_tolerances(s, atol=flags["atol"], rtol=flags["rtol"], upcast=flags["upcast"])
    if junit is not None:
        check_writable(junit, "--junit")
    if html is not None:
        from modeltap.render.report.write import check_html_target

        check_html_target(html)
    overrides = [(glob, Tolerance(**{**values, **tol})) for glob, tol in s.overrides.items()]
    from modeltap.diff.generations import is_generation

    if is_generation(a) or is_generation(b):
        passed = _print_generation_diff(
            a, b, s, Tolerance(**values), overrides, json_out=json_out, show_all=show_all,
            junit=junit, html=html,
        )  # fmt: skip
        raise typer.Exit(0 if passed else 1)
    report = diff_report(a, b, s, values)
    if junit is not None:
        write_atomically(junit, junit_xml(report))
    if html is not None:
        from modeltap.cli.printing import write_html
        from modeltap.render.report import diff_page
        from modeltap.render.report.write import invocation

        command = invocation("diff", [str(a), str(b), "--html", str(html)])
        write_html(html, diff_page(report, command=command))
    from modeltap.cli.printing import print_report
    from modeltap.render import diff_heading, diff_table

    print_report(report, diff_heading, diff_table, json_out=json_out, show_all=show_all)
    raise typer.Exit(0 if report.passed else 1)


def _diff_runs(
    a: Path, b: Path, s: Settings, flags: Given, show_all: bool, json_out: bool
) -> None:
    from modeltap.diff.runs import diff_runs
    from modeltap.diff.tolerance import Tolerance
    from modeltap.errors import InputError

    if not (a.is_dir() and b.is_dir()):
        raise InputError("give two run folders (or two dump files), not one of each")
    values = diff_tolerances(s, atol=flags["atol"], rtol=flags["rtol"], upcast=None)
    report = diff_runs(a, b, tolerance=Tolerance(**values))
    if json_out:
        print(json.dumps(report.to_json(), indent=1))
    else:
        from modeltap.render import run_diff_text

        stdout().print(run_diff_text(report, show_all=show_all))
    raise typer.Exit(0 if report.passed else 1)


def _print_generation_diff(
    a: Path,
    b: Path,
    s: Settings,
    tolerance: Any,
    overrides: Any,
    *,
    json_out: bool,
    show_all: bool,
    junit: Path | None,
    html: Path | None = None,
) -> bool:
    """`modeltap diff` of two generation dumps: the token split and each common step."""
    import json

    from modeltap.diff.generations import diff_generations

    unsupported = [
        flag
        for flag, given in (
            ("--map", s.map), ("--include", s.include), ("--exclude", s.exclude),
            ("--strict", s.strict), ("--junit", junit), ("--html", html),
        )
        if given
    ]  # fmt: skip
    if unsupported:
        raise InputError(
            f"{unsupported[0]} is for one-forward dumps; diff generation dumps without it, or "
            "one step of each with `modeltap show FILE --step K`"
        )
    report = diff_generations(
        a, b, tolerance=tolerance, overrides=overrides, equal_nan=s.equal_nan, upcast=s.upcast
    )
    if json_out:
        print(json.dumps(report.to_json(), indent=1))
        return report.passed
    from modeltap.render.generation import generation_diff_heading, generation_diff_table

    console = stdout()
    console.print(generation_diff_heading(report))
    console.print(generation_diff_table(report, show_all=show_all))
    return report.passed

"""What several commands print the same way: a dump's tree (dump, grads, show), a generation
(generate, show), a note on stderr, a written HTML page (diff, compare, report), a report's heading
and table (diff, compare)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modeltap.cli.app import stderr, stdout


def note(message: str) -> None:
    """One line for the user on stderr, as written (no markup; wrapped by the terminal)."""
    stderr().print(message, markup=False, highlight=False, soft_wrap=True)


def print_opened(opened: Any, *, json_out: bool) -> None:
    """A dump's heading and tree of statistics (gradients' too), or its JSON."""
    from modeltap.render import (
        activation_keys,
        dump_heading,
        dump_json,
        dump_table,
        grad_meta,
        grads_heading,
        grads_table,
    )

    if json_out:
        print(json.dumps(dump_json(opened), indent=1))
        return
    console = stdout()
    console.print(dump_heading(opened))
    if activation_keys(opened):
        console.print(dump_table(opened, width=console.width))
    if grad_meta(opened) is not None:
        console.print(grads_heading(opened))
        console.print(grads_table(opened, width=console.width))


def print_generation(opened: Any, *, step: int | None, json_out: bool) -> None:
    """A generation dump: the prompt, the text and each step's token; with `step`, its tree."""
    from modeltap.generate import generation_meta, step_view

    if step is not None:
        view = step_view(opened, step)
        if not json_out:
            stdout().print(f"{opened.path.name}: decoding step {step}", style="bold")
        print_opened(view, json_out=json_out)
        return
    from modeltap.render.generation import generation_heading, generation_json, generation_table

    gen = generation_meta(opened)
    if json_out:
        print(json.dumps(generation_json(opened, gen), indent=1))
        return
    console = stdout()
    console.print(generation_heading(opened, gen))
    console.print(generation_table(gen))
    console.print("`modeltap show FILE --step K` shows step K's tree", style="dim")


def write_html(path: Path, page: Any) -> None:
    """Render and write a page atomically (a failure leaves nothing at `path`), and say so on
    stderr (stdout may hold --json)."""
    from modeltap.render.report.write import write_html as write

    write(path, page)
    stderr().print(f"wrote {path}", highlight=False, soft_wrap=True)


def print_report(report: Any, heading: Any, table: Any, *, json_out: bool, show_all: bool) -> None:
    """A diff's or a compare's report on stdout: its JSON, or `heading(report)` then
    `table(report, ...)` where the table has rows."""
    if json_out:
        print(json.dumps(report.to_json(), indent=1))
        return
    console = stdout()
    console.print(heading(report))
    rows = table(report, show_all=show_all, width=console.width)
    if rows.row_count:
        console.print(rows)

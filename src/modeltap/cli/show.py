"""`modeltap show`: a dump's tree of statistics, from the file alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from modeltap.cli.app import app, handle_errors, stderr, stdout
from modeltap.cli.options import (
    JsonOpt,
)


@app.command()
@handle_errors
def show(
    file: Annotated[
        Path,
        typer.Argument(help="A dump written by modeltap (or any safetensors).", metavar="FILE"),
    ],
    json_out: JsonOpt = False,
) -> None:
    """Print a dump's tree of statistics again, from the file alone."""
    from modeltap.dump import load_dump

    opened = load_dump(file)
    if not opened.is_modeltap:
        stderr().print("no modeltap metadata: computing statistics from the tensors")
        from modeltap.stats import tensor_stats

        opened.stats = {k: tensor_stats(opened[k]) for k in opened.stored}
    print_opened(opened, json_out=json_out)


def print_opened(opened: Any, *, json_out: bool) -> None:
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

"""`modeltap show`: a dump's tree of statistics, or a recorded run's trends, from files alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modeltap.cli.app import app, handle_errors, stderr, stdout
from modeltap.cli.options import command
from modeltap.cli.printing import print_generation, print_opened
from modeltap.config.declare import CliOption, path_argument
from modeltap.errors import InputError

PATH = path_argument(
    "A dump written by modeltap (or any safetensors), or a run folder of modeltap.record.", "PATH"
)
STEP = CliOption(
    help="Run folder: show this recorded step's tree; generation dump: this decoding step's "
    "tree (0: the prompt's forward).",
    metavar="N",
    type=int | None,
)
RANK = CliOption(help="Run folder: the rank to show.", metavar="R", type=int, default=0)


@app.command()
@handle_errors
@command("show", ("file", PATH), ("step", STEP), ("rank", RANK), "json_out", settings=False)
def show(*, file: Path, step: int | None, rank: int, json_out: bool) -> None:
    """Print a dump's tree of statistics, or a recorded run's trends over its steps."""
    from modeltap.dump import load_dump

    if file.is_dir():
        from modeltap.record.index import read_run

        run = read_run(file)
        if step is not None:
            file = run.step_file(step, rank)
            if not json_out:
                world = run.ranks[rank].start.get("world_size", "?")
                stdout().print(f"{file.name}: step {step}, rank {rank} of {world}", style="bold")
            opened = load_dump(file)
        else:
            print_run(run, rank=rank, json_out=json_out)
            return
    else:
        opened = load_dump(file)
        if "generate" in opened.metadata and rank == 0:
            print_generation(opened, step=step, json_out=json_out)
            return
        if step is not None or rank != 0:
            raise InputError(
                "--step is for a run folder or a generation dump, --rank for a run folder; "
                "give the folder, not a file"
            )
    if not opened.is_modeltap:
        stderr().print("no modeltap metadata: computing statistics from the tensors")
        from modeltap.stats import tensor_stats

        opened.stats = {k: tensor_stats(opened[k]) for k in opened.stored}
    print_opened(opened, json_out=json_out)


def print_run(run: Any, *, rank: int, json_out: bool) -> None:
    from modeltap.render import run_heading, run_json, run_table

    if rank not in run.ranks:
        raise InputError(
            f"no rank {rank} in '{run.folder}'; ranks: {', '.join(map(str, run.ranks))}"
        )
    if json_out:
        print(json.dumps(run_json(run), indent=1))
        return
    console = stdout()
    console.print(run_heading(run, rank))
    console.print(run_table(run, rank, width=console.width))

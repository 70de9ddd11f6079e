"""`modeltap replay`: re-run the module that made a recorded run's NaN/Inf, from its step file."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from modeltap.cli.app import app, handle_errors, stdout
from modeltap.cli.options import command
from modeltap.config.declare import CliOption, path_argument
from modeltap.errors import InputError


@app.command()
@handle_errors
@command(
    "replay",
    (
        "run_dir",
        path_argument("A run folder of modeltap.record.", "RUN_DIR"),
    ),
    "model",
    (
        "step",
        CliOption(help="The step whose trip to replay.", metavar="N", type=int, required=True),
    ),
    ("rank", CliOption(help="The rank that tripped.", metavar="R", type=int, default=0)),
    "model_class",
    "revision",
    "trust_remote_code",
    "json_out",
    settings=False,
)
def replay(
    *,
    run_dir: Path,
    model: str,
    step: int,
    rank: int,
    model_class: str | None,
    revision: str | None,
    trust_remote_code: bool | None,
    json_out: bool,
) -> None:
    """Re-run, alone, the module that produced a recorded run's first NaN/Inf (a forward trip
    recorded with flight=True or on_nonfinite="dump"), and show whether it comes back. Exit 0
    when it does, 1 when it does not."""
    from modeltap.dump import load_dump
    from modeltap.loading.factory import is_factory, load_factory
    from modeltap.record.flight_replay import replay as run_replay
    from modeltap.record.index import read_run

    path = read_run(run_dir).step_file(step, rank)  # before loading anything
    meta = load_dump(path).metadata
    if "flight" not in meta and "tripwire" not in meta:
        raise InputError(
            f"step {step} of '{run_dir}' did not trip; replay takes a step whose file holds a "
            "trip (`modeltap show RUN_DIR` lists them)"
        )
    if is_factory(model):
        module = load_factory(model).module
    else:
        from modeltap.loading.hf import load_model

        recorded = meta.get("model_class", "")
        name = model_class or (recorded if _is_transformers_class(recorded) else "AutoModel")
        module = load_model(
            model,
            revision=revision,
            model_class_name=name,
            trust_remote_code=bool(trust_remote_code),
            allow_missing_weights=True,  # the step file's weights replace them
        ).model
    result = run_replay(run_dir, module, step=step, rank=rank)
    if json_out:
        print(json.dumps(result.to_json(), indent=1))
    else:
        out = stdout()
        verdict = "REPRODUCED" if result.reproduced else "NOT REPRODUCED"
        out.print(
            f"[bold {'red' if result.reproduced else 'yellow'}]{verdict}[/]  step {step} rank "
            f"{rank}: module '{result.module}' ({result.module_class}) re-run alone from "
            f"{result.file.name}"
        )
        again, before = result.replayed, result.recorded
        out.print(
            f"output {result.output}: {again['nan']} NaN / {again['inf']} Inf on replay, "
            f"{before['nan']} NaN / {before['inf']} Inf recorded"
            + (f"; first at {', '.join(map(str, result.positions))}" if result.positions else "")
        )
        if result.note:
            out.print(result.note)
        for title, table in (("inputs", result.inputs), ("parameters", result.params)):
            for key, s in table.items():
                bad = f"{s['nan']} NaN / {s['inf']} Inf" if s["nan"] or s["inf"] else "finite"
                out.print(
                    f"  {title[:-1]} {key}: {'×'.join(map(str, s['shape']))} {s['dtype']}, "
                    f"{bad}, absmax {s['absmax']:.4g}"
                    if s["absmax"] is not None
                    else f"  {title[:-1]} {key}: {bad}"
                )
    if not result.reproduced:
        raise typer.Exit(1)


def _is_transformers_class(name: str) -> bool:
    import transformers

    return bool(name) and hasattr(getattr(transformers, name, None), "from_pretrained")

"""`modeltap export`: a torch.export `.pt2` that keeps every module's call signature, or a
TorchScript trace (`.pt`) that keeps the record of every module's output structure."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from modeltap.cli.app import app, given, handle_errors, refuse, settings, stderr
from modeltap.cli.inputs import command_name, offered_flags
from modeltap.cli.options import (
    OUTPUT,
    AllowMissingWeightsOpt,
    ConfigOpt,
    ExportModelArg,
    InputFileOpt,
    ModelClassOpt,
    RevisionOpt,
    TextArg,
    TokenizerOpt,
    TrustOpt,
)
from modeltap.cli.printing import note
from modeltap.errors import InputError


@app.command("export")
@handle_errors
def export(
    model: ExportModelArg = None,
    text: TextArg = None,
    input_file: InputFileOpt = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Archive: .pt2 (torch.export) or .pt (a TorchScript trace) "
            "[default: <model name>.pt2].",
            metavar="FILE",
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    dynamic: Annotated[
        bool | None,
        typer.Option(
            "--dynamic/--static",
            help=".pt2: dynamic batch and sequence dims (a batch of one is exported as two, "
            "so that it stays dynamic) [default: dynamic].",
            rich_help_panel=OUTPUT,
        ),
    ] = None,
    revision: RevisionOpt = None,
    model_class: ModelClassOpt = None,
    tokenizer: TokenizerOpt = None,
    trust_remote_code: TrustOpt = None,
    allow_missing_weights: AllowMissingWeightsOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Export a model (torch.export .pt2, or a TorchScript trace .pt) that `modeltap dump` reads
    with the eager keys."""
    s = settings(
        "export",
        config,
        model=model,
        texts=text or [],
        input_file=str(input_file) if input_file else None,
        out=str(out) if out else None,
        dynamic=dynamic,
        revision=revision,
        model_class=model_class,
        tokenizer=tokenizer,
        trust_remote_code=trust_remote_code,
        allow_missing_weights=allow_missing_weights,
    )
    if not s.model:
        raise InputError("no MODEL given; pass one, or set `model` in modeltap.toml")
    from modeltap.exporting import export as export_model
    from modeltap.exporting import is_trace
    from modeltap.loading.archive import is_archive_path

    if is_archive_path(s.model):
        raise InputError(
            f"'{s.model}' is an archive already; export the Hugging Face model or the "
            "pkg.module:factory it was made from"
        )
    if s.texts and s.input_file:
        raise InputError("give TEXT or --input-file, not both")
    from modeltap.loading.factory import is_factory

    factory = is_factory(s.model)
    if factory:
        refuse(
            given(revision=revision, model_class=model_class),
            f"can't apply to '{s.model}', a factory (they load Hugging Face models)",
        )
    if not s.texts and not s.input_file and not factory:
        raise InputError("torch.export traces one run: give TEXT or --input-file")
    path = Path(s.out) if s.out else Path(f"{Path(s.model.rstrip('/')).name or 'model'}.pt2")
    traced = is_trace(path)
    if traced:
        refuse(
            [] if dynamic is None else ["--dynamic" if dynamic else "--static"],
            "can't apply to a TorchScript trace (its shapes are what the tracer saw)",
            "drop {flags}, or write a .pt2",
        )
    from modeltap.dump import check_writable
    from modeltap.loading.resolve import resolve

    check_writable(path)
    err = stderr()
    with err.status(f"loading {s.model}"):
        resolved = resolve(
            s, command=f"modeltap {command_name()}", offered=offered_flags(), note=note
        )
    if resolved.backend is not None:
        raise InputError(f"'{s.model}' is already a graph; export its nn.Module instead")
    done = export_model(
        resolved.loaded.model, resolved.inputs, path, dynamic=s.dynamic, note=err.print,
        status=err.status,
    )  # fmt: skip
    if done.traced:
        if done.constants:
            err.print(
                f"note: torch.jit.trace took {len(done.constants)} Python value(s) computed from "
                "the inputs as constants; inputs of other shapes may not fit the trace"
            )
        err.print(
            f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, TorchScript trace with the "
            "modules' output structure)"
        )
        return
    err.print(
        f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {done.signatures} module signatures, "
        f"{done.shapes})"
    )

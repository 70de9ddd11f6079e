"""`modeltap export`: a torch.export `.pt2` that keeps every module's call signature, or a
TorchScript trace (`.pt`) that keeps the record of every module's output structure."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from modeltap.cli.app import app, handle_errors, refuse, stderr
from modeltap.cli.inputs import command_name, offered_flags
from modeltap.cli.options import LOAD, Given, command
from modeltap.cli.printing import note
from modeltap.errors import InputError

if TYPE_CHECKING:
    from modeltap.config import Settings


@app.command("export")
@handle_errors
@command(
    "export",
    "model",
    "sentences",
    "input_file",
    "out",
    "dynamic",
    *LOAD,
    "config",
)
def export(s: Settings, given: Given) -> None:
    """Export a model (torch.export .pt2, or a TorchScript trace .pt) that `modeltap dump` reads
    with the eager keys."""
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
            given.flags("revision", "model_class"),
            f"can't apply to '{s.model}', a factory (they load Hugging Face models)",
        )
    if not s.texts and not s.input_file and not factory:
        raise InputError("torch.export traces one run: give TEXT or --input-file")
    path = Path(s.out) if s.out else Path(f"{Path(s.model.rstrip('/')).name or 'model'}.pt2")
    traced = is_trace(path)
    if traced:
        refuse(
            [] if given["dynamic"] is None else ["--dynamic" if s.dynamic else "--static"],
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

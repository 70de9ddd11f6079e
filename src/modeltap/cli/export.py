"""`modeltap export`: a torch.export `.pt2` that keeps every module's call signature, or a
TorchScript trace (`.pt`) that keeps the record of every module's output structure."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from modeltap.cli.app import app, given, handle_errors, refuse, settings, stderr
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
from modeltap.errors import InputError, first_line


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
    from modeltap.loading.archive import TORCHSCRIPT_SUFFIXES, is_archive_path

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
    traced = path.suffix in TORCHSCRIPT_SUFFIXES
    if path.suffix != ".pt2" and not traced:
        raise InputError(
            f"'{path}' must end in .pt2 (torch.export's archive) or .pt (a TorchScript trace)"
        )
    if traced:
        refuse(
            [] if dynamic is None else ["--dynamic" if dynamic else "--static"],
            "can't apply to a TorchScript trace (its shapes are what the tracer saw)",
            "drop {flags}, or write a .pt2",
        )
    from modeltap.dump import check_writable

    check_writable(path)
    err = stderr()
    with err.status(f"loading {s.model}"):
        if factory:
            from modeltap.cli.dump import _load_transformed

            loaded, inputs_, _, backend = _load_transformed(s)
            if backend is not None:
                raise InputError(f"'{s.model}' is already a graph; export its nn.Module instead")
        else:
            from modeltap.cli.dump import _load_with_inputs

            loaded, inputs_, _ = _load_with_inputs(s)
    net = loaded.model
    config_ = getattr(net, "config", None)
    if getattr(config_, "use_cache", False):
        config_.use_cache = False  # a cache object in the output can't be exported
        err.print("note: exporting with use_cache=False")
    import torch

    if traced:
        from modeltap.capture.torchscript import save_traced

        def trace(tmp: Path) -> list[str]:
            try:
                return save_traced(net, inputs_.args, inputs_.kwargs, tmp)
            except OSError:  # writing the archive, not tracing (a full disk is one line)
                raise
            except Exception as exc:  # tracing raises many kinds
                raise InputError(
                    f"torch.jit.trace can't trace {loaded.model_class}: {first_line(exc)}; "
                    "export it to a .pt2 instead (MODELTAP_DEBUG=1 shows why)"
                ) from exc

        with err.status(f"tracing {loaded.model_class}"):
            caught = _saved(path, trace)
        if caught:
            err.print(
                f"note: torch.jit.trace took {len(caught)} Python value(s) computed from the "
                "inputs as constants; inputs of other shapes may not fit the trace"
            )
        err.print(
            f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, TorchScript trace with the "
            "modules' output structure)"
        )
        return
    from modeltap.capture.export import export_program

    with err.status(f"exporting {loaded.model_class}"):
        program = export_program(net, inputs_.args, inputs_.kwargs, dynamic=s.dynamic)
    from modeltap.capture.export import MODULES_FILE, describe_shapes, module_classes

    classes = json.dumps(module_classes(net))
    _saved(
        path, lambda tmp: torch.export.save(program, str(tmp), extra_files={MODULES_FILE: classes})
    )
    signatures = sum(1 for e in program.module_call_graph if e.signature is not None)
    err.print(
        f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {signatures} module signatures, "
        f"{describe_shapes(program)})"
    )


def _saved(path: Path, save: Callable[[Path], Any]) -> Any:
    """`save(tmp)` into a hidden file beside `path`, moved into place only when it succeeded and
    removed on any failure. The name keeps `path`'s suffix: torch.export.save wants `.pt2`."""
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        result = save(tmp)
        os.replace(tmp, path)
        return result
    finally:
        tmp.unlink(missing_ok=True)

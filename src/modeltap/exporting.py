"""`modeltap.export`: a model as an archive that `dump` reads with the eager keys: a torch.export
`.pt2` that keeps every module's call signature (and the modules' classes), or a TorchScript trace
(`.pt`) that keeps the record of every module's output structure. Written whole or not at all."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError, first_line
from modeltap.loading.resolve import Status, no_status

if TYPE_CHECKING:
    from torch import nn

    from modeltap.loading import Inputs


@dataclass
class Exported:
    """What `export` wrote: `traced` for a TorchScript trace (with the Python values the tracer
    took as `constants`), else a .pt2 with `signatures` module call signatures and its `shapes`."""

    path: Path
    traced: bool
    constants: list[str] = field(default_factory=list)
    signatures: int = 0
    shapes: str = ""


def is_trace(path: str | os.PathLike[str]) -> bool:
    """True for a TorchScript trace's name (.pt), False for a .pt2; any other name is an error."""
    from modeltap.loading.archive import TORCHSCRIPT_SUFFIXES

    path = Path(path)
    traced = path.suffix in TORCHSCRIPT_SUFFIXES
    if path.suffix != ".pt2" and not traced:
        raise InputError(
            f"'{path}' must end in .pt2 (torch.export's archive) or .pt (a TorchScript trace)"
        )
    return traced


def export(
    model: nn.Module,
    inputs: Inputs | Any,
    path: str | os.PathLike[str],
    *,
    dynamic: bool = True,
    note: Callable[[str], None] | None = None,
    status: Status = no_status,
) -> Exported:
    """Export `model` run on `inputs` (an `Inputs`, a tensor, a tuple of positional arguments or
    a dict of keyword arguments) to `path`: `.pt2` through torch.export (`dynamic`: batch and
    sequence dims), `.pt` through torch.jit.trace. A model whose config caches keys and values is
    exported with use_cache=False (said through `note`)."""
    inputs = _as_inputs(inputs)
    path = Path(path)
    traced = is_trace(path)
    name = type(model).__name__
    config_ = getattr(model, "config", None)
    if getattr(config_, "use_cache", False):
        config_.use_cache = False  # a cache object in the output can't be exported
        if note is not None:
            note("note: exporting with use_cache=False")
    if traced:
        with status(f"tracing {name}"):
            constants = _saved(path, lambda tmp: _trace(model, inputs, tmp, name))
        return Exported(path, True, constants=constants)
    import torch

    from modeltap.capture.export import (
        MODULES_FILE,
        describe_shapes,
        export_program,
        module_classes,
    )

    with status(f"exporting {name}"):
        program = export_program(model, inputs.args, inputs.kwargs, dynamic=dynamic)
    classes = json.dumps(module_classes(model))
    _saved(
        path, lambda tmp: torch.export.save(program, str(tmp), extra_files={MODULES_FILE: classes})
    )
    signatures = sum(1 for e in program.module_call_graph if e.signature is not None)
    return Exported(path, False, signatures=signatures, shapes=describe_shapes(program))


def _as_inputs(inputs: Any) -> Inputs:
    from modeltap.loading import Inputs

    if isinstance(inputs, Inputs):
        return inputs
    if isinstance(inputs, dict):
        return Inputs((), dict(inputs), {})
    return Inputs(tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,), {}, {})


def _trace(model: nn.Module, inputs: Inputs, tmp: Path, name: str) -> list[str]:
    from modeltap.capture.torchscript import save_traced

    try:
        return save_traced(model, inputs.args, inputs.kwargs, tmp)
    except OSError:  # writing the archive, not tracing (a full disk is one line)
        raise
    except Exception as exc:  # tracing raises many kinds
        raise InputError(
            f"torch.jit.trace can't trace {name}: {first_line(exc)}; "
            "export it to a .pt2 instead (MODELTAP_DEBUG=1 shows why)"
        ) from exc


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

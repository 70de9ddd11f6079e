"""Models that are not a Hugging Face id or folder: a `.pt2` / TorchScript archive, or a
`pkg.module:factory` returning a module (and maybe example inputs), each with the backend that runs
it (export, torchscript, fx) when it is not a plain nn.Module."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modeltap.loading.hf import Loaded
    from modeltap.loading.inputs import Inputs


def is_transformed(model: str) -> bool:
    """A .pt2 / TorchScript archive or a `pkg.module:factory`, rather than a Hub id or folder."""
    from modeltap.loading.archive import is_archive_path
    from modeltap.loading.factory import is_factory

    return is_archive_path(model) or is_factory(model)


def load_transformed(
    model_name: str, *, allow_pickle: bool = False
) -> tuple[Loaded, Inputs | None, Any]:
    """(loaded, the example inputs it carries or None, backend or None) for an archive or a
    factory."""
    from modeltap.loading import ModelSource
    from modeltap.loading.archive import ArchiveKind, archive_kind, is_archive_path
    from modeltap.loading.hf import Loaded

    example: Inputs | None = None
    backend: Any = None
    if is_archive_path(model_name):
        path = Path(model_name)
        kind = archive_kind(path)
        if kind is ArchiveKind.export:
            from modeltap.capture.export import ExportBackend, module_names, skeleton
            from modeltap.loading.archive import example_inputs, load_pt2

            program = load_pt2(path, allow_pickle=allow_pickle)
            model = skeleton(module_names(program))
            backend = ExportBackend(program, source=path.name)
            example = example_inputs(program)
            model_class = f"ExportedProgram({_root_class(program)})"
        else:
            from modeltap.capture.torchscript import TorchScriptBackend, script_skeleton
            from modeltap.loading.archive import load_torchscript, torchscript_outputs

            script = load_torchscript(path)
            backend = TorchScriptBackend(
                script, source=path.name, outputs=torchscript_outputs(path)
            )
            model = script_skeleton(script)
            model_class = f"TorchScript({script.original_name})"
        source = ModelSource(model_name, path.parent)
    else:
        from modeltap.loading.factory import load_factory

        made = load_factory(model_name)
        model, example = made.module, made.example
        if made.graph_module:
            from modeltap.capture.fx import FxBackend

            backend = FxBackend()
        model_class = type(model).__name__
        source = ModelSource(model_name, Path.cwd())
    return Loaded(model, source, model_class=model_class, dtype=_dtype(model)), example, backend


def _dtype(model: Any) -> str:
    """The dtype of the model's first floating parameter (a factory may make a bfloat16 model),
    float32 where it has none (an archive's skeleton)."""
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return "float32"


def transformed_tree(model_name: str, allow_pickle: bool = False) -> Any:
    """The module tree of an archive or a factory's module, for `ls` (an archive's only
    pickle-free parts are read: a .pt2 that needs pickle is refused as for dump)."""
    from modeltap.loading.archive import ArchiveKind, archive_kind, is_archive_path

    if is_archive_path(model_name):
        path = Path(model_name)
        if archive_kind(path) is ArchiveKind.export:
            from modeltap.capture.export import module_names, parameter_shapes, skeleton
            from modeltap.loading.archive import load_pt2, pt2_module_classes

            program = load_pt2(path, allow_pickle=allow_pickle)
            names = module_names(program, pt2_module_classes(path))
            return skeleton(names, parameter_shapes(program))
        from modeltap.capture.torchscript import script_skeleton
        from modeltap.loading.archive import load_torchscript

        return script_skeleton(load_torchscript(path), parameters=True)
    from modeltap.loading.factory import load_factory

    return load_factory(model_name).module


def _root_class(program: Any) -> str:
    from modeltap.capture.export import module_names

    return module_names(program).get("__root__", "Module")

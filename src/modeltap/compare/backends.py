"""`--against compile` and `--against export`: the candidate's modules at one depth, transformed.

A compiled or exported module is one graph: what it calls inside can be neither hooked nor
replayed. So each module at the `--depth` asked is compiled (`torch.compile`, inductor) or exported
(`torch.export.export(...).module()`) on its own, in place in a copy of the model that shares its
weights, and the comparison (cumulative and replay) happens at that depth and above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError, RunError, first_line
from modeltap.selection import ROOT, module_depth

if TYPE_CHECKING:
    from torch import nn

    from modeltap.loading import Inputs

# torch.compile wraps a module as `_orig_mod` inside an OptimizedModule: the same names without it.
COMPILED_RENAME = ("*._orig_mod*=**",)
BACKENDS = ("compile", "export")


def modules_at(model: nn.Module, depth: int) -> list[str]:
    """Modules at `depth` that are called (containers such as ModuleList never are)."""
    from torch import nn

    return [
        name
        for name, module in model.named_modules()
        if name
        and module_depth(name) == depth
        and not isinstance(module, (nn.ModuleList, nn.ModuleDict))
    ]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, last = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, last, new)


def transform(
    backend: str, candidate: nn.Module, reference: nn.Module, inputs: Inputs, depth: int | None
) -> str:
    """Compile or export `candidate`'s modules at `depth` in place; returns the report's note."""
    if depth is None or depth < 1:
        raise InputError(
            f"--against {backend} replays at one depth: give --depth N (1 or more; e.g. 3 for "
            "each layer of a BERT)"
        )
    names = modules_at(candidate, depth)
    if not names:
        raise InputError(f"no module to {backend} at --depth {depth}; `modeltap ls` shows them")
    if backend == "compile":
        import torch

        for name in names:
            _replace(candidate, name, torch.compile(candidate.get_submodule(name)))
        return (
            f"{len(names)} modules at depth {depth} compiled each on its own (inductor); "
            "compared at that depth and above"
        )
    examples = _example_calls(reference, names, inputs)
    import torch

    for name in names:
        if name not in examples:
            continue  # never called: left as it is, and reported as not called
        args, kwargs = examples[name]
        try:
            program = torch.export.export(candidate.get_submodule(name), args, kwargs, strict=False)
        except Exception as exc:  # export raises many kinds for code it can't trace
            raise RunError(
                f"torch.export failed on '{name}': {first_line(exc)}; try another --depth"
            ) from exc
        exported = program.module()
        for module in exported.modules():  # its train() and eval() raise: set the flag itself
            module.training = False
        _replace(candidate, name, exported)
    return (
        f"{len(examples)} modules at depth {depth} exported each on its own (torch.export); "
        "compared at that depth and above"
    )


def _example_calls(
    reference: nn.Module, names: list[str], inputs: Inputs
) -> dict[str, tuple[Any, Any]]:
    """Each module's first call (args, kwargs) in a run of the reference: export traces with
    them. Held only until the candidate is built."""
    import torch

    from modeltap.capture import run_model
    from modeltap.compare.replay import _cast

    calls: dict[str, tuple[Any, Any]] = {}
    handles = []

    def make(name: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if name not in calls:  # copies: the forward may change its tensors in place later
                calls[name] = (_cast(args, None, None), _cast(dict(kwargs), None, None))

        return hook

    try:
        for name in names:
            module = reference.get_submodule(name) if name != ROOT else reference
            handles.append(module.register_forward_pre_hook(make(name), with_kwargs=True))
        with torch.no_grad():
            run_model(reference, inputs.args, inputs.kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return calls

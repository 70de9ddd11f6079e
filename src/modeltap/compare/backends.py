"""`--against compile` and `--against export`: the candidate's modules at one depth, transformed.

A compiled or exported module is one graph: what it calls inside can be neither hooked nor
replayed. So each module at the `--depth` asked is compiled (`torch.compile`, inductor) or exported
(`torch.export.export(...).module()`) on its own, in place in a copy of the model that shares its
weights, and the comparison (cumulative and replay) happens at that depth and above.
"""

from __future__ import annotations

import functools
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


def check_depth(backend: str, depth: int | None) -> None:
    """compile and export transform the modules at one depth: refuse a missing one (before the
    weights load, where the caller can)."""
    if depth is None or depth < 1:
        raise InputError(
            f"--against {backend} replays at one depth: give --depth N (1 or more; e.g. 3 for "
            "each layer of a BERT or a Llama)"
        )


def _names(backend: str, candidate: nn.Module, depth: int | None) -> list[str]:
    check_depth(backend, depth)
    assert depth is not None
    names = modules_at(candidate, depth)
    if not names:
        raise InputError(f"no module to {backend} at --depth {depth}; `modeltap ls` shows them")
    return names


def _compile(candidate: nn.Module, names: list[str], *, strict: bool = False) -> None:
    """torch.compile each module in place. `strict`: a module that reaches dynamo's recompile
    limit raises instead of running eagerly from then on, as dynamo does by default: a
    comparison of eager with eager would pass for the wrong reason."""
    import torch

    for name in names:
        compiled = torch.compile(candidate.get_submodule(name))
        if strict:
            patch = torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
            compiled.forward = patch(compiled.forward)
        _replace(candidate, name, compiled)


def transform(
    backend: str, candidate: nn.Module, reference: nn.Module, inputs: Inputs, depth: int | None
) -> str:
    """Compile or export `candidate`'s modules at `depth` in place; returns the report's note."""
    names = _names(backend, candidate, depth)
    if backend == "compile":
        _compile(candidate, names)
        return (
            f"{len(names)} modules at depth {depth} compiled each on its own (inductor); "
            "compared at that depth and above"
        )
    examples = _example_calls(reference, names, inputs)

    for name in names:
        if name not in examples:
            continue  # never called: left as it is, and reported as not called
        args, kwargs = examples[name]
        _replace(
            candidate, name, _eval_graph(_export(candidate.get_submodule(name), name, args, kwargs))
        )
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
    from modeltap.compare.replayer import _cast

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


NO_CACHE_NOTE = (
    "both generations ran without the KV cache (use_cache=False: each step one forward over the "
    "whole sequence): export can't take transformers' cache object, and torch.compile guards on "
    "its state, so it would compile every layer again at each step"
)


def transform_for_generation(backend: str, candidate: nn.Module, depth: int | None) -> str:
    """`compare --generate --against compile|export`: compile or export `candidate`'s modules at
    `depth` in place for a generation without the KV cache; returns the report's note.

    Each step calls a module with other lengths, so an exported module is exported again for a
    call its graphs can't take (`exported_module`); torch.compile recompiles as it does."""
    names = _names(backend, candidate, depth)
    if backend == "compile":
        _compile(candidate, names, strict=True)
        return (
            f"{len(names)} modules at depth {depth} compiled each on its own (inductor); "
            f"{NO_CACHE_NOTE}; compared at that depth and above"
        )
    for name in names:
        _replace(candidate, name, exported_module(candidate.get_submodule(name), name))
    return (
        f"{len(names)} modules at depth {depth} exported each on its own (torch.export, "
        f"dynamic shapes); {NO_CACHE_NOTE}; compared at that depth and above"
    )


_TENSOR = object()  # a tensor's place among a call's leaves
_CONSTANTS = (type(None), bool, int, float, str)


def exported_module(module: nn.Module, name: str) -> nn.Module:
    """A module that stands in for `module`: each call runs a graph `torch.export` made of it.

    A call is flattened to its leaves (`torch.utils._pytree`): its tensors are the graph's
    inputs, every other leaf (None, flags, sizes) is fixed in the graph. The first call of a
    kind is exported with every dimension `Dim.AUTO` (dynamic unless the code fixes it, as
    export does a size of 1); a later call whose structure, fixed leaves or fixed sizes no graph
    has is exported again. The graphs are its children (`graphs.0`, ...); `module` itself is
    kept outside the module tree, the graphs holding its weights."""
    return _exported_class()(module, name)


@functools.cache
def _exported_class() -> type:
    from torch import nn

    class ExportedModule(nn.Module):
        def __init__(self, module: nn.Module, name: str) -> None:
            super().__init__()
            self.graphs = nn.ModuleList()
            self.keys: list[tuple[Any, ...]] = []
            self.traced = (module,)  # in a tuple: not a child
            self.name = name
            self.training = module.training

        def train(self, mode: bool = True) -> ExportedModule:
            self.training = mode  # an exported graph's own train() raises
            return self

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return _run_exported(self, args, kwargs)

    return ExportedModule


def _run_exported(owner: Any, args: Any, kwargs: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten((args, kwargs))
    for leaf in leaves:
        if not isinstance(leaf, (torch.Tensor, *_CONSTANTS)):
            raise RunError(
                f"'{owner.name}' was called with a {type(leaf).__name__}, which an exported graph "
                "can't take or update (tensors and constants only); for a generation, run it with "
                "use_cache=False"
            )
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    fixed = tuple(_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
    for (graph_spec, graph_fixed, sizes), graph in zip(owner.keys, owner.graphs, strict=True):
        if graph_spec == spec and _same_fixed(graph_fixed, fixed) and _fits(sizes, tensors):
            return graph(*tensors)
    graph, sizes = _export_call(owner.traced[0], owner.name, spec, fixed, tensors)
    owner.graphs.append(graph)
    owner.keys.append((spec, fixed, sizes))
    return graph(*tensors)


def _same_fixed(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(
        x is y or (type(x) is type(y) and x == y) for x, y in zip(a, b, strict=True)
    )


def _fits(sizes: list[tuple[Any, tuple[int | None, ...]]], tensors: list[Any]) -> bool:
    """Whether `tensors` have the graph's dtypes and fixed sizes (None: a dynamic dimension)."""
    if len(sizes) != len(tensors):
        return False
    return all(
        dtype == t.dtype
        and len(shape) == t.dim()
        and all(s in (None, n) for s, n in zip(shape, t.shape, strict=True))
        for (dtype, shape), t in zip(sizes, tensors, strict=True)
    )


def _export_call(
    module: nn.Module, name: str, spec: Any, fixed: tuple[Any, ...], tensors: list[Any]
) -> tuple[nn.Module, list[tuple[Any, tuple[int | None, ...]]]]:
    """Export `module` for calls shaped like this one: the graph (taking the tensors) and, per
    tensor, its dtype and the sizes the graph fixed."""
    import torch
    from torch import nn
    from torch.export import Dim
    from torch.utils._pytree import tree_unflatten

    from modeltap.capture.export import quiet_specialization

    class Call(nn.Module):  # the call with its tensors as the only arguments
        def __init__(self) -> None:
            super().__init__()
            self.module = module

        def forward(self, *inputs: torch.Tensor) -> Any:
            given = iter(inputs)
            leaves = [next(given) if leaf is _TENSOR else leaf for leaf in fixed]
            args, kwargs = tree_unflatten(leaves, spec)
            return self.module(*args, **kwargs)

    dynamic = tuple({i: Dim.AUTO for i in range(t.dim())} for t in tensors)
    with quiet_specialization():  # a size of 1 fixed is what `sizes` keeps
        # one argument, *inputs: its shapes are one tuple
        program = _export(Call(), name, tuple(tensors), {}, dynamic_shapes=(dynamic,))
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    sizes = [
        (
            t.dtype,
            tuple(s if isinstance(s, int) else None for s in placeholders[i].meta["val"].shape),
        )
        for i, t in zip(program.graph_signature.user_inputs, tensors, strict=True)
    ]
    return _eval_graph(program), sizes


def _export(module: nn.Module, name: str, args: Any, kwargs: Any, **options: Any) -> Any:
    """`torch.export.export` (non-strict) of the module at `name`, or a RunError naming it."""
    import torch

    try:
        return torch.export.export(module, args, kwargs, strict=False, **options)
    except Exception as exc:  # export raises many kinds for code it can't trace
        raise RunError(
            f"torch.export failed on '{name}': {first_line(exc)}; try another --depth"
        ) from exc


def _eval_graph(program: Any) -> nn.Module:
    """The program's module in eval mode (its train() and eval() raise: the flags are set)."""
    graph = program.module()
    for part in graph.modules():
        part.training = False
    return graph

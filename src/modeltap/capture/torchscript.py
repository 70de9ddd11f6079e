"""TorchScript backend: module outputs read from the inlined graph, no hooks.

Hooks cannot be added to a loaded ScriptModule, and on a traced module they register but never
fire. Instead: inline the forward graph; each node knows the module it came from
(`Node.getModuleHierarchy()`, which survives save/load); a module call is a run of consecutive
nodes inside that module, and its output is the values the run computes that are used after it
(or returned). Those values become extra graph outputs (copied first when an in-place op changes
them later), a function is built from the graph and run once, and the values are named through the
`Recorder` with the eager dotted names. Modules whose nodes sit only inside control flow (a
scripted `if`/loop) can't be read this way and are listed as unmapped.

A traced graph keeps no output structure (a module returning `(tensor, None)` or a ModelOutput
leaves a bare value): `save_traced` keeps the eager structure's record (`structure.py`) in the
archive, and the dump maps the graph's values onto it. An archive traced elsewhere has none: its
values keep the graph's shape (a bare key for one value) and `backend_details` says
`output_record: false`. A scripted module's tuples and dicts are real values of its graph.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modeltap.capture.backend import BackendRun, RunRequest, SavedBackend
from modeltap.capture.eager import model_mode
from modeltap.capture.recorder import Recorder
from modeltap.capture.structure import STRUCTURE_FILE, OutputStructure, record_outputs
from modeltap.errors import InputError
from modeltap.selection import ROOT

if TYPE_CHECKING:
    from pathlib import Path

    from torch import nn

_SEGMENT = re.compile(r"([^.()]+)\(([^()]*)\)")
_SKIP_KINDS = {"prim::Constant", "prim::GetAttr"}


def _segments(hierarchy: str) -> list[str]:
    # scripted functions called inside a module (F.layer_norm) add `UNKNOWN_INSTANCE` levels
    return [m.group(1) for m in _SEGMENT.finditer(hierarchy) if m.group(1) != "UNKNOWN_INSTANCE"]


class _Resolver:
    """Hierarchy segments (`0(Block).act(GELU)`: ModuleLists are skipped) -> eager dotted names."""

    def __init__(self, names: list[str]) -> None:
        self.names = set(names)
        self.cache: dict[tuple[str, ...], str | None] = {}

    def __call__(self, segments: list[str]) -> str | None:
        key = tuple(segments)
        if key not in self.cache:
            self.cache[key] = self._resolve(segments)
        return self.cache[key]

    def _resolve(self, segments: list[str]) -> str | None:
        prefix = ""
        for seg in segments:
            direct = f"{prefix}.{seg}" if prefix else seg
            if direct in self.names:
                prefix = direct
                continue
            # a child reached through a container that the hierarchy leaves out
            base = f"{prefix}." if prefix else ""
            found = sorted(
                (n for n in self.names if n.startswith(base) and n.endswith(f".{seg}")),
                key=lambda n: n.count("."),
            )
            if not found:
                return None
            prefix = found[0]
        return prefix


def script_skeleton(script: Any, *, parameters: bool = False) -> Any:
    """An empty module tree with the ScriptModule's names and original class names (a loaded
    ScriptModule reports every module as RecursiveScriptModule); with `parameters`, its
    parameters' shapes as meta tensors, for `ls`'s counts."""
    from modeltap.capture.export import skeleton

    return skeleton(
        {
            (n or ROOT): getattr(m, "original_name", type(m).__name__)
            for n, m in script.named_modules()
        },
        {n: tuple(p.shape) for n, p in script.named_parameters()} if parameters else None,
    )


def _top_level(node: Any) -> Any:
    while node.owningBlock() is not None and node.owningBlock().owningNode() is not None:
        node = node.owningBlock().owningNode()
    return node


@dataclass
class _Call:
    module: str
    values: list[Any]  # torch._C.Value


def _module_calls(graph: Any, resolve: _Resolver) -> tuple[list[_Call], int]:
    """Module calls as runs of consecutive top-level nodes, and how many nodes had no hierarchy."""
    nodes = [n for n in graph.nodes() if n.kind() not in _SKIP_KINDS]
    index = {n: i for i, n in enumerate(nodes)}
    paths: list[str | None] = []
    modules: set[str] = set()
    unknown = 0
    for node in nodes:
        try:
            segments = _segments(node.getModuleHierarchy())
        except RuntimeError:
            segments = []
        path = resolve(segments) if segments else ""
        if path is None:
            unknown += 1
        else:
            # every level the hierarchy names is a called module (containers it skips are not)
            modules.update(p for k in range(1, len(segments) + 1) if (p := resolve(segments[:k])))
        paths.append(path)
    returned = set(graph.return_node().inputs())
    calls: list[tuple[int, _Call]] = []
    for module in sorted(modules):
        inside = [bool(p) and (p == module or p.startswith(module + ".")) for p in paths]
        i = 0
        while i < len(nodes):
            if not inside[i]:
                i += 1
                continue
            start = i
            while i < len(nodes) and inside[i]:
                i += 1
            run = range(start, i)
            escaping = []
            for j in run:
                for value in nodes[j].outputs():
                    used_after = any(
                        index.get(_top_level(use.user), len(nodes)) >= i for use in value.uses()
                    )
                    if used_after or value in returned:
                        escaping.append(value)
            if escaping:
                calls.append((i - 1, _Call(module, escaping)))
    # a child's call ends before (or where) its parent's does: order by end, deeper first
    calls.sort(key=lambda c: (c[0], -c[1].module.count(".")))
    return [c for _, c in calls], unknown


def _mutated_later(value: Any) -> bool:
    for use in value.uses():
        kind = use.user.kind()
        if use.offset == 0 and kind.startswith("aten::") and kind.endswith("_"):
            return True
    return False


def save_traced(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], path: str | Path
) -> list[str]:
    """torch.jit.trace the model (eval mode, strict=False) and save it with the record of its
    modules' eager output structure, so that a dump of the archive gets the eager keys. Returns
    the tracer's warnings (Python values it took as constants), one per place."""
    import inspect
    import warnings

    import torch

    with model_mode(model, train_mode=False):
        record = record_outputs(model, args, kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", torch.jit.TracerWarning)
            if kwargs:  # torch.jit.trace takes positional or keyword inputs, not both
                bound = inspect.signature(model.forward).bind_partial(*args, **kwargs)
                script = torch.jit.trace(
                    model,
                    example_kwarg_inputs=dict(bound.arguments),
                    strict=False,
                    check_trace=False,
                )
            else:
                script = torch.jit.trace(model, args, strict=False, check_trace=False)
    torch.jit.save(script, str(path), _extra_files={STRUCTURE_FILE: json.dumps(record)})
    tracer = [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in caught
        if issubclass(w.category, torch.jit.TracerWarning)
    ]
    for w in caught:  # anything else is shown as usual
        if not issubclass(w.category, torch.jit.TracerWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return list(dict.fromkeys(tracer))


@dataclass
class TorchScriptBackend(SavedBackend):
    """Dump a ScriptModule (traced or scripted, loaded from torch.jit.save) under eager keys;
    its `outputs` record is the one save_traced keeps in the archive."""

    script: Any
    name: str = field(default="torchscript", kw_only=True)

    def run(self, request: RunRequest) -> BackendRun:
        import torch

        if request.inputs:
            raise InputError("--inputs is not available for TorchScript archives; drop it")
        if request.train_mode:
            raise InputError("a TorchScript archive runs as saved; drop --train-mode")
        script = self.script
        graph = script.forward.graph.copy()
        torch._C._jit_pass_inline(graph)
        names = [n for n, _ in script.named_modules() if n]
        calls, unknown = _module_calls(graph, _Resolver(names))
        if not calls:
            raise InputError(
                f"'{self.source}' has no module hierarchy to map its values to (frozen, or saved "
                "by an old torch); save the module again with torch.jit.save, without "
                "torch.jit.freeze"
            )
        selected = set(request.modules)
        calls = [c for c in calls if c.module in selected]
        originals = list(graph.return_node().inputs())
        extra: list[Any] = []
        slots: list[list[int]] = []
        for call in calls:
            positions = []
            for value in call.values:
                if _mutated_later(value):
                    none = graph.insertConstant(None)
                    clone = graph.create("aten::clone", [value, none])
                    clone.insertAfter(value.node())
                    none.node().moveBefore(clone)
                    value = clone.output()
                positions.append(len(originals) + len(extra))
                extra.append(value)
            slots.append(positions)
        for value in extra:
            graph.registerOutput(value)
        graph.makeMultiOutputIntoTuple()
        function = torch._C._create_function_from_graph("modeltap_forward", graph)
        flat = _positional(script, request.args, request.kwargs, self.source)
        results, seconds = self.timed(
            request,
            lambda: function(script._c, *flat),
            "the TorchScript module failed: {}; check the inputs' shapes and dtypes",
        )
        results = results if isinstance(results, tuple) else (results,)
        output = results[0] if len(originals) == 1 else results[: len(originals)]
        recorder = Recorder(request.sink)
        structure = OutputStructure.of(self.outputs)
        for call, positions in zip(calls, slots, strict=True):
            values = [results[p] for p in positions]
            recorder.record(call.module, structure.module_value(call.module, values))
        if ROOT in selected:
            recorder.record(ROOT, structure.root_value(output))
        details: dict[str, Any] = {
            "run_s": seconds,
            "nodes_without_module": unknown,
            "output_record": self.outputs is not None,
        }
        called = {c.module for c in calls}
        return self.finish(request, recorder, structure, details, called, output)


def _positional(script: Any, args: tuple[Any, ...], kwargs: dict[str, Any], source: str) -> list:
    """The module's inputs in forward's order: named inputs placed by forward's argument names,
    a missing one that has a default (a scripted module's) given its default. The function
    built from the graph has no defaults, and its own error for a missing input prints its whole
    declaration, a Tensor for every extra output."""
    params = list(script.forward.schema.arguments)[1:]  # after self
    names = [p.name for p in params]
    takes = f"the TorchScript module in '{source}' takes {', '.join(names) or 'no inputs'}"
    if len(args) > len(params):
        raise InputError(f"{takes}; got {len(args)} inputs by position")
    unknown = sorted(set(kwargs) - set(names[len(args) :]))
    if unknown:
        raise InputError(f"{takes}; '{unknown[0]}' is not one of them (or given twice)")
    flat = list(args)
    missing = []
    for param in params[len(args) :]:
        if param.name in kwargs:
            flat.append(kwargs[param.name])
        elif param.has_default_value():
            flat.append(param.default_value)
        else:
            missing.append(param.name)
    if missing:
        one = len(missing) == 1
        raise InputError(
            f"{takes}; {', '.join(missing)} {'is' if one else 'are'} missing: give "
            f"{'it' if one else 'them'} by name in --input-file (or TEXT with a --tokenizer "
            f"that makes {'it' if one else 'them'})"
        )
    return flat

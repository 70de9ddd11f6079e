"""torch.export backend: export with every module's call signature kept, dump from the graph.

`export_program` exports with `preserve_module_call_signature` set to every module, so the program's
module call graph names, for each call of each module, the graph values it returned and the pytree
structure they had (a ModelOutput, a tuple with a None...). Dumping runs the flat graph once with
`torch.fx.Interpreter`, keeps those values, rebuilds each module's output from them and names it
through the `Recorder`: the same keys as eager, `@N` for repeated calls. (`torch.export.unflatten`
would give a module tree to hook, but on transformers models it builds code with duplicate
argument names when a submodule's keyword matches a model input, e.g. `attention_mask`.)

A program exported without preserved signatures (made elsewhere) still has each node's
`nn_module_stack`: a module's output is then the value computed inside it that is used outside
it. The graph keeps no output structure: given the eager model's record (`structure.py`,
`outputs=`), the values are mapped onto the eager paths; without one, a module with several
values gets `:0`, `:1`... in graph order (`backend_details` lists it under
`several_values_as_parts`), and a module returning `(tensor, None)` or a ModelOutput shows as a
bare tensor (`output_record: false`).

With `--ops` (RunRequest.ops), the selected modules' op nodes are kept as they run and recorded
before each module's output (capture/graph_ops.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from modeltap.capture.backend import BackendRun, RunRequest, SavedBackend
from modeltap.capture.graph_ops import GraphOps, stack_fqn
from modeltap.capture.keys import make_key
from modeltap.capture.recorder import Recorder
from modeltap.capture.structure import OutputStructure
from modeltap.errors import InputError, first_line
from modeltap.selection import ROOT

if TYPE_CHECKING:
    from torch import nn
    from torch.export import ExportedProgram

_CALL = re.compile(r"^(.*?)(?:@(\d+))?$")
# Every module's class name, kept in a `.pt2` that `modeltap export` writes (torch.export's
# extra files): the program names the classes of called modules only, not of a ModuleList.
MODULES_FILE = "modeltap/modules.json"


def module_classes(model: nn.Module) -> dict[str, str]:
    """Dotted name (ROOT for the root) -> class name, for MODULES_FILE."""
    return {(n or ROOT): type(m).__name__ for n, m in model.named_modules()}


def export_program(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    dynamic: bool = True,
) -> ExportedProgram:
    """torch.export with every module's call signature preserved and, when `dynamic`, Dim.AUTO on
    the batch and sequence dims (0 and 1) of every tensor input.

    torch.export fixes a dim whose example size is 0 or 1, so a batch of one is exported as the
    same rows twice, and the program keeps the example inputs it was given. A dim torch still
    fixes (a sequence of one token, a size the model's code depends on) stays static:
    `dynamic_dims` says which stayed dynamic.
    """

    import torch

    names = tuple(n for n, _ in model.named_modules() if n)
    was_training = model.training
    model.eval()
    doubled = dynamic and _batch_of_one((args, kwargs))
    traced_args, traced_kwargs = _doubled((args, kwargs)) if doubled else (args, kwargs)
    # its warning for each fixed dim is what `dynamic_dims` reports, once
    try:
        with quiet_specialization():
            program = torch.export.export(
                model,
                traced_args,
                traced_kwargs,
                dynamic_shapes=_dynamic_shapes(model, args, kwargs) if dynamic else None,
                strict=False,
                preserve_module_call_signature=names,
            )
    except Exception as exc:  # export raises many kinds (UserError, GuardOnDataDependent...)
        raise InputError(_export_failure(model, exc, dynamic)) from exc
    finally:
        model.train(was_training)
    if doubled:
        program.example_inputs = (tuple(args), dict(kwargs))
    return program


@contextmanager
def quiet_specialization() -> Iterator[None]:
    """Without torch.export's warning for each dim it fixes (Dim.AUTO with a size of 0 or 1)."""
    import logging

    specialized = logging.getLogger("torch._export.non_strict_utils")
    level = specialized.level
    specialized.setLevel(logging.ERROR)
    try:
        yield
    finally:
        specialized.setLevel(level)


def _batch_of_one(inputs: Any) -> bool:
    """Every tensor with a dim has a batch (dim 0) of 1."""
    import torch
    from torch.utils import _pytree

    batched = [t for t in _pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim()]
    return bool(batched) and all(t.shape[0] == 1 for t in batched)


def _doubled(inputs: Any) -> Any:
    """`inputs` with each tensor's batch of one given twice."""
    import torch
    from torch.utils import _pytree

    return _pytree.tree_map(
        lambda t: torch.cat([t, t]) if isinstance(t, torch.Tensor) and t.dim() else t, inputs
    )


def dynamic_dims(ep: ExportedProgram) -> dict[str, dict[int, bool]]:
    """Each tensor input of the program -> its batch and sequence dims (0, 1) -> dynamic?"""
    import torch

    user = set(ep.graph_signature.user_inputs)
    dims: dict[str, dict[int, bool]] = {}
    for node in ep.graph.nodes:
        fake = node.meta.get("val")
        if node.op != "placeholder" or node.name not in user:
            continue
        if isinstance(fake, torch.Tensor) and fake.dim() >= 1:
            dims[node.name] = {
                d: isinstance(fake.shape[d], torch.SymInt) for d in range(min(2, fake.dim()))
            }
    return dims


def describe_shapes(ep: ExportedProgram) -> str:
    """`dynamic batch and sequence dims`, `static shapes`, and each dim torch.export fixed."""
    dims = dynamic_dims(ep)
    if not any(free for v in dims.values() for free in v.values()):
        return "static shapes"
    names = {0: "batch", 1: "sequence"}
    free = [d for d in (0, 1) if any(d in v for v in dims.values())]
    free = [names[d] for d in free if all(v.get(d, True) for v in dims.values())]
    fixed = [f"{name} dim {d}" for name, v in dims.items() for d, ok in v.items() if not ok]
    parts = [f"dynamic {' and '.join(free)} dim{'s' if len(free) > 1 else ''}"] if free else []
    if fixed:
        parts.append(f"static {', '.join(fixed)} (torch.export fixed the example's size)")
    return "; ".join(parts)


def _dynamic_shapes(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """dynamic_shapes in the form torch.export wants: by forward's argument names."""
    import inspect

    import torch
    from torch.export import Dim

    def dims(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return {d: Dim.AUTO for d in range(min(2, value.dim()))}
        return None

    params = [
        p
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    shapes: dict[str, Any] = {}
    for param, value in zip(params, args, strict=False):
        shapes[param.name] = dims(value)
    for key, value in kwargs.items():
        shapes[key] = dims(value)
    return shapes


def _export_failure(model: nn.Module, exc: BaseException, dynamic: bool = False) -> str:
    text = str(exc)
    name = type(model).__name__
    if "Cache" in text or "past_key_values" in text:
        cause = "its output holds a cache object"
        fix = "set use_cache=False in the model's config"
    elif "data-dependent" in text.lower() or "GuardOnDataDependent" in type(exc).__name__:
        cause = "it has data-dependent control flow"
        fix = "export a part of it with a smaller --depth or another --model-class"
    else:
        cause = first_line(exc)
        fix = "try another --model-class, use_cache=False, or a smaller --depth" + (
            ", or --static" if dynamic else ""
        )
    return f"torch.export can't export {name}: {cause}; {fix} (MODELTAP_DEBUG=1 shows why)"


@dataclass
class _Call:
    module: str
    call: int
    outputs: list[Any]  # ArgumentSpecs
    out_spec: Any
    inputs: list[Any] | None = None
    in_spec: Any = None


def module_calls(ep: ExportedProgram) -> tuple[list[_Call], list[str]]:
    """Each preserved module call, and the modules whose calls have no signature."""
    calls: list[_Call] = []
    unsigned: list[str] = []
    for entry in ep.module_call_graph:
        match = _CALL.match(entry.fqn)
        assert match is not None
        module, call = match.group(1) or ROOT, int(match.group(2) or 0)
        if module == ROOT:
            continue  # the root's output is what the program returns
        if entry.signature is None:
            unsigned.append(module)
            continue
        sig = entry.signature
        calls.append(_Call(module, call, sig.outputs, sig.out_spec, sig.inputs, sig.in_spec))
    return calls, unsigned


def module_names(ep: ExportedProgram, recorded: dict[str, str] | None = None) -> dict[str, str]:
    """Every module of the program (calls and their parents) -> its class name: from `recorded`
    (MODULES_FILE) where given, else from the nodes' module stacks; a module never called is a
    `ModuleList` when its children are numbered, else `Module`."""
    classes: dict[str, str] = dict(recorded or {})
    for node in ep.graph.nodes:
        for path, cls in (node.meta.get("nn_module_stack") or {}).values():
            if "_empty_nn_module_stack" in path:
                continue
            classes.setdefault(stack_fqn(path) or ROOT, _class_name(cls))
    names: dict[str, str] = {ROOT: classes.get(ROOT, "ExportedProgram")}
    for entry in ep.module_call_graph:
        module = _CALL.match(entry.fqn).group(1)  # type: ignore[union-attr]
        parts = module.split(".") if module else []
        for i in range(1, len(parts) + 1):
            fqn = ".".join(parts[:i])
            names.setdefault(fqn, classes.get(fqn, "Module"))
    for fqn, cls in classes.items():
        names.setdefault(fqn, cls)
    for fqn in [n for n, cls in names.items() if cls == "Module" and n not in classes]:
        children = [n.rpartition(".")[2] for n in names if n.rpartition(".")[0] == fqn]
        if children and all(c.isdigit() for c in children):
            names[fqn] = "ModuleList"
    return names


def parameter_shapes(ep: ExportedProgram) -> dict[str, tuple[int, ...]]:
    """The program's parameters (dotted names) -> shapes, for the module tree's counts."""
    return {
        name: tuple(ep.state_dict[name].shape)
        for name in ep.graph_signature.parameters
        if name in ep.state_dict
    }


def _class_name(cls: Any) -> str:
    text = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return text.rsplit(".", 1)[-1].strip("'>")


def skeleton(
    names: dict[str, str], parameters: dict[str, tuple[int, ...]] | None = None
) -> nn.Module:
    """An empty module tree with the program's module names and class names, for selection and
    `ls` (each class is a plain nn.Module subclass named after the original), with `parameters`
    (dotted name -> shape) as meta tensors: sizes without memory, for `ls`'s counts."""
    import torch
    from torch import nn

    class ArchiveModule(nn.Module):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a module tree read from an archive has no code of its own")

    classes: dict[str, type] = {}

    def make(cls_name: str) -> nn.Module:
        if cls_name not in classes:
            classes[cls_name] = type(cls_name, (ArchiveModule,), {})
        return classes[cls_name]()

    root = make(names.get(ROOT, "ExportedProgram"))
    for fqn in sorted((n for n in names if n != ROOT), key=lambda n: n.count(".")):
        parent_name, _, child = fqn.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        parent.add_module(child, make(names[fqn]))
    for name, shape in (parameters or {}).items():
        owner_name, _, attr = name.rpartition(".")
        owner = root
        for part in owner_name.split(".") if owner_name else []:
            if not hasattr(owner, part):
                owner.add_module(part, make("Module"))
            owner = getattr(owner, part)
        owner.register_parameter(
            attr, nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
        )
    return root


def flat_inputs(ep: ExportedProgram, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The program's flat inputs from args and kwargs, in the order it was exported with."""
    import torch
    from torch.utils import _pytree

    spec = ep.call_spec.in_spec
    exported_kwargs: list[str] = []
    if spec is not None and spec.num_children == 2:
        kw_spec = spec.child(1)
        exported_kwargs = list(kw_spec.context or [])
    if set(kwargs) != set(exported_kwargs):
        raise InputError(
            f"the program was exported with inputs {sorted(exported_kwargs) or 'by position'}, "
            f"got {sorted(kwargs) or 'by position'}; give the same names, or re-export"
        )
    ordered = {k: kwargs[k] for k in exported_kwargs}
    flat, given = _pytree.tree_flatten((tuple(args), ordered))
    if spec is not None and given != spec:
        raise InputError(
            "these inputs have another structure than the exported program's; give inputs "
            "like its example inputs (or re-export)"
        )
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    user = placeholders[len(placeholders) - len(flat) :]
    dynamic = any(free for dims in dynamic_dims(ep).values() for free in dims.values())
    for node, value in zip(user, flat, strict=True):
        fake = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or not isinstance(fake, torch.Tensor):
            continue
        if fake.dim() != value.dim():
            raise InputError(
                f"input '{node.name}' has {value.dim()} dims, the program takes {fake.dim()}"
            )
        for d, (want, got) in enumerate(zip(fake.shape, value.shape, strict=True)):
            if isinstance(want, int) and want != got and dynamic:
                raise InputError(
                    f"input '{node.name}' has size {got} in dim {d}, but torch.export fixed that "
                    f"dim to the example's size {want} (it does for sizes 0 and 1, and for sizes "
                    "the model's code depends on); give inputs of that size there, or re-export "
                    "from an example of another size"
                )
            if isinstance(want, int) and want != got:
                raise InputError(
                    f"input '{node.name}' has size {got} in dim {d}, but the program was "
                    f"exported with a static size {want} there; re-export with dynamic shapes "
                    "(`modeltap export` without --static) or give inputs of that shape"
                )
    return flat


def mutated_nodes(graph: Any) -> set[str]:
    """Names of nodes whose value an in-place op (`add_`, `relu_`) changes later, through views."""
    mutated: set[str] = set()
    for node in graph.nodes:
        target = node.target
        schema = getattr(target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        base = node.args[0] if node.args else None
        while hasattr(base, "op"):
            mutated.add(base.name)
            view = getattr(base.target, "is_view", False) if base.op == "call_function" else False
            base = base.args[0] if view and base.args else None
    return mutated


class _Keeper:
    """An Interpreter that keeps the values of some nodes as they are computed (a copy of those
    that an in-place op changes later, so each module keeps the value it returned)."""

    def __init__(self, gm: Any, wanted: set[str], ops: GraphOps | None = None) -> None:
        import torch
        import torch.fx

        keeper = self
        copy = wanted & mutated_nodes(gm.graph)

        class Interp(torch.fx.Interpreter):
            def run_node(self, n: Any) -> Any:
                if ops is None:
                    result = super().run_node(n)
                else:  # --ops: an op node's value kept by GraphOps
                    result = ops.run_node(self, n, super().run_node)
                if n.name in wanted:
                    if n.name in copy and isinstance(result, torch.Tensor):
                        keeper.values[n.name] = result.clone()
                    else:
                        keeper.values[n.name] = result
                return result

        self.values: dict[str, Any] = {}
        self.interpreter = Interp(gm)

    def run(self, flat: list[Any]) -> Any:
        return self.interpreter.run(*flat, enable_io_processing=False)


def _argument_value(spec: Any, values: dict[str, Any]) -> Any:
    name = getattr(spec, "name", None)
    if name and name in values:
        return values[name]
    if hasattr(spec, "value"):
        return spec.value
    return None


@dataclass
class ExportBackend(SavedBackend):
    """Dump an ExportedProgram's module outputs under the eager keys (and, asked for, the ops
    of the selected modules: its graph nodes, capture/graph_ops.py)."""

    program: Any
    name: str = field(default="export", kw_only=True)
    sees_ops: ClassVar[bool] = True

    def run(self, request: RunRequest) -> BackendRun:
        from torch.utils import _pytree

        if request.train_mode:
            raise InputError("an exported program runs as exported; drop --train-mode")
        ep = self.program
        selected = set(request.modules)
        calls, unsigned = module_calls(ep)
        calls = [c for c in calls if c.module in selected]
        wanted = {getattr(a, "name", "") for c in calls for a in c.outputs}
        if request.inputs:
            wanted |= {getattr(a, "name", "") for c in calls for a in c.inputs or []}
        flat = flat_inputs(ep, request.args, request.kwargs)
        gm = ep.module()
        # modules without a preserved signature: their output read from nn_module_stack scopes
        inferred = []
        if unsigned:
            from modeltap.capture.fx import _calls as scope_calls

            wanted_modules = set(unsigned) & selected
            inferred = [c for c in scope_calls(gm) if c.module in wanted_modules]
            wanted |= {n.name for c in inferred for n in c.escaping}
        ops = GraphOps(gm, selected) if request.ops else None
        keeper = _Keeper(gm, wanted, ops)
        flat_out, seconds = self.timed(
            request,
            lambda: keeper.run(flat),
            "the exported program failed: {}; check the inputs' shapes and dtypes against its "
            "example inputs",
        )
        values = keeper.values
        recorder = Recorder(request.sink)
        several: list[str] = []
        structure = OutputStructure.of(self.outputs)
        for end, call in _in_return_order(gm, calls, inferred):
            if ops is not None:  # the ops up to the call's end, and its own, before its output
                own = make_key(call.module, call.call) if isinstance(call, _Call) else ""
                ops.record(recorder, end, own)
            if not isinstance(call, _Call):  # an inferred call: the values leaving its scope
                got = [values[n.name] for n in call.escaping]
                if len(got) > 1 and self.outputs is None:
                    several.append(call.module)
                recorder.record(call.module, structure.module_value(call.module, got))
                continue
            if request.inputs and call.inputs is not None and call.in_spec is not None:
                leaves = [_argument_value(a, values) for a in call.inputs]
                call_args, call_kwargs = _pytree.tree_unflatten(leaves, call.in_spec)
                recorder.record(
                    call.module, {**dict(enumerate(call_args)), **call_kwargs}, is_input=True
                )
            leaves = [_argument_value(a, values) for a in call.outputs]
            recorder.record(call.module, _pytree.tree_unflatten(leaves, call.out_spec))
        output = _output(ep, flat_out)
        if ops is not None:
            ops.record(recorder)
        if ROOT in selected:
            recorder.record(ROOT, output)
        details: dict[str, Any] = {"graph_nodes": len(gm.graph.nodes), "run_s": seconds}
        if unsigned:
            details["modules_without_signature"] = len(unsigned)
            details["inferred_from_scopes"] = len({c.module for c in inferred})
            details["output_record"] = self.outputs is not None
        called = {c.module for c in calls} | {c.module for c in inferred}
        after = {"several_values_as_parts": several} if several else {}
        done = self.finish(request, recorder, structure, details, called, output, **after)
        done.ops = None if ops is None else ops.meta
        return done


def _in_return_order(
    gm: Any, calls: list[_Call], inferred: list[Any]
) -> list[tuple[int, Any]]:
    """The signed `calls` and the `inferred` ones in the order they return in the graph, a
    child before its parent, each with the graph position of its last node."""
    position = {n.name: i for i, n in enumerate(gm.graph.nodes)}

    def ends_at(call: _Call) -> tuple[int, int]:
        last = max((position.get(getattr(a, "name", ""), -1) for a in call.outputs), default=-1)
        return last, -call.module.count(".")  # a child returns before its parent

    events: list[tuple[tuple[int, int], int, Any]] = [
        (ends_at(c), i, c) for i, c in enumerate(calls)
    ]
    events += [((c.last, -c.module.count(".")), len(calls) + i, c) for i, c in enumerate(inferred)]
    return [(end[0], call) for end, _, call in sorted(events, key=lambda e: (e[0], e[1]))]


def _output(ep: Any, flat_out: Any) -> Any:
    from torch.utils import _pytree

    spec = ep.call_spec.out_spec
    if spec is None:
        return flat_out
    leaves = list(flat_out) if isinstance(flat_out, (list, tuple)) else [flat_out]
    try:
        return _pytree.tree_unflatten(leaves, spec)
    except (ValueError, TypeError):
        return flat_out

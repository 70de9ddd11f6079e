"""FX backend: a `torch.fx.GraphModule` run node by node with `torch.fx.Interpreter`.

A traced GraphModule calls its leaf modules (`call_module` nodes) but inlines the code of the
others (a transformer block is a row of `call_function` nodes). Each node's `nn_module_stack`
metadata names every module call it came from (`shared@1` for the second call), so the output
of any call, inlined or not, is the value computed inside it that is used outside it (or
returned): the same keys as the eager hooks give. A GraphModule built by hand, with no such
metadata, gets its `call_module` outputs only; the modules that produce nothing are listed as
unmapped.

Tracing keeps no output structure: a block returning `(x + h, h)` leaves two values in the order
they were computed (`h` first), and one returning `(x, h)` leaves only `h` (`x` is its input).
`trace` keeps the eager structure's record (`structure.py`) in the GraphModule's `meta`, and the
dump maps the values onto it: the eager keys. A GraphModule traced without one keeps the graph's
shape (a bare key for one value, `:0`, `:1` in graph order for several; listed in
`backend_details`), and `backend_details` says `output_record: false`.

With `--ops`, the selected modules' nodes are their ops (capture/graph_ops.py); `trace` records
each node's stack trace, their source lines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from modeltap.capture.backend import BackendRun, RunRequest
from modeltap.capture.graph_ops import GraphOps
from modeltap.capture.recorder import Recorder
from modeltap.capture.structure import OutputStructure, record_outputs
from modeltap.errors import InputError, RunError, first_line
from modeltap.selection import ROOT

if TYPE_CHECKING:
    import torch.fx
    from torch import nn

# where `trace` keeps the eager output structure's record in a GraphModule's `meta`
STRUCTURE_META = "modeltap_outputs"


def trace(model: nn.Module, *args: Any, **kwargs: Any) -> torch.fx.GraphModule:
    """`torch.fx.symbolic_trace(model)`, with a record of each module call's eager output
    structure (one eager forward on the inputs) so that a dump of it has the eager keys, and each
    node's `stack_trace` (the source line of its op with `dump --ops`)."""
    import torch.fx

    tracer = torch.fx.Tracer()
    tracer.record_stack_traces = True
    graph = tracer.trace(model)
    gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    gm.meta[STRUCTURE_META] = record_outputs(model, args, kwargs)
    return gm


@dataclass
class _Call:
    module: str
    nodes: list[Any] = field(default_factory=list)
    escaping: list[Any] = field(default_factory=list)
    last: int = -1


def _calls(gm: Any) -> list[_Call]:
    """Module calls in the order they return, each with the nodes that leave it."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    calls: dict[str, _Call] = {}
    scopes: dict[Any, set[str]] = {}
    for node in nodes:
        stack = node.meta.get("nn_module_stack")
        keys: set[str] = set()
        if stack:
            for key, (fqn, _cls) in stack.items():
                keys.add(key)
                calls.setdefault(key, _Call(str(fqn) or ROOT)).nodes.append(node)
        elif node.op == "call_module":
            key = f"{node.target}#{node.name}"
            keys.add(key)
            calls.setdefault(key, _Call(str(node.target))).nodes.append(node)
        scopes[node] = keys
    for key, call in calls.items():
        for node in call.nodes:
            if any(key not in scopes[user] or user.op == "output" for user in node.users):
                call.escaping.append(node)
        call.last = max(order[n] for n in call.nodes)
    ordered = sorted(calls.values(), key=lambda c: (c.last, -c.module.count(".")))
    return [c for c in ordered if c.escaping and c.module != ROOT]


def _mutated(gm: Any) -> set[Any]:
    """Nodes whose value a later in-place op changes (`x += 1`, `ReLU(inplace=True)`)."""
    from modeltap.capture.compile_log import _INPLACE_OPERATORS

    changed: set[Any] = set()
    for node in gm.graph.nodes:
        target = node.target
        inplace = False
        if node.op == "call_module":
            inplace = getattr(gm.get_submodule(target), "inplace", False) is True
        elif node.op in ("call_function", "call_method"):
            name = target if isinstance(target, str) else getattr(target, "__name__", "")
            inplace = (
                target in _INPLACE_OPERATORS
                or node.kwargs.get("inplace") is True
                or (
                    name.endswith("_")
                    and not name.endswith("__")
                    and getattr(target, "__module__", "") not in ("_operator", "operator")
                )
            )
        if inplace and node.args and hasattr(node.args[0], "op"):
            changed.add(node.args[0])
    return changed


@dataclass
class FxBackend:
    """Dump a GraphModule's module outputs under the eager keys (and, asked for, the ops of the
    selected modules: its nodes, capture/graph_ops.py)."""

    name: str = "fx"
    sees_ops: ClassVar[bool] = True
    # record_outputs' record; None: the GraphModule's own (`trace` keeps it in `meta`), if any
    outputs: dict | None = None

    def run(self, request: RunRequest) -> BackendRun:
        import torch
        import torch.fx

        model, modules, sink, args, kwargs = request.call
        inputs, train_mode, seed = request.inputs, request.train_mode, request.seed

        if inputs:
            raise InputError("--inputs is not available for fx.GraphModules; drop it")
        gm = model
        selected = set(modules)
        calls = [c for c in _calls(gm) if c.module in selected]
        wanted = {n for c in calls for n in c.escaping}
        copy = wanted & _mutated(gm)
        values: dict[Any, Any] = {}
        ops = GraphOps(gm, selected, fx=True) if request.ops else None

        class Keeper(torch.fx.Interpreter):
            def run_node(self, n: Any) -> Any:
                if ops is None:
                    result = super().run_node(n)
                else:  # --ops: an op node's value kept by GraphOps
                    result = ops.run_node(self, n, super().run_node)
                if n in wanted:
                    values[n] = result.clone() if n in copy else result
                return result

        flat = _flat_inputs(gm, args, kwargs)
        was_training = {m: m.training for m in gm.modules()}
        gm.train(train_mode)
        if seed is not None:
            torch.manual_seed(seed)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                output = Keeper(gm).run(*flat)
        except InputError:
            raise
        except Exception as exc:
            raise RunError(
                f"the GraphModule failed: {first_line(exc)}; check the inputs' shapes and dtypes "
                "(MODELTAP_DEBUG=1 shows the traceback)"
            ) from exc
        finally:
            for m, training in was_training.items():
                m.training = training
        seconds = time.perf_counter() - start
        record = self.outputs
        if record is None:
            record = getattr(gm, "meta", {}).get(STRUCTURE_META)
        structure = OutputStructure.of(record)
        recorder = Recorder(sink)
        graph_order = []
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
        for call in calls:
            if ops is not None:  # the ops up to the call's last node before its output
                ops.record(recorder, max(position[n] for n in call.nodes))
            got = [values[n] for n in call.escaping]
            if record is None and len(got) > 1:
                graph_order.append(call.module)
            recorder.record(call.module, structure.module_value(call.module, got))
        if ops is not None:
            ops.record(recorder)
        if ROOT in selected:
            recorder.record(ROOT, structure.root_value(output))
        called = {c.module for c in calls} | {ROOT}
        details: dict[str, Any] = {
            "graph_nodes": len(gm.graph.nodes),
            "run_s": seconds,
            "output_record": record is not None,
        }
        if graph_order:
            details["parts_in_graph_order"] = graph_order
        if structure.unmatched:
            details["structure_unmatched"] = structure.unmatched
        if structure.missing:
            details["parts_not_in_graph"] = structure.missing
        unmapped = [m for m in modules if m not in called]
        return BackendRun(recorder, details, unmapped, output, None if ops is None else ops.meta)


def _flat_inputs(gm: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The GraphModule's placeholders' values: `args`, then `kwargs` by placeholder name."""
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    flat = list(args)
    for name in placeholders[len(args) :]:
        if name in kwargs:
            flat.append(kwargs[name])
    unknown = set(kwargs) - set(placeholders)
    if unknown:
        raise InputError(
            f"input '{sorted(unknown)[0]}' is not an input of the GraphModule; its inputs "
            f"are: {', '.join(map(str, placeholders))}"
        )
    return flat

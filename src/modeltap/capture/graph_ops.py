"""Op-level capture in a graph (`dump --ops` of an exported program or an FX GraphModule).

There the model's Python code no longer runs, so an op is a graph node: each `call_function`
node (in an FX graph also each `call_method` node, and each `call_module` node of a leaf module
that is not selected, named after its class) belongs to the innermost selected module of its
`nn_module_stack` (the root for an FX node outside every module), and is keyed as eager ops are
(capture/keys.py: `module/opNN.name`, numbered per module call in graph order, `name` the
target's: `softmax` for `aten.softmax.int` as for `torch.softmax`). Its metadata is an eager op's
(capture/ops.py's op_meta): `op` the node's target (`aten.softmax.int`, `torch.softmax`,
`Tensor.view`), `aten` the aten ops running the node dispatched, `source` the innermost frame of
its `stack_trace` outside torch and modeltap, and `node` its name in the graph. A node that only
takes a part of another's result (`operator.getitem` on a tuple) is no op: that result's parts are.

Values are copied as the node produced them (a later in-place node leaves them as they were) and
held until the backend records its module outputs: `record(recorder, until)` names those up to a
module's last node just before it, so the dump's order is the graph's.
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from modeltap.capture.keys import OP_SEP, flatten, make_key
from modeltap.capture.ops import AtenNames, op_meta, op_name, qualified_name
from modeltap.selection import ROOT

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_CALL_SUFFIX = re.compile(r"@(\d+)$")
_MODULES = os.sep.join(("torch", "nn", "modules", ""))


@dataclass
class _Op:
    owner: str  # the module call's key: `m`, `m@1`
    name: str
    op: str
    position: int
    value: Any = None
    meta: dict[str, Any] = field(default_factory=dict)


class GraphOps:
    """The ops of the selected modules among a GraphModule's nodes (see module doc)."""

    def __init__(self, gm: Any, selected: set[str], *, fx: bool = False) -> None:
        self._ops: dict[Any, _Op] = {}
        self._aten = AtenNames()
        self._counts: dict[str, int] = {}
        self.meta: dict[str, dict[str, Any]] = {}
        kinds = ("call_function", "call_method", "call_module") if fx else ("call_function",)
        for position, node in enumerate(gm.graph.nodes):
            if node.op not in kinds:
                continue
            owner = _owner(node, selected, leaf=node.op == "call_module")
            if owner is not None:
                name, op = _names(gm, node)
                self._ops[node] = _Op(owner, name, op, position)

    def run_node(self, interpreter: Any, node: Any, run: Callable[[Any], Any]) -> Any:
        """`run(node)` (the Interpreter's own run_node), the node's value kept if it is an op."""
        import torch

        op = self._ops.get(node)
        if op is None:
            return run(node)
        args, kwargs = interpreter.fetch_args_kwargs_from_env(node)
        inputs = [v for _, v in flatten((args, kwargs)) if isinstance(v, torch.Tensor)]
        versions = [t._version for t in inputs]
        with self._aten.names_of() as aten:
            result = run(node)
        leaves = [v for _, v in flatten(result) if isinstance(v, torch.Tensor)]
        if not leaves or (node.target is operator.getitem and isinstance(args[0], list | tuple)):
            del self._ops[node]
            return result
        source = stack_source(node.meta.get("stack_trace"))
        op.meta = {**op_meta(op.op, aten, source, inputs, versions, leaves[0]), "node": node.name}
        op.value = _copy(result)
        return result

    def record(self, recorder: Any, until: int | None = None, owner: str = "") -> None:
        """Name and record the kept ops up to graph position `until` (all: None) and those of
        the module call `owner` (its key), in graph order, each numbered within its call."""
        ops = sorted(
            (
                o
                for o in self._ops.values()
                if o.meta and (until is None or o.position <= until or o.owner == owner)
            ),
            key=lambda o: o.position,
        )
        for op in ops:
            count = self._counts.get(op.owner, 0)
            self._counts[op.owner] = count + 1
            key = f"{op.owner}{OP_SEP}op{count:02d}.{op.name}"
            self.meta[key] = op.meta
            recorder.record(key, op.value)
            op.meta, op.value = {}, None  # recorded: not again, and its copy freed


def _owner(node: Any, selected: set[str], *, leaf: bool) -> str | None:
    """The key of the innermost selected module call in the node's stack (`m`, `m@1`); the root
    where the node is outside every module; None where none is selected. A `leaf` call's own
    module is its innermost: a selected one makes the node its output, not an op."""
    stack = list((node.meta.get("nn_module_stack") or {}).items())
    if leaf:
        if not stack or (stack_fqn(str(stack[-1][1][0])) or ROOT) in selected:
            return None
        stack = stack[:-1]
    for key, (path, _cls) in reversed(stack):
        module = stack_fqn(str(path)) or ROOT
        if module in selected:
            call = _CALL_SUFFIX.search(str(key))
            return make_key(module, int(call.group(1)) if call else 0)
    return ROOT if ROOT in selected else None


def _names(gm: Any, node: Any) -> tuple[str, str]:
    """(the key's short name, the op as the graph calls it) of an op node."""
    target = node.target
    if node.op == "call_method":
        return op_name(getattr(_tensor_type(), target, None) or target), f"Tensor.{target}"
    if node.op == "call_module":
        cls = type(gm.get_submodule(target)).__name__
        return cls.lower(), f"{cls} ({target})"
    packet = getattr(target, "_opname", None)  # an aten OpOverload: `softmax` of aten.softmax.int
    if packet is not None:
        return packet, str(target)
    qualified = qualified_name(target).replace("_operator.", "operator.")
    return op_name(target), qualified


def _tensor_type() -> Any:
    import torch

    return torch.Tensor


def stack_source(trace: str | None) -> str:
    """`file:line` of the innermost frame of a node's `stack_trace` outside torch and modeltap
    (capture/ops.py's source_line for a graph); the innermost of torch's own module code
    (`torch/nn/modules/linear.py`) where no other is; "" without a trace."""
    from importlib.resources import files

    roots = [os.path.join(str(files(p)), "") for p in ("torch", "modeltap")]  # their folders
    module_code = ""
    for path, line in reversed(_FRAME.findall(trace or "")):
        if not any(path.startswith(root) for root in roots):
            return f"{path}:{line}"
        if not module_code and _MODULES in path and path.startswith(roots[0]):
            module_code = f"{path}:{line}"
    return module_code


def _copy(value: Any) -> Any:
    """The value with each tensor copied (tuples and lists kept)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list | tuple):
        items = [_copy(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def stack_fqn(path: str) -> str | None:
    """A node's `nn_module_stack` path as a module name: `L['self'].encoder.layer[0]`,
    `encoder.layer.0@1` -> `encoder.layer.0`; None for the root."""
    if "_empty_nn_module_stack" in path:
        return None
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"@\d+$", "", path).strip(".")
    return path or None

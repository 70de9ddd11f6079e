"""Eager output structure, recorded once, for backends whose graphs lose it.

A traced TorchScript graph, and a torch.export program without preserved module call signatures,
keep a module's output as the bare values that leave it: a module returning `(tensor, None)` or a
ModelOutput shows as one value, a tuple's values come in the order they were computed, not the
order they were returned. `record_outputs` runs the eager model once and records, for each module
call, its output's tensor leaves (their `:part` paths, in eager order) and the rank in which the
call computed each; `OutputStructure` then maps a graph's values (in graph order, which is the
order they were computed) onto those paths, so the keys are the eager ones. A call whose values
don't match its record keeps the graph's keys and is listed, never silently renamed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modeltap.capture.keys import flatten, make_key
from modeltap.selection import ROOT

if TYPE_CHECKING:
    from torch import nn

# where save_traced keeps the record in a TorchScript archive (its extra files)
STRUCTURE_FILE = "modeltap/outputs.json"


def record_outputs(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict:
    """Each module call's eager output leaves, for mapping a traced graph's values back:
    `{"calls": {module: [[[path, order], ...] per call]}}`, leaves in eager (flatten) order,
    `order` the rank in which the call computed the tensor (None: made before the call)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils.weak import WeakIdKeyDictionary

    made: WeakIdKeyDictionary = WeakIdKeyDictionary()
    count = [0]

    class Order(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            out = func(*args, **(kwargs or {}))
            for _, leaf in flatten(out):
                if isinstance(leaf, torch.Tensor) and leaf not in made:
                    made[leaf] = count[0]
                    count[0] += 1
            return out

    calls: dict[str, list[list[list[Any]]]] = {}
    starts: dict[str, list[int]] = {}

    def pre(name: str) -> Any:
        def hook(module: nn.Module, inputs: Any) -> None:
            starts.setdefault(name, []).append(count[0])

        return hook

    def post(name: str) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            start = starts[name].pop()
            leaves = []
            for path, leaf in flatten(output):
                if isinstance(leaf, torch.Tensor):
                    order = made.get(leaf)
                    leaves.append([path, order if order is not None and order >= start else None])
            calls.setdefault(name, []).append(leaves)

        return hook

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(pre(name or ROOT)))
        handles.append(module.register_forward_hook(post(name or ROOT)))
    try:
        with torch.no_grad(), Order():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return {"format": 1, "calls": calls}


@dataclass
class OutputStructure:
    """The recorded eager leaves of each module call, matched with the graph's values."""

    calls: dict[str, list[list[list[Any]]]]
    unmatched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    _seen: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, record: dict | None) -> OutputStructure:
        return cls((record or {}).get("calls", {}))

    def module_value(self, module: str, values: list[Any]) -> Any:
        """The escaping values (in graph order) as the eager output's leaves, by path."""
        import torch

        call = self._seen.get(module, 0)
        self._seen[module] = call + 1
        plain = values[0] if len(values) == 1 else tuple(values)
        records = self.calls.get(module, [])
        if call >= len(records):
            return plain
        leaves = records[call]
        # a traced call with several values returns them as one tuple, in graph order
        tensors = [t for v in values for _, t in flatten(v) if isinstance(t, torch.Tensor)]
        # graph order is the order the values were computed in
        made = sorted((order, path) for path, order in leaves if order is not None)
        if len(made) == len(tensors):
            by_path = {path: t for (_, path), t in zip(made, tensors, strict=True)}
            # a part the call passed through (its input) is no value of the call's graph
            self.missing += [make_key(module, call, p) for p, order in leaves if order is None]
        elif len(leaves) == len(tensors) == 1:  # eval dropout, in-place ReLU: their input
            by_path = {leaves[0][0]: tensors[0]}
        else:
            self.unmatched.append(make_key(module, call))
            return plain
        if [p for p, _ in leaves] == [""]:
            return tensors[0]
        return {p: by_path[p] for p, _ in leaves if p in by_path}

    def root_value(self, output: Any) -> Any:
        """The graph's output leaves under the eager output's paths (a traced ModelOutput is a
        tuple or a dict)."""
        import torch

        records = self.calls.get(ROOT, [])
        got = [leaf for _, leaf in flatten(output) if isinstance(leaf, torch.Tensor)]
        if not records:
            return output
        paths = [p for p, _ in records[0]]
        if len(paths) != len(got):
            self.unmatched.append(ROOT)
            return output
        if paths == [""]:
            return got[0]
        return dict(zip(paths, got, strict=True))

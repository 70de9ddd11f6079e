"""Op-level capture (`dump --ops`): inside each selected module, the output of every torch
function its own code calls, keyed `module/opNN.name` (capture/keys.py) and described in the
dump's `ops` metadata.

The level is the torch function (`torch.overrides.TorchFunctionMode`, as TorchLens does), not aten
(`TorchDispatchMode`, as `torch.utils._debug_mode.DebugMode` logs): a torch function is what the
model's source line calls (`torch.softmax` at the model's line, not `aten::_softmax` three frames
into torch), one call is one value the user can point at, and nested calls inside it (F.linear's
own, a composite's aten decomposition) are not seen twice, since a mode is off inside its handler.
An op belongs to the innermost selected module running: the ops of a selected child are the
child's; those of a child that is not selected (a Linear's F.linear) are its parent's own.

The aten ops each one ran are named too (metadata `aten`: `torch.softmax` -> `aten._softmax`,
F.linear -> `aten.t`, `aten.addmm`), by a `TorchDispatchMode` (`AtenNames`) entered only around a
recorded op, so the rest of the forward never passes through Python dispatch. In an exported
program or an FX GraphModule no model code runs: there an op is a graph node (capture/graph_ops.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modeltap.capture.keys import OP_SEP, flatten, make_key

if TYPE_CHECKING:
    from torch import nn

    from modeltap.capture.recorder import Recorder, Sink

# torch's own modules (Linear, LayerNorm): their code is the caller's code where no other is.
_MODULES = "torch.nn.modules."


def op_name(func: Any) -> str:
    """The short name in an op's key: `softmax`, `matmul`, `mul` for `Tensor.__mul__`."""
    name = getattr(func, "__name__", type(func).__name__)
    # dunders lose their underscores (`__mul__` -> `mul`); an in-place `mul_` keeps its own
    return name.strip("_") if name.startswith("__") else name


def qualified_name(func: Any) -> str:
    """The torch function as the model calls it: `torch.softmax`, `Tensor.view`,
    `torch.nn.functional.linear`."""
    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
    if owner is not None and isinstance(owner, type):
        return f"{owner.__name__.replace('TensorBase', 'Tensor')}.{name}"
    module = getattr(func, "__module__", None) or "torch"
    return f"{module.replace('torch._C._nn', 'torch.nn.functional')}.{name}"


@dataclass
class _Frame:
    key: str  # the module's key for this call (`m`, `m@1`)
    count: int = 0


@dataclass
class OpTracer:
    """Records the ops of the selected modules' own code through `recorder` (see module doc)."""

    recorder: Recorder
    meta: dict[str, dict[str, Any]] = field(default_factory=dict)
    stack: list[_Frame] = field(default_factory=list)
    paused: bool = False
    _calls: dict[str, int] = field(default_factory=dict)
    _aten: AtenNames | None = None

    def enter(self, name: str) -> None:
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        self.stack.append(_Frame(make_key(name, call)))

    def leave(self) -> None:
        if self.stack:
            self.stack.pop()

    def next_pass(self) -> None:
        """Another forward follows (generate's next step): module calls count from 0 again."""
        self._calls.clear()

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.paused or not self.stack or getattr(func, "__name__", "") in _NOT_OPS:
            return func(*args, **kwargs)
        import torch

        inputs = [v for _, v in flatten((args, kwargs)) if isinstance(v, torch.Tensor)]
        versions = [t._version for t in inputs]
        if self._aten is None:
            self._aten = AtenNames()
        with self._aten.names_of() as aten:
            out = func(*args, **kwargs)
        # `x[i] = v` returns None: what it produced is `x` as it is now.
        produced = args[0] if out is None and func is torch.Tensor.__setitem__ else out
        leaves = [(p, v) for p, v in flatten(produced) if isinstance(v, torch.Tensor)]
        if not leaves:
            return out
        frame = self.stack[-1]
        key = f"{frame.key}{OP_SEP}op{frame.count:02d}.{op_name(func)}"
        frame.count += 1
        self.meta[key] = op_meta(
            qualified_name(func), aten, self._source(), inputs, versions, leaves[0][1]
        )
        self.paused = True
        try:
            # The sink copies what it is given (DumpWriter.tensor): a later in-place op leaves
            # the recorded value as this op produced it.
            self.recorder.record(key, produced)
        finally:
            self.paused = False
        return out

    def _source(self) -> str:
        return source_line()


def op_meta(
    op: str, aten: list[str], source: str, inputs: list[Any], versions: list[int], first: Any
) -> dict[str, Any]:
    """An op's `ops` metadata: `op` as called, the `aten` ops it ran, its `source` line, its
    tensor `inputs` ([shape, dtype]; `versions`: theirs before it ran), and whether its `first`
    tensor result is a view of an input or was made in place (returned an input, or changed one)."""
    inplace = any(first is t for t in inputs[:1]) or any(
        v != t._version for t, v in zip(inputs, versions, strict=True)
    )
    return {
        "op": op,
        "aten": aten,
        "source": source,
        "inputs": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in inputs],
        "view": (not inplace) and first._is_view() and _shares(first, inputs),
        "inplace": inplace,
    }


class AtenNames:
    """Names the aten ops run inside `names_of()`'s block (`aten._softmax`, one per dispatch,
    in order): a `TorchDispatchMode` made once and entered around each recorded op only."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        names: list[str] = []

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                names.append(str(func.overloadpacket))  # `aten._softmax`, the overload left off
                return func(*args, **(kwargs or {}))

        self._names, self._mode, self._active = names, _Mode(), False

    @contextmanager
    def names_of(self) -> Iterator[list[str]]:
        """The block's aten op names, in a list filled when it ends (a fresh one each time; an
        inner block of the same names its ops to the outer one)."""
        names: list[str] = []
        if self._active:
            yield names
            return
        self._names.clear()
        self._active = True
        try:
            with self._mode:
                yield names
        finally:
            self._active = False
            names.extend(self._names)
            self._names.clear()


# Calls that return a tensor without computing one: attribute reads and the mode's own plumbing.
_NOT_OPS = frozenset({"__get__", "__set__", "__torch_function__"})


def source_line() -> str:
    """`file:line` of the innermost frame of the model's code (outside torch and modeltap).

    Where torch's own module code is the caller's (compare --ops runs a Linear by itself), the
    innermost frame of it (`torch/nn/modules/linear.py`)."""
    frame = sys._getframe(1)
    while frame is not None and _package(frame) == "modeltap":  # the mode's handler
        frame = frame.f_back
    module_code = None
    while frame is not None and _package(frame) == "torch":
        if module_code is None and frame.f_globals.get("__name__", "").startswith(_MODULES):
            module_code = frame
        frame = frame.f_back
    if frame is None or _package(frame) == "modeltap":
        frame = module_code
    return "" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _package(frame: Any) -> str:
    return str(frame.f_globals.get("__name__", "")).partition(".")[0]


def _shares(out: Any, inputs: list[Any]) -> bool:
    try:
        storage = out.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == storage for t in inputs)
    except (RuntimeError, NotImplementedError):
        return False


class _PausingSink:
    """The sink, with op capture paused while it works (its statistics are torch calls too)."""

    def __init__(self, sink: Sink, tracer: OpTracer) -> None:
        self.sink, self.tracer = sink, tracer

    def tensor(self, key: str, tensor: Any, **kwargs: Any) -> None:
        self.tracer.paused = True
        try:
            self.sink.tensor(key, tensor, **kwargs)
        finally:
            self.tracer.paused = False

    def alias(self, key: str, target: str) -> None:
        self.sink.alias(key, target)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sink, name)


@contextmanager
def op_capture(model: nn.Module, modules: list[str], recorder: Recorder) -> Iterator[OpTracer]:
    """For the block: the ops of `modules` (display names) recorded through `recorder`, whose
    sink is paused while it works. Hooks and the mode always come off."""
    from torch.overrides import TorchFunctionMode

    from modeltap.selection import ROOT

    tracer = OpTracer(recorder)
    by_name = {(n or ROOT): m for n, m in model.named_modules()}

    class _Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return tracer.call(func, args, kwargs or {})

    handles = []
    sink = recorder.sink
    recorder.sink = _PausingSink(sink, tracer)
    try:
        for name in modules:
            module = by_name[name]
            handles.append(module.register_forward_pre_hook(_enter(tracer, name)))
            handles.append(module.register_forward_hook(_leave(tracer), prepend=True))
        with _Mode():
            yield tracer
    finally:
        for handle in handles:
            handle.remove()
        recorder.sink = sink


def _enter(tracer: OpTracer, name: str) -> Any:
    def hook(module: Any, args: Any) -> None:
        tracer.enter(name)

    return hook


def _leave(tracer: OpTracer) -> Any:
    def hook(module: Any, args: Any, output: Any) -> None:
        tracer.leave()

    return hook

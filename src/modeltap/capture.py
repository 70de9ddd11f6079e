"""Attach forward hooks to the selected modules, run, and always take them off again.

A `Recorder` turns every hook call into named events for a sink: a new distinct tensor, an alias of
one already seen (dropout in eval mode and wrapper modules return their child's very tensor), or a
value that is not a tensor. Sinks decide what to keep: `MemorySink` keeps tensors in memory,
`dump.DumpWriter` computes statistics and streams them to disk.

Keys: `module` for a module whose output is one tensor; `module:part` for a part of a structured
output (tuple index, dict or ModelOutput field, joined by dots); `module@N` for the N-th extra call
of a module called more than once in one forward (the first call has no suffix); `module:in.X`
for inputs.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from modeltap.errors import RunError, SelectionError
from modeltap.selection import ROOT, unknown_name_message

if TYPE_CHECKING:
    import torch
    from torch import nn

PART_SEP = ":"
CALL_SEP = "@"
INPUT_PART = "in"


def make_key(module: str, call: int = 0, part: str = "") -> str:
    key = module if call == 0 else f"{module}{CALL_SEP}{call}"
    return f"{key}{PART_SEP}{part}" if part else key


def split_key(key: str) -> tuple[str, int, str]:
    """(module, call, part) of a key written by make_key."""
    head, _, part = key.partition(PART_SEP)
    module, sep, call = head.rpartition(CALL_SEP)
    if sep and call.isdigit():
        return module, int(call), part
    return head, 0, part


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) pairs of nested tuples, lists, dicts, ModelOutputs and dataclasses."""
    import torch

    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, Mapping):  # also ModelOutput, which holds only its non-None fields
        for name, item in value.items():
            yield from flatten(item, _join(prefix, str(name)))
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from flatten(item, _join(prefix, str(index)))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from flatten(getattr(value, f.name), _join(prefix, f.name))
    else:
        yield prefix, value


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class Sink(Protocol):
    def tensor(self, key: str, tensor: torch.Tensor) -> None: ...

    def alias(self, key: str, target: str) -> None: ...


@dataclass
class Recorder:
    """Names what the hooks see and hands it to a sink; remembers order, aliases and skips."""

    sink: Sink
    order: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    skipped_none: int = 0
    _calls: dict[tuple[str, bool], int] = field(default_factory=dict)
    # (storage, offset, shape, stride, dtype, device, version) -> (weak tensor, key)
    _seen: dict[tuple[Any, ...], tuple[weakref.ref[Any], str]] = field(default_factory=dict)

    def record(self, module: str, value: Any, *, is_input: bool = False) -> None:
        import torch

        call = self._calls.get((module, is_input), 0)
        self._calls[(module, is_input)] = call + 1
        if not is_input and isinstance(value, torch.Tensor):  # the common case, kept cheap
            self._tensor(make_key(module, call), value)
            return
        for path, leaf in flatten(value):
            part = _join(INPUT_PART, path) if is_input else path
            key = make_key(module, call, part)
            if isinstance(leaf, torch.Tensor):
                self._tensor(key, leaf)
            elif leaf is None:
                self.skipped_none += 1
            else:
                self.skipped[key] = type(leaf).__name__

    def _tensor(self, key: str, tensor: torch.Tensor) -> None:
        self.order.append(key)
        try:
            # data_ptr() already includes the storage offset.
            fingerprint: tuple[Any, ...] = (
                tensor.data_ptr(),
                tensor.shape,
                tensor.stride(),
                tensor.dtype,
                tensor.device,
                tensor._version,
            )
        except RuntimeError:  # sparse and other layouts without one data pointer
            fingerprint = (id(tensor), tensor._version)
        seen = self._seen.get(fingerprint)
        # A dead weak reference means the memory was freed and reused: a different tensor.
        if seen is not None and seen[0]() is not None:
            self.aliases[key] = seen[1]
            self.sink.alias(key, seen[1])
            return
        self._seen[fingerprint] = (weakref.ref(tensor), key)
        self.sink.tensor(key, tensor)


@contextmanager
def hooks(
    model: nn.Module,
    modules: list[str],
    sink: Sink,
    *,
    inputs: bool = False,
    train_mode: bool = False,
    replace: Callable[[str, Any], Any] | None = None,
) -> Iterator[Recorder]:
    """Hook `modules` (display names) of `model` for the duration of the block.

    The model is put in eval mode (unless `train_mode`) and every hook is removed and `training`
    restored in `finally`, so a model that went through here behaves exactly as before.
    `replace(name, output)`, when given, may return a new output for the model to go on with (the
    gradient run uses it to start a gradient path at frozen modules); None keeps the output.
    """
    named = list(model.named_modules())
    by_name = {(n or ROOT): m for n, m in named}
    missing = [n for n in modules if n not in by_name]
    if missing:
        raise SelectionError(unknown_name_message(missing[0], by_name))
    recorder = Recorder(sink)
    handles = []
    # Only touch `training` when some module differs: Module.__setattr__ is slow enough to show
    # on small models, and a model already in the right mode needs nothing.
    was_training = {m: m.training for _, m in named if m.training != train_mode}
    try:
        if was_training:
            model.train(train_mode)
        for name in modules:
            module = by_name[name]
            handles.append(module.register_forward_hook(_output_hook(recorder, name, replace)))
            if inputs:
                handles.append(
                    module.register_forward_pre_hook(_input_hook(recorder, name), with_kwargs=True)
                )
        yield recorder
    finally:
        for handle in handles:
            handle.remove()
        for _, module in named:
            # train() may be overridden to leave some modules alone: restore each one as it was.
            training = was_training.get(module, train_mode)
            if module.training != training:
                module.training = training


def _output_hook(
    recorder: Recorder, name: str, replace: Callable[[str, Any], Any] | None = None
) -> Callable[..., Any]:
    if replace is None:

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            recorder.record(name, output)

        return hook

    def replacing_hook(module: nn.Module, args: Any, output: Any) -> Any:
        new = replace(name, output)
        recorder.record(name, output if new is None else new)
        return new

    return replacing_hook


def _input_hook(recorder: Recorder, name: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        recorder.record(name, {**dict(enumerate(args)), **kwargs}, is_input=True)

    return hook


@dataclass
class Captured:
    """What an in-memory capture holds: distinct tensors, aliases and the run's bookkeeping."""

    tensors: dict[str, torch.Tensor]
    aliases: dict[str, str]
    order: list[str]
    skipped: dict[str, str]
    output: Any

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[self.aliases.get(key, key)]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.aliases

    def keys(self) -> list[str]:
        return list(self.order)


class MemorySink:
    """Keeps a reference to each distinct tensor and its version, to notice later in-place changes.

    Holding references costs nothing at capture time; a tensor that the model changed in place after
    its module returned (`x += residual`, ReLU(inplace=True)) is caught by its version counter, and
    `capture` runs again, copying just those tensors at the moment their module returns.
    """

    def __init__(self, copy_keys: frozenset[str] = frozenset()) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.versions: dict[str, int] = {}
        self.copy_keys = copy_keys

    def tensor(self, key: str, tensor: torch.Tensor) -> None:
        value = tensor.detach()
        if key in self.copy_keys:
            value = value.clone()
        self.tensors[key] = value
        self.versions[key] = value._version

    def alias(self, key: str, target: str) -> None:
        pass

    def changed(self) -> frozenset[str]:
        return frozenset(k for k, t in self.tensors.items() if t._version != self.versions[k])


def run_model(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call the model; a failure inside it becomes a RunError naming the model and the cause."""
    try:
        return model(*args, **kwargs)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RunError(
            f"{type(model).__name__}.forward failed: {first}; check the inputs' names, shapes "
            "and dtypes (MODELTAP_DEBUG=1 shows the traceback)"
        ) from exc


def capture(
    model: nn.Module,
    *args: Any,
    modules: list[str] | None = None,
    inputs: bool = False,
    train_mode: bool = False,
    seed: int | None = None,
    **kwargs: Any,
) -> Captured:
    """Run `model(*args, **kwargs)` under no_grad and return every selected module's output.

    `modules` are display names (see `selection.select_modules`); default all modules.
    """
    import torch

    names = modules if modules is not None else [n or ROOT for n, _ in model.named_modules()]

    def once(copy_keys: frozenset[str]) -> tuple[MemorySink, Recorder, Any]:
        sink = MemorySink(copy_keys)
        if seed is not None:
            torch.manual_seed(seed)
        else:
            torch.set_rng_state(rng)
        with hooks(model, names, sink, inputs=inputs, train_mode=train_mode) as recorder:
            with torch.no_grad():
                output = run_model(model, args, kwargs)
        return sink, recorder, output

    with torch.random.fork_rng(devices=[]):
        rng = torch.get_rng_state()
        sink, recorder, output = once(frozenset())
        changed = sink.changed()
        if changed:
            sink, recorder, output = once(changed)
    return Captured(sink.tensors, recorder.aliases, recorder.order, recorder.skipped, output)

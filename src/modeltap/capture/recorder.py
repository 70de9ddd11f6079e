"""Recorder: turns what the hooks see into named events for a sink.

An event is a new distinct tensor, an alias of one already seen (dropout in eval mode and wrapper
modules return their child's very tensor), or a value that is not a tensor. Sinks decide what to
keep: `MemorySink` keeps tensors in memory, `dump.DumpWriter` computes statistics and streams them
to disk.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from modeltap.capture.keys import INPUT_PART, _join, flatten, make_key

if TYPE_CHECKING:
    import torch

    from modeltap.stats import TensorStats


class Sink(Protocol):
    def tensor(self, key: str, tensor: torch.Tensor) -> None: ...

    def alias(self, key: str, target: str) -> None: ...


@runtime_checkable
class DumpSink(Sink, Protocol):
    """A sink that writes a dump (`dump.DumpWriter`, and the dump verb's device log in front of
    one): what the compile backend asks of it besides `Sink`'s two methods."""

    def tensor(self, key: str, tensor: torch.Tensor, *, final: bool = False) -> None:
        """`final`: nothing will change `tensor` any more (a finished forward logged it), so it is
        read where it is, not copied first."""

    def computed(self, key: str, stats: TensorStats, device: Any = None) -> None:
        """Statistics of a tensor computed elsewhere (in a compiled graph)."""

    def graph_stats_options(self) -> dict[str, Any] | None:
        """What a compiled graph needs to compute this dump's statistics itself, or None when
        they need the tensors."""


@dataclass
class Recorder:
    """Names what the hooks see and hands it to a sink; remembers order, aliases and skips."""

    sink: Sink
    order: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    skipped_none: int = 0
    # While set, hooks' values are dropped unnamed (a forward generate runs outside its loop).
    paused: bool = False
    # Keys whose tensor changed in place between its hook and `drain` (deferred hooks only).
    changed: set[str] = field(default_factory=set)
    _pending: list[tuple[str, Any, bool, Any]] = field(default_factory=list)
    _calls: dict[tuple[str, bool], int] = field(default_factory=dict)
    # (storage, offset, shape, stride, dtype, device, version) -> (weak tensor, key)
    _seen: dict[tuple[Any, ...], tuple[weakref.ref[Any], str]] = field(default_factory=dict)

    def defer(self, module: str, value: Any, *, is_input: bool = False) -> None:
        """What a hook on the forward's critical path does: keep the value and its version(s),
        nothing else. `drain` names them after the forward."""
        import torch

        if self.paused:
            return
        if type(value) is torch.Tensor and not is_input:
            self._pending.append((module, value, is_input, value._version))
            return
        # A structure is taken apart now: a list the model appends to later keeps today's parts.
        leaves = list(flatten(value))
        versions = [v._version for _, v in leaves if isinstance(v, torch.Tensor)]
        self._pending.append((module, _Leaves(leaves), is_input, versions))

    def drain(self) -> None:
        """Name and hand to the sink what `defer` kept, in call order, as `record` would have; a
        tensor changed in place since its hook goes to `changed` (its value here is not the one
        its module returned)."""
        import torch

        pending, self._pending = self._pending, []
        calls = self._calls
        tensor = self._tensor
        for module, value, is_input, versions in pending:
            if type(value) is _Leaves:
                before = len(self.order)
                self._leaves(module, value.leaves, is_input, iter(versions))
                now = [v._version for _, v in value.leaves if isinstance(v, torch.Tensor)]
                # One key per tensor leaf, in the same order.
                keys = self.order[before:]
                changed = (k for k, v, w in zip(keys, versions, now, strict=True) if v != w)
                self.changed.update(changed)
                continue
            slot = (module, False)
            call = calls.get(slot, 0)
            calls[slot] = call + 1
            key = module if call == 0 else make_key(module, call)
            tensor(key, value, versions)
            if value._version != versions:
                self.changed.add(key)

    def next_pass(self) -> None:
        """Another forward of the same model follows (a decoding step of `generate`): its calls
        are counted from the first again, and no tensor of it is an alias of the last pass's."""
        self._calls.clear()
        self._seen.clear()

    def record(self, module: str, value: Any, *, is_input: bool = False) -> None:
        import torch

        if self.paused:
            return
        if not is_input and isinstance(value, torch.Tensor):  # the common case, kept cheap
            call = self._calls.get((module, is_input), 0)
            self._calls[(module, is_input)] = call + 1
            self._tensor(make_key(module, call), value)
            return
        self._leaves(module, flatten(value), is_input)

    def _leaves(
        self,
        module: str,
        leaves: Iterable[tuple[str, Any]],
        is_input: bool,
        versions: Iterator[int] | None = None,
    ) -> None:
        import torch

        call = self._calls.get((module, is_input), 0)
        self._calls[(module, is_input)] = call + 1
        for path, leaf in leaves:
            part = _join(INPUT_PART, path) if is_input else path
            key = make_key(module, call, part)
            if isinstance(leaf, torch.Tensor):
                self._tensor(key, leaf, None if versions is None else next(versions))
            elif leaf is None:
                self.skipped_none += 1
            else:
                self.skipped[key] = type(leaf).__name__

    def _tensor(self, key: str, tensor: torch.Tensor, version: int | None = None) -> None:
        """`version`: the tensor's version when its module returned, if that was earlier."""
        self.order.append(key)
        if version is None:
            version = tensor._version
        try:
            # data_ptr() already includes the storage offset.
            fingerprint: tuple[Any, ...] = (
                tensor.data_ptr(),
                tensor.shape,
                tensor.stride(),
                tensor.dtype,
                tensor.device,
                version,
            )
        except RuntimeError:  # sparse and other layouts without one data pointer
            fingerprint = (id(tensor), version)
        seen = self._seen.get(fingerprint)
        # A dead weak reference means the memory was freed and reused: a different tensor.
        if seen is not None and seen[0]() is not None:
            self.aliases[key] = seen[1]
            self.sink.alias(key, seen[1])
            return
        self._seen[fingerprint] = (weakref.ref(tensor), key)
        self.sink.tensor(key, tensor)


@dataclass
class _Leaves:
    """A structured output taken apart by a deferred hook: (path, leaf) pairs."""

    leaves: list[tuple[str, Any]]


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
    """Keeps a reference to each distinct tensor, and a copy of those in `copy_keys`.

    Holding references costs nothing at capture time. A tensor that the model changed in place
    after its module returned (`x += residual`, ReLU(inplace=True)) is caught by its version
    counter (`Recorder.changed`), and `capture` runs again, copying just those tensors at the
    moment their module returns.
    """

    def __init__(self, copy_keys: frozenset[str] = frozenset()) -> None:
        import torch

        self.tensors: dict[str, torch.Tensor] = {}
        self.copy_keys = copy_keys
        self._plain = torch.Tensor

    def tensor(self, key: str, tensor: torch.Tensor) -> None:
        # Detached only when it needs it: an output under no_grad is the value itself, and a
        # detached alias costs as much as the rest of a key's bookkeeping after the forward. A
        # Parameter (even frozen) or other subclass is handed back as a plain tensor, as before.
        plain = type(tensor) is self._plain and not tensor.requires_grad
        value = tensor if plain else tensor.detach()
        self.tensors[key] = value.clone() if key in self.copy_keys else value

    def alias(self, key: str, target: str) -> None:
        pass

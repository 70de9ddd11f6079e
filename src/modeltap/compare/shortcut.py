"""Short-circuited replays: a module replayed with its selected children's recorded outputs.

During the reference's forward each selected module that runs pushes a `Frame`; when a selected
module returns, its output is appended (as a `Record`) to the frame of the selected module that
called it, its nearest selected caller, with the inputs it was called with. When that caller's
own hook fires, it is replayed with each recorded child standing in for itself: the child's
`forward` is shadowed (an instance attribute, removed again on the way out) by a function that
hands the call's inputs to `convert` with the next record (the replayer returns the reference
child's output on them, see `Replayer.stand_in`). So a replay runs only the module's own code
(what is not in a selected child) where its children get what the forward gave them.

A stand-in is only faithful when the replay calls the children as the forward did and their
outputs are what the parent saw; `Mismatch` says when not, and the caller replays in full.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modeltap.capture import flatten

if TYPE_CHECKING:
    from torch import nn

# Leaves of an output that a stand-in may hand over as they are.
_SCALARS = (type(None), bool, int, float, complex, str)
_UNSET = object()
# Module.__call__ calls this instance attribute, where set, instead of `_call_impl` (torch's slot
# for `module.compile()`): a stand-in there replaces the whole call, the child's hooks included.
_CALL = "_compiled_call_impl"


class Mismatch(Exception):
    """A short-circuited replay would not be faithful; the message says why."""


@dataclass
class Record:
    """One call of a selected child inside its caller's call."""

    child: str
    output: Any
    versions: tuple[int, ...] | None  # the output's tensors' version counters when it returned
    valid: bool = True  # the child's own replay reproduced its output
    # The call's (args, kwargs) and their tensors' version counters when it began; None when the
    # child changed them in place (they are no longer what it was given).
    inputs: Any = None
    input_versions: tuple[int, ...] | None = None


@dataclass
class Frame:
    """A selected module's running call, collecting its selected children's outputs."""

    name: str
    wanted: bool  # the module will be replayed: keep its children's outputs until it returns
    records: list[Record] = field(default_factory=list)
    inline: list[str] = field(default_factory=list)  # children it must compute itself
    input_versions: tuple[int, ...] | None = None  # its inputs' when the call began


def versions(output: Any) -> tuple[int, ...] | None:
    """The version counters of an output's tensors (bumped by every in-place change); None when
    a tensor has none (an inference tensor)."""
    import torch

    try:
        return tuple(t._version for _, t in flatten(output) if isinstance(t, torch.Tensor))
    except RuntimeError:
        return None


def changed(records: list[Record]) -> str | None:
    """The first child whose recorded output was changed in place since it returned."""
    for record in records:
        now = versions(record.output)
        if record.versions is None or now != record.versions:
            return record.child
    return None


def rebuild(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """`value` with each tensor replaced by `leaf(tensor)`, containers rebuilt as their own type
    (tuples, named tuples, lists, dicts, dataclasses such as ModelOutput); `Mismatch` for any
    other object, which a stand-in could not hand over without sharing it."""
    import torch

    if isinstance(value, torch.Tensor):
        return leaf(value)
    if isinstance(value, _SCALARS):
        return value
    if type(value) in (tuple, list):
        return type(value)(rebuild(v, leaf) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(rebuild(v, leaf) for v in value))
    if type(value) is dict:
        return {k: rebuild(v, leaf) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: rebuild(getattr(value, f.name), leaf)
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    raise Mismatch(f"a child returns a {type(value).__name__}, which can't be cast")


def check_castable(records: list[Record]) -> None:
    for record in records:
        rebuild(record.output, lambda t: t)


class Shortcut:
    """Within the block, each child in `records` returns `convert(record, args, kwargs)` for its
    next record and the call's inputs instead of running; `modules` gives the module to shadow
    for a name."""

    def __init__(
        self,
        records: list[Record],
        modules: Callable[[str], nn.Module],
        convert: Callable[[Record, tuple[Any, ...], dict[str, Any]], Any],
    ) -> None:
        self.records = records
        self.modules = modules
        self.convert = convert
        self.cursor = 0
        self.failure: str | None = None
        self.saved: list[tuple[nn.Module, Any, Any]] = []

    def __enter__(self) -> Shortcut:
        for name in dict.fromkeys(r.child for r in self.records):
            module = self.modules(name)
            if any(module is m for m, _, _ in self.saved):
                self._restore()
                raise Mismatch(f"two children are one module in the replayed model ('{name}')")
            state = module.__dict__
            self.saved.append((module, state.get("forward", _UNSET), state.get(_CALL, _UNSET)))
            # Set in __dict__ directly: an instance attribute shadows the class's forward, and
            # Module.__setattr__ (or a wrapper's own) is bypassed. The call slot too, so that the
            # child's hooks (a quantized Linear's input pre-hook, a fault) are the child's own
            # computation and stay out of its caller's replay; forward for a direct .forward().
            stand_in = self._stand_in(name)
            state["forward"] = stand_in
            if hasattr(module, _CALL):
                state[_CALL] = stand_in
        return self

    def __exit__(self, *exc: Any) -> None:
        self._restore()

    def _restore(self) -> None:
        for module, forward, call in reversed(self.saved):
            for attribute, old in (("forward", forward), (_CALL, call)):
                if old is _UNSET:
                    module.__dict__.pop(attribute, None)
                else:
                    module.__dict__[attribute] = old
        self.saved = []

    def _stand_in(self, name: str) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.cursor >= len(self.records):
                self._fail(f"the replay calls '{name}' more often than the forward did")
            record = self.records[self.cursor]
            if record.child != name:
                self._fail(f"the replay calls '{name}' where the forward called '{record.child}'")
            self.cursor += 1
            return self.convert(record, args, kwargs)

        return forward

    def _fail(self, reason: str) -> None:
        self.failure = reason
        raise Mismatch(reason)

    def check(self) -> None:
        """After the replay: every recorded call was made, in order (also when the module
        caught the Mismatch a stand-in raised)."""
        if self.failure:
            raise Mismatch(self.failure)
        if self.cursor != len(self.records):
            raise Mismatch(
                f"the replay called its children {self.cursor} times, the forward "
                f"{len(self.records)} times"
            )

"""The non-finite tripwire: which module produced the first NaN/Inf of a step.

Every hooked output gets one reduction (its sum, which is NaN or Inf exactly when some element is,
barring float32 overflow of the sum, which a recheck rules out) kept on the device; the flags of a
forward are read in one go when the root module returns, those of a backward when the backward
ends. Only when a flag is bad are tensors looked at again, to find the first module, in execution
order, whose output is non-finite while its inputs were finite: the one that *produced* the value,
not the ones that passed it on. Gradients get the same treatment in backward order, with a module's
"inputs" being the gradients w.r.t. its outputs and its "output" the gradients w.r.t. its inputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from modeltap.capture import INPUT_PART, flatten, make_key
from modeltap.errors import RunError

if TYPE_CHECKING:
    import torch
    from torch import nn

FORWARD = "forward"
BACKWARD = "backward"


@dataclass
class Trip:
    """Where the first non-finite value of a step came from."""

    step: int
    rank: int
    phase: str  # FORWARD or BACKWARD
    module: str
    module_class: str
    key: str  # the non-finite tensor: an output key, or grad/<key> of a module input
    stats: dict[str, Any]  # its statistics (or {"sum": ...} when only the flag is known)
    inputs: dict[str, dict[str, Any]]  # what went in, all finite: input keys or grad/<output key>
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # non-finite parameters
    propagated: bool = False  # no module had finite inputs: the first non-finite tensor is shown
    file: str | None = None
    # A lazily checked step (record.sentinel) whose run again under the full tripwire was
    # finite: what was seen non-finite, and why it could not be made again.
    unreproduced: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def message(self) -> str:
        bad = _count(self.stats)
        where = f"non-finite {self.phase} at step {self.step} (rank {self.rank}): "
        if self.unreproduced is not None:
            return where + self.unreproduced
        if self.phase == BACKWARD and self.propagated:
            text = where + (
                f"the gradient '{self.key}' ({bad}) was already non-finite when it reached "
                f"module '{self.module}' ({self.module_class}): it came from the loss or from "
                "code outside the hooked modules"
            )
        else:
            what = "output" if self.phase == FORWARD else "gradient w.r.t. its input"
            text = where + (
                f"module '{self.module}' ({self.module_class}) {what} '{self.key}' has {bad}"
            )
            if self.propagated:
                text += "; its inputs were already non-finite (no hooked module made them so)"
            elif self.inputs:
                shown = list(self.inputs.items())[:4]
                text += " from finite inputs (" + "; ".join(f"{k}: {_brief(s)}" for k, s in shown)
                text += ")"
        if self.params:
            text += "; non-finite parameters: " + ", ".join(
                f"{k} ({_count(s)})" for k, s in self.params.items()
            )
        if self.file:
            text += f"; full tensors of the step in {self.file}"
        return text


class NonFiniteError(RunError):
    """Raised by the tripwire; `trip` says where the first non-finite value came from."""

    def __init__(self, trip: Trip) -> None:
        super().__init__(trip.message())
        self.trip = trip


def _count(stats: dict[str, Any]) -> str:
    if "nan" in stats or "inf" in stats:
        return f"{stats.get('nan', 0)} NaN / {stats.get('inf', 0)} Inf"
    return f"non-finite values (sum {stats.get('sum')})"


def _brief(stats: dict[str, Any]) -> str:
    shown = {k: stats[k] for k in ("norm", "min", "max", "sum") if stats.get(k) is not None}
    return ", ".join(f"{k} {v:.4g}" for k, v in shown.items()) or "empty"


def flag(tensor: torch.Tensor) -> torch.Tensor:
    """One reduction that is finite exactly when every element is (see the module docstring)."""
    import torch

    t = tensor.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype in (torch.float16, torch.bfloat16):
        return t.sum(dtype=torch.float32)
    return t.sum()


def float_leaves(value: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    import torch

    if isinstance(value, torch.Tensor):  # the common case, kept cheap
        return [(prefix, value)] if value.is_floating_point() or value.is_complex() else []
    return [
        (path, t)
        for path, t in flatten(value, prefix)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    ]


@dataclass
class Call:
    """One call of a hooked module in this step: what came in and out, and their flags."""

    name: str
    call: int
    module: nn.Module
    output: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[tuple[str, torch.Tensor]]
    flags: list[torch.Tensor]
    in_slots: list[int] = field(default_factory=list)
    out_slots: list[int] = field(default_factory=list)

    def inputs(self) -> list[tuple[str, torch.Tensor]]:
        return float_leaves({**dict(enumerate(self.args)), **self.kwargs}, INPUT_PART)

    def key(self, path: str = "") -> str:
        return make_key(self.name, self.call, path)


@dataclass
class Shape:
    """What the backward check needs of a call once its tensors are let go."""

    name: str
    call: int
    module_class: str
    in_slots: list[int]
    out_slots: list[int]


class BackwardEnd:
    """Calls `callback` once, when the backward in which `arm()` was first called ends (from a
    gradient hook: autograd's queue of callbacks for the running backward)."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback
        self._queued = False

    def arm(self) -> None:
        if not self._queued:
            from torch.autograd import Variable

            self._queued = True
            Variable._execution_engine.queue_callback(self._done)

    def _done(self) -> None:
        self._queued = False
        self.callback()


class Watch:
    """Collects the flags of one step's forward(s) and backward(s); finds the producer."""

    def __init__(self, *, hold_grads: bool, on_backward_end: Callable[[], None]) -> None:
        self.hold_grads = hold_grads
        self.backward_end = BackwardEnd(on_backward_end)
        self.calls: list[Call] = []
        self.shapes: list[Shape] = []
        self.counts: dict[str, int] = {}
        self.slot_keys: list[str] = []
        self.slot_of: dict[int, int] = {}
        self.flag_of: dict[tuple[int, int], torch.Tensor] = {}
        self.grad_flags: dict[int, tuple[int, torch.Tensor]] = {}
        self.grads: dict[int, torch.Tensor] = {}
        self.forward_checked = True
        self._order = itertools.count()

    # -- forward ----------------------------------------------------------------------------
    def forward(self, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        call = self.counts.get(name, 0)
        self.counts[name] = call + 1
        outputs = float_leaves(output)
        c = Call(
            name, call, module, output, args, kwargs, outputs, [self._flag(t) for _, t in outputs]
        )
        if any(t.requires_grad for _, t in outputs):
            c.in_slots = [self._slot(t, c.key(p)) for p, t in c.inputs() if t.requires_grad]
            c.out_slots = [self._slot(t, c.key(p)) for p, t in outputs if t.requires_grad]
            self.shapes.append(Shape(name, call, type(module).__name__, c.in_slots, c.out_slots))
        self.calls.append(c)
        self.forward_checked = False

    def _flag(self, tensor: torch.Tensor) -> torch.Tensor:
        """The flag of a tensor, once per tensor and version: a wrapper returning its child's
        very tensor costs nothing (the calls hold the tensors, so ids are not reused)."""
        key = (id(tensor), tensor._version)
        found = self.flag_of.get(key)
        if found is None:
            found = self.flag_of[key] = flag(tensor)
        return found

    def _slot(self, tensor: torch.Tensor, key: str) -> int:
        slot = self.slot_of.get(id(tensor))
        if slot is None:
            slot = self.slot_of[id(tensor)] = len(self.slot_keys)
            self.slot_keys.append(key)
            tensor.register_hook(self._grad_hook(slot))
        return slot

    def find_forward(self) -> tuple[Call, str, bool] | None:
        """(call, output path, propagated) of the producer of the first non-finite output."""
        import torch

        self.forward_checked = True
        index = [
            (c, path, f)
            for c in self.calls
            for (path, _), f in zip(c.outputs, c.flags, strict=True)
        ]
        bad = _bad(f for _, _, f in index)
        if not bad:
            return None
        first: tuple[Call, str, bool] | None = None
        for i in bad:
            c, path, _ = index[i]
            tensor = dict(c.outputs)[path]
            if bool(torch.isfinite(tensor).all()):
                continue  # the float32 sum overflowed; every element is finite
            if all(bool(torch.isfinite(x).all()) for _, x in c.inputs()):
                return c, path, False
            first = first or (c, path, True)
        return first

    def let_go(self) -> None:
        """Drop the forward's tensors (the backward check needs only the slots)."""
        self.calls = []
        self.slot_of = {}
        self.flag_of = {}

    # -- backward ---------------------------------------------------------------------------
    def _grad_hook(self, slot: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.backward_end.arm()
            self.grad_flags[slot] = (next(self._order), flag(grad))
            if self.hold_grads:
                self.grads[slot] = grad

        return hook

    def find_backward(self) -> tuple[Shape, int, bool] | None:
        """(call shape, non-finite slot, propagated) of the first non-finite gradient's producer.

        The producer is the module whose gradient w.r.t. an input is non-finite while the
        gradients w.r.t. its outputs that arrived were finite; among several, the one whose bad
        input gradient came first, then the innermost (its forward ended first).
        """
        slots = sorted(self.grad_flags, key=lambda s: self.grad_flags[s][0])
        bad_at = _bad(self.grad_flags[s][1] for s in slots)
        if not bad_at:
            return None
        bad = {slots[i] for i in bad_at}
        order = {s: self.grad_flags[s][0] for s in slots}
        best: tuple[int, int, Shape, int] | None = None
        for i, shape in enumerate(self.shapes):
            fired = [s for s in shape.out_slots if s in order]
            bad_in = [s for s in shape.in_slots if s in bad]
            if not fired or not bad_in or any(s in bad for s in fired):
                continue
            slot = min(bad_in, key=order.__getitem__)
            candidate = (order[slot], i, shape, slot)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is not None:
            return best[2], best[3], False
        first = slots[bad_at[0]]
        owner = next((s for s in self.shapes if first in s.out_slots), None)
        owner = owner or next((s for s in self.shapes if first in s.in_slots), None)
        if owner is None:
            return None
        return owner, first, True

    def incoming(self, shape: Shape) -> dict[int, float]:
        """Sums of the gradients w.r.t. a call's outputs (the backward's 'inputs')."""
        return {s: float(self.grad_flags[s][1]) for s in shape.out_slots if s in self.grad_flags}

    def reset_backward(self) -> None:
        self.shapes = []
        self.slot_keys = []
        self.slot_of = {}
        self.grad_flags = {}
        self.grads = {}

    def reset(self) -> None:
        self.let_go()
        self.reset_backward()
        self.counts = {}
        self.forward_checked = True


def _bad(flags: Any) -> list[int]:
    """Positions of the non-finite flags, read with one device sync per device."""
    import torch

    flags = list(flags)
    if not flags:
        return []
    by_device: dict[Any, list[int]] = {}
    for i, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(i)
    bad = []
    for positions in by_device.values():
        stacked = torch.stack([flags[i].to(torch.float64) for i in positions])
        finite = torch.isfinite(stacked)
        if bool(finite.all()):
            continue
        bad += [positions[j] for j in (~finite).nonzero().flatten().tolist()]
    return sorted(bad)

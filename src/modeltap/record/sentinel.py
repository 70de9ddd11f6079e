"""The tripwire of a step that is not recorded: check where non-finite values end up, and look
for the module that made one only when one does.

A NaN or Inf that a module's forward makes reaches the model's outputs (arithmetic passes it on)
unless the code after it masks it out. One that a backward makes reaches the gradients w.r.t. the
outputs of the *source* modules: those whose output needs a gradient while no input does (the
embeddings). Every activation gradient flows down to them. So on a step that is not recorded:

- the root's float outputs are checked (one reduction each);
- the sources' output gradients are checked (one reduction each) when the backward ends;
- the root's inputs, the RNG states it started from, and the gradients its small outputs
  (a loss) received are kept by reference until the step's backward has been checked.

Only when one of these checks finds a non-finite value does the step run again, from the same
inputs and RNG states and in the same autocast regions, under the full tripwire (every module's
output and gradient, `Watch`).
That run names the producer as a recorded step would. A forward runs once more, and for a
backward trip its backward too, through `torch.autograd.grad`, which adds nothing to `.grad`.

What this checks less than the full tripwire (`record(..., eager_tripwire=True)`):
- a non-finite activation that the code after it masks out;
- a non-finite parameter gradient that is made from finite activations and output gradients
  (an overflow of the weight gradient's own sum);
- the producer of a backward whose loss the model doesn't return: its large outputs' gradients
  are not kept, so the backward is not run again, and the trip (`Trip.unreproduced`) names only
  the first source module whose output gradient was non-finite.

"dump" and the flight recorder write what that re-run holds: it draws what the step drew.
A run that can't be made again the same way (non-deterministic kernels, inputs changed in place
since) is reported as such. The sources are learned from the first fully watched forward:
until then, and on recorded steps, the full tripwire runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from modeltap.record.tripwire import BackwardEnd, _bad, flag, float_leaves

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

# A root output this small has its gradient kept for a backward re-run (a loss, a few logits).
HELD_GRAD_ELEMENTS = 1 << 16


@dataclass
class Forward:
    """One root forward of the step: what a re-run needs."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: dict[str, torch.Tensor]
    # (device type, dtype) of each autocast region it ran in: the re-run computes in the same
    # precision (a float16 overflow is no overflow in float32)
    autocast: list[tuple[str, torch.dtype]] = field(default_factory=list)
    # the autograd nodes of its float outputs that need a gradient (not the tensors: a large
    # output held through the backward would cost its memory)
    nodes: list[Any] = field(default_factory=list)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # by position in `nodes`
    unheld: set[int] = field(default_factory=set)  # outputs whose gradient came but wasn't kept


class Sentinel:
    """The per-step state of the lazy tripwire (see the module docstring)."""

    def __init__(self, on_backward_end: Callable[[], None]) -> None:
        self.backward_end = BackwardEnd(on_backward_end)
        self.sources: set[str] | None = None  # None until a fully watched forward found them
        self.forwards: list[Forward] = []
        self.source_flags: list[tuple[str, torch.Tensor]] = []

    # -- forward ----------------------------------------------------------------------------
    def begin(self, args: tuple[Any, ...], kwargs: dict[str, Any], rng: Any) -> None:
        self.forwards.append(Forward(args, dict(kwargs), rng, autocast_regions()))

    def root_output(self, output: Any) -> bool:
        """Check the root's float outputs; True when one is non-finite. Outputs that need a
        gradient get a hook that notes (and, when small, keeps) the gradient they receive."""
        if _bad(flag(t) for _, t in float_leaves(output)):
            return True
        if self.forwards:
            forward = self.forwards[-1]
            for t in grad_leaves(output):
                forward.nodes.append(t.grad_fn)
                held = t.numel() <= HELD_GRAD_ELEMENTS
                t.register_hook(self._output_hook(forward, len(forward.nodes) - 1, held))
        return False

    def source_output(self, name: str, output: Any) -> None:
        for t in grad_leaves(output):
            t.register_hook(self._source_hook(name))

    # -- backward ---------------------------------------------------------------------------
    def _output_hook(self, forward: Forward, i: int, held: bool) -> Callable[..., None]:
        def hook(grad: torch.Tensor) -> None:
            self.backward_end.arm()
            if held:
                forward.grads[i] = grad
            else:
                forward.unheld.add(i)

        return hook

    def _source_hook(self, name: str) -> Callable[..., None]:
        def hook(grad: torch.Tensor) -> None:
            self.backward_end.arm()
            self.source_flags.append((name, flag(grad)))

        return hook

    def bad_source(self) -> str | None:
        """The first source (in gradient order) whose output gradient was non-finite."""
        bad = _bad(f for _, f in self.source_flags)
        return self.source_flags[bad[0]][0] if bad else None

    @staticmethod
    def backward_starts_of(
        forwards: list[Forward],
    ) -> list[tuple[int, int, torch.Tensor]] | None:
        """(forward, output position, gradient) from which the step's backward can run again:
        the kept gradients of outputs that no other kept output was computed from (a loss, not
        the logits it was computed from). None when an output whose gradient wasn't kept (too
        large) is not among what the kept ones were computed from: the backward started there
        too, and can't be run again."""
        kept = [(f, i, g) for f, fw in enumerate(forwards) for i, g in fw.grads.items()]
        nodes = [forwards[f].nodes[i] for f, i, _ in kept]
        below = _reachable([n for n in nodes if n is not None])
        starts = [
            start
            for start, node in zip(kept, nodes, strict=True)
            if node is not None and node not in below[node]
        ]
        unheld = [fw.nodes[i] for fw in forwards for i in fw.unheld]
        if not starts or any(n is not None and n not in below[None] for n in unheld):
            return None
        return starts

    def backward_done(self) -> None:
        """A backward ended checked: let go of the forwards it ran through (their outputs
        received a gradient). A forward whose backward is still to come (two forwards, then
        their two backwards) stays kept for it."""
        self.forwards = [f for f in self.forwards if not (f.grads or f.unheld)]
        self.source_flags = []

    def reset(self) -> None:
        self.forwards = []
        self.source_flags = []


def autocast_regions() -> list[tuple[str, torch.dtype]]:
    """(device type, dtype) of each autocast region the caller is in."""
    import torch

    return [
        (device, torch.get_autocast_dtype(device))
        for device in ("cpu", "cuda")
        if torch.is_autocast_enabled(device)
    ]


def grad_leaves(output: Any) -> list[torch.Tensor]:
    """The float tensors of `output` that need a gradient, in the order `Forward.nodes` has
    them (a re-run finds its own outputs at the same positions)."""
    return [t for _, t in float_leaves(output) if t.requires_grad]


def _reachable(nodes: list[Any]) -> dict[Any, set[Any]]:
    """For each node, the autograd nodes reachable from the others (not counting itself);
    under None, those reachable from any."""
    seen_from: dict[Any, set[Any]] = {}
    for node in nodes:
        seen: set[Any] = set()
        stack = [n for n, _ in node.next_functions if n is not None]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack.extend(m for m, _ in n.next_functions if m is not None)
        seen_from[node] = seen
    result: dict[Any, set[Any]] = {None: set().union(*seen_from.values()) if seen_from else set()}
    for node in nodes:
        result[node] = set().union(*(s for n, s in seen_from.items() if n is not node))
    return result

"""The tripwire's checks, a part of `Recording` (record.recording): when the full watch
(record.tripwire) or the sentinel of a step that is not recorded (record.sentinel) looks for
non-finite values, the sentinel's re-run of a step under the full watch, and the trips, with
what each one found."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from modeltap.capture import Recorder
from modeltap.dump import GRAD_PREFIX, DumpWriter
from modeltap.record import dist
from modeltap.record.optimizer_hooks import scaler_enabled
from modeltap.record.sentinel import grad_leaves
from modeltap.record.tripwire import BACKWARD, FORWARD, NonFiniteError, Trip
from modeltap.selection import ROOT

if TYPE_CHECKING:
    from torch import nn

    from modeltap.record.tripwire import Call, Shape

logger = logging.getLogger("modeltap.record")


class NonFiniteChecks:
    """Checking forwards and backwards for non-finite values, and tripping (`Recording`'s state)."""

    def _rng_hook(self, name: str) -> Callable[..., None]:
        """A forward pre-hook keeping the RNG states a training call starts from."""
        import torch

        from modeltap.record.flight import rng_states

        grad_enabled = torch.is_grad_enabled
        model = self.model

        def hook(module: nn.Module, args: Any) -> None:
            watch = self._watch
            if self._lazy:
                return  # a lazily checked step keeps its RNG states once, for a re-run
            if watch is not None and model.training and grad_enabled():
                self._rng[(name, watch.counts.get(name, 0))] = rng_states(module)

        return hook

    def _before_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if module.training and _grad_enabled():
            self._root_ran = True
            if self._lazy:
                from modeltap.record.flight import rng_states

                self._sentinel.begin(args, kwargs, rng_states(module))  # type: ignore[union-attr]
        watch = self._watch
        if watch is not None and watch.calls and watch.forward_checked and not watch.grad_flags:
            # A forward whose tensors were kept for a backward that never came (no_grad, eval).
            watch.let_go()

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._lazy:
            self._check_forward()
        elif module.training and _grad_enabled():
            if self._sentinel.root_output(output):  # type: ignore[union-attr]
                self._rerun(FORWARD, "the model's output")

    def _after_lazy_backward(self) -> None:
        """The end of a backward on a step the sentinel checks (record.sentinel)."""
        sentinel = self._sentinel
        assert sentinel is not None
        source = sentinel.bad_source()
        if source is None or self._pending is not None:  # (the step's first one is named)
            sentinel.backward_done()
        elif self.options.scaler is not None and scaler_enabled(self.options.scaler):
            sentinel.backward_done()  # what a GradScaler looks for: see _check_backward
        elif any(t.step == self.step_index and t.phase == FORWARD for t in self.trips[-1:]):
            sentinel.backward_done()  # (warn) the NaN of a forward that tripped, named already
        else:
            self._rerun(BACKWARD, f"the gradient of '{source}'s output")

    def _rerun(self, phase: str, seen: str) -> None:
        """The step's forwards (and for a backward trip, its backward) again, from the same
        inputs and RNG states, under the full tripwire, which trips as a recorded step would;
        when it doesn't, the trip says the step could not be made again."""
        import torch

        from modeltap.record.flight import rng_states, set_rng_states

        sentinel, watch = self._sentinel, self._watch
        assert sentinel is not None and watch is not None
        forwards, sentinel.forwards = sentinel.forwards, []
        starts = sentinel.backward_starts_of(forwards) if phase == BACKWARD else None
        trips = len(self.trips)
        saved = rng_states(self.model)
        self._lazy = False
        watch.reset()
        try:
            with torch.enable_grad():
                outputs = []
                for forward in forwards:
                    set_rng_states(forward.rng)
                    with contextlib.ExitStack() as regions:
                        for device, dtype in forward.autocast:
                            regions.enter_context(torch.autocast(device, dtype=dtype))
                        outputs.append(self.model(*forward.args, **forward.kwargs))
                if starts is not None:
                    tensors = [grad_leaves(outputs[f])[i] for f, i, _ in starts]
                    params = [p for _, p in self._named_params if p.requires_grad]
                    # the watch checks this backward as it ends, as it would the step's
                    torch.autograd.grad(
                        tensors, params, [g for _, _, g in starts], allow_unused=True
                    )
        finally:
            set_rng_states(saved)
            watch.reset()
            sentinel.reset()
            if phase == FORWARD:  # their backward is still to come (warn goes on)
                sentinel.forwards = forwards
            self._lazy = True
        if len(self.trips) == trips and (phase == FORWARD or self._pending is None):
            trip = self._unreproduced(phase, seen, backward_kept=starts is not None)
            if phase == FORWARD:
                self._trip(trip)
            else:
                self._pending = (trip, None)  # tripped if an optimizer step takes them

    def _after_backward(self) -> None:
        self._check_backward()

    def _check_pending(self) -> None:
        if self._watch is None:
            return
        if not self._watch.forward_checked:
            self._check_forward()
        if self._watch.grad_flags:
            self._check_backward()

    def _check_forward(self) -> None:
        watch = self._watch
        if watch is None or watch.forward_checked:
            return
        found = watch.find_forward()
        if found is None:
            if self._sentinel is not None and self._sentinel.sources is None and watch.calls:
                if self._root_ran:  # what the sentinel watches on the steps not recorded
                    self._sentinel.sources = {s.name for s in watch.shapes if not s.in_slots}
                else:  # the loop calls submodules (Lightning's training_step calling
                    # self.net): no forward of the model to run again, so the full check stays
                    self._sentinel = None
            self._rng = {}
            if not self.options.on_nonfinite.startswith("dump"):
                watch.let_go()
            return
        self._trip(self._forward_trip(*found))

    def _check_backward(self) -> None:
        watch = self._watch
        if watch is None:
            return
        if not watch.forward_checked:  # a loop that never calls the model's own forward
            self._check_forward()  # (its root hook checks it): its forward came first
        try:
            found = watch.find_backward()
            scaled = self.options.scaler is not None and scaler_enabled(self.options.scaler)
            if found is not None and not scaled and self._pending is None:
                # Tripped when an optimizer step is about to apply them (`_gradients_final`);
                # a step that none takes is reported as skipped (`_note_skipped`). Inf/NaN
                # gradients are what a GradScaler looks for: with one known, it skips the step.
                self._pending = (self._backward_trip(*found), self._held_backward())
        finally:
            if self.options.on_nonfinite.startswith("dump"):
                watch.let_go()
            watch.reset_backward()

    def _forward_trip(self, call: Call, path: str, propagated: bool) -> Trip:
        from modeltap.stats import tensor_stats

        tensor = dict(call.outputs)[path]
        inputs = {
            call.key(p): tensor_stats(t, dead_threshold=self.options.dead_threshold).to_json()
            for p, t in call.inputs()
        }
        trip = Trip(
            step=self.step_index,
            rank=self.rank.rank,
            phase=FORWARD,
            module=call.name,
            module_class=type(call.module).__name__,
            key=call.key(path),
            stats=tensor_stats(tensor).to_json(),
            inputs=inputs,
            params=_nonfinite_params(call.module),
            propagated=propagated,
        )

        def fill(writer: DumpWriter, recorder: Recorder) -> None:
            from modeltap.record import flight

            if self.options.on_nonfinite.startswith("dump"):
                self._dump_forward(recorder, call)
            else:  # the flight recorder alone: the culprit's output, for replay to compare with
                recorder.record(call.name, call.output)
            rng = self._rng.get((call.name, call.call))
            self._flight = flight.write(writer, call, rng, trip.key)

        trip.file = self._trip_dump(trip, fill)
        return trip

    def _backward_trip(self, shape: Shape, slot: int, propagated: bool) -> Trip:
        from modeltap.stats import tensor_stats

        watch = self._watch
        assert watch is not None
        grad = watch.grads.get(slot)
        stats = (
            tensor_stats(grad).to_json()
            if grad is not None
            else {"sum": float(watch.grad_flags[slot][1])}
        )
        inputs = {}
        for s, total in watch.incoming(shape).items():
            held = watch.grads.get(s)
            key = GRAD_PREFIX + watch.slot_keys[s]
            inputs[key] = tensor_stats(held).to_json() if held is not None else {"sum": total}
        trip = Trip(
            step=self.step_index,
            rank=self.rank.rank,
            phase=BACKWARD,
            module=shape.name,
            module_class=shape.module_class,
            key=GRAD_PREFIX + watch.slot_keys[slot],
            stats=stats,
            inputs=inputs,
            params=_nonfinite_params(self._by_name[shape.name]),
            propagated=propagated,
        )
        return trip

    def _unreproduced(self, phase: str, seen: str, *, backward_kept: bool) -> Trip:
        if phase == BACKWARD and not backward_kept:
            why = (
                "its backward can't be run again: the gradients of the model's outputs were "
                "too large to keep (a loss computed outside the model)"
            )
        else:
            why = (
                "the step run again from the same inputs and RNG states under the full tripwire "
                "was finite (non-deterministic kernels, or inputs changed in place since)"
            )
        return Trip(
            step=self.step_index,
            rank=self.rank.rank,
            phase=phase,
            module=ROOT,
            module_class=type(self.model).__name__,
            key="",
            stats={},
            inputs={},
            unreproduced=(
                f"{seen} was non-finite, but {why}; record with eager_tripwire=True to check "
                "every module as it runs"
            ),
        )

    def _trip(self, trip: Trip) -> None:
        self.trips.append(trip)
        if self._index is not None:
            self._index.write("tripwire", **trip.to_json())
        if self.options.on_nonfinite in ("raise", "dump"):
            raise NonFiniteError(trip)
        logger.warning("%s", trip.message())


def _grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def _nonfinite_params(module: nn.Module) -> dict[str, dict[str, Any]]:
    import torch

    from modeltap.stats import tensor_stats

    out = {}
    for name, p in module.named_parameters():
        local = dist.local_view(p.detach())
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            out[name] = tensor_stats(local).to_json()
    return out

"""A trip's file, a part of `Recording` (record.recording): with on_nonfinite="dump" the step's full
tensors (held by the watch until the trip), with the flight recorder alone the culprit's output and
its flight record (record.flight), each with the trend of the last recorded steps."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from modeltap.capture import Recorder
from modeltap.dump import GRAD_PREFIX, DumpWriter
from modeltap.record.index import step_file_name
from modeltap.record.run_folder import writes
from modeltap.record.tripwire import BACKWARD, FORWARD, Trip

if TYPE_CHECKING:
    from modeltap.record.tripwire import Call


class TripFiles:
    """Writing a trip's step file (`Recording`'s state)."""

    @writes
    def _trip_dump(self, trip: Trip, fill: Callable[[DumpWriter, Recorder], None]) -> str | None:
        """With "dump": the step's full tensors, once per run and phase, as that step's file.
        With only the flight recorder armed (`flight=True`), a forward trip's file holds the
        culprit's output and its flight record: nothing had to be held for it."""
        full = self.options.on_nonfinite.startswith("dump")
        if (
            not (full or (self.options.flight and trip.phase == FORWARD))
            or trip.phase in self._dumped
        ):
            return None
        self._dumped.add(trip.phase)
        if self._writer is not None:  # the step's own recording gives way to the full dump
            self._writer.abort()
            self._writer = None
            self._recorder = None
        path = self.out_dir / step_file_name(self.step_index, self.rank.rank)
        self._flight: dict[str, Any] | None = None
        with DumpWriter(
            path,
            dead_threshold=self.options.dead_threshold,
            hist=self.options.hist,
            formats=tuple(self.options.formats),
        ) as writer:
            recorder = Recorder(writer)
            fill(writer, recorder)
            order = [*recorder.order, *(k for k in writer.stats if k.startswith(GRAD_PREFIX))]
            kind = "activations+gradients" if trip.phase == BACKWARD else "activations"
            writer.finish(
                {
                    "kind": kind,
                    **self._common_meta(),
                    "order": json.dumps(order),
                    "skipped": json.dumps(recorder.skipped),
                    "skipped_none": str(recorder.skipped_none),
                    "record": json.dumps(self.options.settings()),
                    "tripwire": json.dumps(trip.to_json()),
                    **({"trend": json.dumps(list(self._recent))} if self._recent else {}),
                    **({"flight": json.dumps(self._flight)} if self._flight else {}),
                }
            )
        return path.name

    def _dump_forward(self, recorder: Recorder, culprit: Call | None) -> None:
        watch = self._watch
        assert watch is not None
        for c in watch.calls:
            recorder.record(c.name, c.output)
        for c in watch.calls:
            if culprit is not None and c.name == culprit.name:
                recorder.record(c.name, {**dict(enumerate(c.args)), **c.kwargs}, is_input=True)

    def _held_backward(self) -> Callable[[DumpWriter, Recorder], None] | None:
        """With "dump": what a backward trip's file holds (the forward's outputs, every
        gradient), taken now, while the watch has them; written if the trip comes."""
        watch = self._watch
        if watch is None or not self.options.on_nonfinite.startswith("dump"):
            return None
        calls = list(watch.calls)
        grads = [
            (GRAD_PREFIX + watch.slot_keys[slot], watch.grads[slot])
            for slot in sorted(watch.grads, key=lambda s: watch.grad_flags[s][0])
        ]

        def fill(writer: DumpWriter, recorder: Recorder) -> None:
            for c in calls:
                recorder.record(c.name, c.output)
            for key, grad in grads:
                writer.tensor(key, grad, count_zeros=True)

        return fill

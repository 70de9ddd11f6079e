"""What every non-eager capture backend hands back to `dumping.dump_model`.

A backend runs the model once with the selected modules observed, names what it saw through a
`Recorder` (so keys follow the eager rules), and says what it could not map: a selected module that
produced no value is listed, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn

    from modeltap.capture.recorder import Recorder, Sink
    from modeltap.capture.structure import OutputStructure


@dataclass
class BackendRun:
    recorder: Recorder
    details: dict[str, Any] = field(default_factory=dict)
    unmapped: list[str] = field(default_factory=list)
    output: Any = None
    ops: dict[str, Any] | None = None  # with RunRequest.ops: op key -> its `ops` metadata


@dataclass(frozen=True)
class RunRequest:
    """One run of a backend, declared once for all of them: `model` called with `args` and
    `kwargs`, the selected `modules` observed and what they return handed to `sink`; `inputs`:
    their inputs too; `train_mode`: run in training mode; `seed`: the RNG seed (None: as it is);
    `ops`: the selected modules' ops too (a backend whose `sees_ops` is true)."""

    model: nn.Module
    modules: list[str]
    sink: Sink
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: bool = False
    train_mode: bool = False
    seed: int | None = 0
    ops: bool = False

    @property
    def call(self) -> tuple[nn.Module, list[str], Sink, tuple[Any, ...], dict[str, Any]]:
        """(model, modules, sink, args, kwargs), for a backend to unpack."""
        return self.model, self.modules, self.sink, self.args, self.kwargs


class Backend(Protocol):
    name: str

    def run(self, request: RunRequest) -> BackendRun: ...


@dataclass(kw_only=True)
class SavedBackend:
    """What the backends over a saved program (an ExportedProgram, a TorchScript archive) share:
    `source`, the file it came from; `outputs`, the eager model's output record
    (structure.record_outputs) for modules whose graph keeps no signature, or None."""

    source: str = ""
    name: str = ""
    outputs: dict | None = None

    def timed(self, request: RunRequest, call: Callable[[], Any], failed: str) -> tuple[Any, float]:
        """(`call()` under no_grad after seeding, its seconds); its error a RunError `failed`
        formats with the error's first line."""
        import time

        import torch

        from modeltap.errors import InputError, RunError, first_line

        if request.seed is not None:
            torch.manual_seed(request.seed)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                result = call()
        except InputError:
            raise
        except Exception as exc:  # the program's own error kinds
            raise RunError(
                failed.format(first_line(exc)) + " (MODELTAP_DEBUG=1 shows the traceback)"
            ) from exc
        return result, time.perf_counter() - start

    def finish(
        self,
        request: RunRequest,
        recorder: Recorder,
        structure: OutputStructure,
        details: dict[str, Any],
        called: set[str],
        output: Any,
        **after: Any,
    ) -> BackendRun:
        """The run handed back: `details` after the source, then what the output record could
        not place, then `after`; the selected modules not in `called` (nor the root) unmapped."""
        from modeltap.selection import ROOT

        details = {"source": self.source, **details}
        if structure.unmatched:
            details["structure_unmatched"] = structure.unmatched
        if structure.missing:
            details["parts_not_in_graph"] = structure.missing
        details.update(after)
        called = called | {ROOT}
        return BackendRun(
            recorder, details, [m for m in request.modules if m not in called], output
        )

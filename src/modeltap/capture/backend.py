"""What every non-eager capture backend hands back to `dumping.dump_model`.

A backend runs the model once with the selected modules observed, names what it saw through a
`Recorder` (so keys follow the eager rules), and says what it could not map: a selected module that
produced no value is listed, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn

    from modeltap.capture.recorder import Recorder, Sink


@dataclass
class BackendRun:
    recorder: Recorder
    details: dict[str, Any] = field(default_factory=dict)
    unmapped: list[str] = field(default_factory=list)
    output: Any = None


@dataclass(frozen=True)
class RunRequest:
    """One run of a backend, declared once for all of them: `model` called with `args` and
    `kwargs`, the selected `modules` observed and what they return handed to `sink`; `inputs`:
    their inputs too; `train_mode`: run in training mode; `seed`: the RNG seed (None: as it is)."""

    model: nn.Module
    modules: list[str]
    sink: Sink
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: bool = False
    train_mode: bool = False
    seed: int | None = 0

    @property
    def call(self) -> tuple[nn.Module, list[str], Sink, tuple[Any, ...], dict[str, Any]]:
        """(model, modules, sink, args, kwargs), for a backend to unpack."""
        return self.model, self.modules, self.sink, self.args, self.kwargs


class Backend(Protocol):
    name: str

    def run(self, request: RunRequest) -> BackendRun: ...

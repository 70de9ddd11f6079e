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


class Backend(Protocol):
    name: str

    def run(
        self,
        model: nn.Module,
        modules: list[str],
        sink: Sink,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        inputs: bool,
        train_mode: bool,
        seed: int | None,
    ) -> BackendRun: ...

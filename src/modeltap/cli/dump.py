"""`modeltap dump`: run a model and write every selected module's output."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modeltap.cli.app import app, handle_errors, refuse
from modeltap.cli.capturing import run_dump
from modeltap.cli.checks import refuse_unused
from modeltap.cli.options import COMPILE, INPUT, LOAD, PLACEMENT, RUN, SELECT, Given, command

if TYPE_CHECKING:
    from modeltap.config import Settings


@app.command()
@handle_errors
@command(
    "dump",
    "model",
    *INPUT,
    *SELECT,
    "inputs",
    "ops",
    "out",
    "stats_only",
    "hist",
    "formats",
    "json_out",
    *LOAD,
    "max_length",
    *RUN,
    "dead_threshold",
    "grads",
    "target",
    "loss",
    "grad_output",
    "params",
    *PLACEMENT,
    *COMPILE,
    "allow_pickle",
    "config",
    "max_inflight_mb",
)
def dump(s: Settings, given: Given, *, json_out: bool, allow_pickle: bool | None) -> None:
    """Run a model on text, images, audio or tensors and write every selected module's output."""
    refuse_unused(s, given, grads=s.grads, allow_pickle=allow_pickle)
    if not s.compile:
        refuse(
            given.flags("compile_backend", "fullgraph"),
            "can't apply without --compile",
            "add --compile or drop {flags}",
        )
    if not s.grads:
        refuse(
            given.flags("target", "loss", "grad_output", "params"),
            "can't apply without --grads",
            "add --grads or drop {flags}",
        )
    # a command-line flag only: no config file or environment may turn it on
    run_dump(s, json_out=json_out, grads=s.grads, activations=True, allow_pickle=bool(allow_pickle))

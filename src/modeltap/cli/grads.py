"""`modeltap grads`: gradients w.r.t. the selected modules, in one backward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from modeltap.cli.app import app, handle_errors, refuse
from modeltap.cli.capturing import run_dump
from modeltap.cli.checks import refuse_unused
from modeltap.cli.options import INPUT, LOAD, PLACEMENT, RUN, SELECT, Given, command

if TYPE_CHECKING:
    from modeltap.config import Settings


@app.command()
@handle_errors
@command(
    "grads",
    "model",
    "text",
    "target",
    "wrt",
    "loss",
    "grad_output",
    "params",
    "jacobian_norm",
    "probes",
    "vanishing",
    "exploding",
    *INPUT[1:],
    *SELECT,
    "ops",
    "out",
    "stats_only",
    "formats",
    "json_out",
    *LOAD,
    "max_length",
    *RUN,
    *PLACEMENT,
    "config",
)
def grads(s: Settings, given: Given, *, json_out: bool) -> None:
    """Gradients of a module's output (or a loss) with respect to the selected modules' outputs,
    in one backward."""
    refuse_unused(s, given, grads=True, allow_pickle=None)
    if not s.jacobian_norm:
        refuse(
            given.flags("probes"),
            "can't apply without --jacobian-norm",
            "add --jacobian-norm K or drop {flags}",
        )
    run_dump(s, json_out=json_out, grads=True, activations=False)

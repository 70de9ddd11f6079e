"""The `modeltap` command: one module per command, each parsing options, calling the library and
printing. No tensor logic here.

torch and transformers are imported inside the commands, so `modeltap --help` answers at once.
"""

from __future__ import annotations

# Importing a command module registers it; this order is the order of `modeltap --help`.
# isort: off
from modeltap.cli import dump, generate, grads, show, ls, diff, compare, export, report, replay  # noqa: F401

# isort: on
from modeltap.cli.app import app, handle_errors

__all__ = ["app", "handle_errors", "main"]


def main() -> None:
    app()

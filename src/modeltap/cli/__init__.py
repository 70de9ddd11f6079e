"""The `modeltap` command: one module per command, each parsing options, calling the library and
printing. No tensor logic here.

torch and transformers are imported inside the commands, so `modeltap --help` answers at once.
"""

from __future__ import annotations

# Each command's module is imported when the command runs (app.COMMANDS, in `--help` order).
from modeltap.cli.app import app, handle_errors

__all__ = ["app", "handle_errors", "main"]


def main() -> None:
    app()

"""How an option is declared: its help panel, and `CliOption`, the command-line half of a settings
field made with `option(...)` (settings.py declares every field with it). Plain strings only: the
library does not need typer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Help panels: `--help` groups each command's options under these headings.
INPUTS = "Inputs"
SELECTION = "Selection"
LOADING = "Loading"
RUNNING = "Running"
OUTPUT = "Output"
GRADIENTS = "Gradients"
TOL = "Tolerance"
KEYS = "Keys"


@dataclass(frozen=True)
class CliOption:
    """How a value is given on the command line.

    `flags` as typer takes them (--depth and -d; --inputs/--no-inputs for a switch; none: the
    parameter's name); `path`: a file name, a `Path` on the command line and a `str` in the
    settings; `choices`: the only values allowed (a choice on the command line, its string in the
    settings); `argument`: positional; `variants`: per command, what that command says otherwise
    (its own help, panel...); `type`: the value's type where no settings field gives it (options
    of the command line only); `param`: the command's parameter name where it is not the field's;
    `default`, `required`: the command-line default of an option of the command line only (a
    settings option's absence means "not given": its default is the field's).
    """

    flags: tuple[str, ...] = ()
    help: str = ""
    panel: str | None = None
    metavar: str | None = None
    show_default: bool = True
    min: int | None = None
    argument: bool = False
    path: bool = False
    choices: tuple[str, ...] = ()
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    type: Any = None
    param: str | None = None
    default: Any = None
    required: bool = False

    def for_command(self, command: str | None) -> CliOption:
        """This option as `command` shows it (its variant, if it has one)."""
        changes = self.variants.get(command or "", {})
        return dataclasses.replace(self, **changes) if changes else self


def option(default: Any = None, *flags: str, factory: Any = None, **cli: Any) -> Any:
    """A settings field that is also a command-line option (see `CliOption`)."""
    meta = {"cli": CliOption(flags=cli.pop("flags", flags), **cli)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def path_argument(help: str, metavar: str) -> CliOption:
    """A required positional file or folder of a command of the command line only (diff's A and
    B, show's PATH, replay's RUN_DIR)."""
    from pathlib import Path

    return CliOption(argument=True, help=help, metavar=metavar, type=Path, required=True)

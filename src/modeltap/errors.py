"""One error base: every message says what to do, and the CLI prints it as one line."""

from __future__ import annotations


class ModeltapError(Exception):
    """An error the user can fix; `exit_code` 2 means bad usage or input, 1 a failure."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InputError(ModeltapError):
    """Bad model, input file, option or output path."""


class MissingWeightsError(InputError):
    """A checkpoint without weights for some parameters of the class it is loaded as: they would
    run as transformers initialised them, at random."""

    def __init__(self, message: str, *, model_class: str, missing: list[str]) -> None:
        super().__init__(message)
        self.model_class = model_class
        self.missing = missing


class SelectionError(ModeltapError):
    """A depth or pattern that selects no module, or an unknown module name."""


class DumpFormatError(ModeltapError):
    """A file that is not a readable safetensors dump."""


class RunError(ModeltapError):
    """The model itself failed while running."""

    exit_code = 1


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, for one-line errors that wrap it."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

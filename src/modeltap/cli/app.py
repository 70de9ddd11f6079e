"""The typer app, error handling and consoles shared by every command."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from modeltap.config import Settings, load_settings
from modeltap.errors import ModeltapError

app = typer.Typer(
    name="modeltap",
    help="Inspect what a PyTorch / Hugging Face model computes, layer by layer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

F = TypeVar("F", bound=Callable[..., Any])


def stdout() -> Console:
    return Console(soft_wrap=False)


def stderr() -> Console:
    return Console(stderr=True)


def handle_errors(command: F) -> F:
    """ModeltapError -> `error: ...` on stderr and its exit code; MODELTAP_DEBUG=1 re-raises."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except ModeltapError as exc:
            if os.environ.get("MODELTAP_DEBUG"):
                raise
            print(f"error: {exc.message}", file=sys.stderr)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            print("interrupted; nothing was written", file=sys.stderr)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version.")] = False,
) -> None:
    if version:
        from modeltap import __version__

        print(f"modeltap {__version__}")
        raise typer.Exit(0)


def settings(command: str, config: Path | None, **flags: Any) -> Settings:
    return load_settings(command, config_file=config, flags=flags)


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)

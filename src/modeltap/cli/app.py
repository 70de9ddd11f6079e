"""The typer app, error handling and consoles shared by every command."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from typer.core import TyperCommand

from modeltap.config import Settings, load_settings
from modeltap.errors import InputError, ModeltapError

# typer vendors click; its usage error is the base of the public typer.BadParameter.
UsageError = typer.BadParameter.__mro__[1]

# Arguments first, then the panels a user looks for in the order they think of them.
PANEL_ORDER = [
    "Arguments",
    "Variant",
    "Inputs",
    "Selection",
    "Loading",
    "Running",
    "Tolerance",
    "Keys",
    "Output",
    "Gradients",
]


class PanelCommand(TyperCommand):
    """Plain click help (defaults kept, flags without a metavar, wrapped to the terminal up to
    80 columns), with options grouped under their `rich_help_panel` heading."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                heading = "Arguments"
                record = (param.metavar or (param.name or "").upper(), record[1])
            else:
                heading = getattr(param, "rich_help_panel", None) or "Options"
            sections.setdefault(heading, []).append(record)
        known = [*PANEL_ORDER, "Options"]
        for heading in sorted(sections, key=lambda h: known.index(h) if h in known else 0):
            with formatter.section(heading):
                formatter.write_dl(sections[heading])

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        """A usage error is one line that names the fix, like every other modeltap error."""
        try:
            return super().parse_args(ctx, args)
        except UsageError as exc:
            print(
                f"error: {exc.format_message()}; see `modeltap {ctx.info_name} --help`",
                file=sys.stderr,
            )
            ctx.exit(2)


class ModeltapApp(typer.Typer):
    """Every command gets the panelled help."""

    def command(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("cls", PanelCommand)
        return super().command(*args, **kwargs)


app = ModeltapApp(
    name="modeltap",
    help="Inspect what a PyTorch / Hugging Face model computes, layer by layer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    # Rich markup would eat `[default: ...]` in help texts and cut option names at 80 columns.
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)

F = TypeVar("F", bound=Callable[..., Any])


def stdout() -> Console:
    return Console(soft_wrap=False)


def stderr() -> Console:
    return Console(stderr=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (timeout, CI cancellation, docker stop, a closed terminal), raised in the
    main thread like Ctrl-C so every `finally` and writer clean-up runs before exiting."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _signals_as_interrupts() -> Iterator[None]:
    import signal

    def raise_terminated(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    wanted = [s for s in ("SIGTERM", "SIGHUP") if hasattr(signal, s)]
    previous = {}
    try:
        for name in wanted:
            number = getattr(signal, name)
            previous[number] = signal.signal(number, raise_terminated)
    except ValueError:  # not the main thread: leave signals alone
        pass
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _disk_full(exc: OSError) -> bool:
    import errno

    return exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def handle_errors(command: F) -> F:
    """ModeltapError -> `error: ...` on stderr and its exit code; MODELTAP_DEBUG=1 re-raises.

    Ctrl-C, SIGTERM and SIGHUP leave no file behind (exit 128 + signal); a full disk is one line.
    """

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with _signals_as_interrupts():
                return command(*args, **kwargs)
        except ModeltapError as exc:
            if os.environ.get("MODELTAP_DEBUG"):
                raise
            print(f"error: {exc.message}", file=sys.stderr)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt as exc:
            signum = exc.signum if isinstance(exc, Terminated) else 2
            print("interrupted; nothing was written", file=sys.stderr)
            raise typer.Exit(128 + signum) from None
        except OSError as exc:
            if not _disk_full(exc) or os.environ.get("MODELTAP_DEBUG"):
                raise
            where = f" writing '{exc.filename}'" if exc.filename else ""
            print(
                f"error: no space left on the device{where}; nothing was written. Free some "
                "space, write elsewhere with -o/--out, or use --stats-only",
                file=sys.stderr,
            )
            raise typer.Exit(2) from None

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
    """Write a report file whole or not at all (through a symbolic link, like the dump)."""
    from modeltap.dump import temp_path, write_target

    path = write_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def given(**flags: Any) -> list[str]:
    """The command-line flags among `flags` (parameter name -> value, None when absent), as
    `--flag-name` (`--no-flag-name` for a switch turned off): for refusing an option that cannot
    apply instead of ignoring it."""
    return [
        f"--{'no-' if value is False else ''}{name.replace('_', '-')}"
        for name, value in flags.items()
        if value is not None
    ]


def refuse(flags: list[str], why: str, fix: str = "drop {flags}") -> None:
    """One error naming every flag that cannot apply: `--a and --b {why}; {fix}`, where `fix`
    may name them again as `{flags}`."""
    if flags:
        names = " and ".join(flags)
        raise InputError(f"{names} {why}; {fix.format(flags=names)}")

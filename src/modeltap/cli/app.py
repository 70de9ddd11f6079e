"""The typer app, error handling and consoles shared by every command."""

from __future__ import annotations

import functools
import importlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup

from modeltap.errors import InputError, ModeltapError

if TYPE_CHECKING:
    from rich.console import Console

# Each command: its module, imported only when the command runs or its help is asked for, and
# the first paragraph of its docstring, which `modeltap --help` lists (test_cli.py checks that
# they agree). This order is the order of `modeltap --help`.
COMMANDS = {
    "dump": (
        "modeltap.cli.dump",
        "Run a model on text, images, audio or tensors and write every selected module's output.",
    ),
    "generate": (
        "modeltap.cli.generate",
        "Generate from a prompt and write every decoding step's module outputs (gen/stepK/...).",
    ),
    "grads": (
        "modeltap.cli.grads",
        "Gradients of a module's output (or a loss) with respect to the selected modules' "
        "outputs, in one backward.",
    ),
    "show": (
        "modeltap.cli.show",
        "Print a dump's tree of statistics, or a recorded run's trends over its steps.",
    ),
    "ls": (
        "modeltap.cli.ls",
        "List a model's modules as a tree, and where --device-map would put them; loads no "
        "weights of a Hugging Face model.",
    ),
    "diff": (
        "modeltap.cli.diff",
        "Compare two dumps, or two run folders of modeltap.record step by step; exit 0 when "
        "every tensor is within tolerance, 1 when not.",
    ),
    "compare": (
        "modeltap.cli.compare",
        "Compare a model with a variant (bf16, attn:eager, a checkpoint...): where they part "
        "ways, and which module introduced the error; exit 0 within tolerance, 1 when not.",
    ),
    "export": (
        "modeltap.cli.export",
        "Export a model (torch.export .pt2, or a TorchScript trace .pt) that `modeltap dump` "
        "reads with the eager keys.",
    ),
    "report": (
        "modeltap.cli.report",
        "Write one self-contained HTML page (opens offline) of a dump, a diff, a compare or a "
        "run.",
    ),
    "replay": (
        "modeltap.cli.replay",
        "Re-run, alone, the module that produced a recorded run's first NaN/Inf (a forward trip "
        'recorded with flight=True or on_nonfinite="dump"), and show whether it comes back. '
        "Exit 0 when it does, 1 when it does not.",
    ),
}

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
        for heading, records in self.help_sections(ctx).items():
            with formatter.section(heading):
                formatter.write_dl(records)

    def format_epilog(self, ctx: Any, formatter: Any) -> None:
        """`--help` ends with the command's page of the docs site (docs/, `mkdocs build`)."""
        super().format_epilog(ctx, formatter)
        formatter.write_paragraph()
        formatter.write_text(f"Docs: docs/commands/{ctx.info_name}.md")

    def help_sections(self, ctx: Any) -> dict[str, list[tuple[str, str]]]:
        """Each heading of `--help`, in order, with its (flags, help) rows."""
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
        order = sorted(sections, key=lambda h: known.index(h) if h in known else 0)
        return {heading: sections[heading] for heading in order}

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        """A usage error is one line that names the fix, like every other modeltap error."""
        _spare_pydantic(self.get_params(ctx))
        try:
            return super().parse_args(ctx, args)
        except UsageError as exc:
            print(
                f"error: {exc.format_message()}; see `modeltap {ctx.info_name} --help`",
                file=sys.stderr,
            )
            ctx.exit(2)


try:  # typer >= 0.25 checks each parameter's value with a pydantic TypeAdapter
    from typer._param_types import coerce_cli_path as _PATH_CHECKS
except ImportError:  # older typer: click's own types, nothing to spare
    _PATH_CHECKS = None


class _Coercion:
    """typer's coercion of one parameter's value, for the values that need no pydantic.

    typer builds a pydantic TypeAdapter for every parameter of the command that runs, given or
    not, and pydantic takes 0.05-0.1 s to import: more than the rest of `modeltap show`. An
    absent value, a string, a path (typer's own existence and permission checks) and a default
    already of its type are taken here as typer takes them; any other value (a number or a
    choice typed on the command line) goes through typer's adapter, built then, so its errors
    read as typer's."""

    def __init__(self, descriptor: Any) -> None:
        self.descriptor = descriptor
        self.adapter: Any = None

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        multiple = param.multiple or param.nargs == -1
        if value is None:
            return () if multiple else None
        info = self.descriptor.parameter_info
        leaf = self.descriptor.annotation
        if multiple and isinstance(value, (list, tuple)) and getattr(leaf, "__origin__", 0) is list:
            (leaf,) = leaf.__args__
            items = [self._plain(item, leaf, info, param, ctx) for item in value]
            if not any(item is _OTHER for item in items):
                return items
        elif not multiple:
            plain = self._plain(value, leaf, info, param, ctx)
            if plain is not _OTHER:
                return plain
        if self.adapter is None:
            from typer._coercion import build_runtime_param

            self.adapter = build_runtime_param(self.descriptor)
        return self.adapter.coerce(value, param=param, ctx=ctx)

    @staticmethod
    def _plain(value: Any, leaf: Any, info: Any, param: Any, ctx: Any) -> Any:
        if info.parser is not None or getattr(info, "path_type", None) not in (None, Path):
            return _OTHER
        if leaf is str and isinstance(value, str):
            return value
        if leaf is Path and isinstance(value, (str, Path)):
            return _PATH_CHECKS(Path(value), info, path_type=Path, param=param, ctx=ctx)
        if leaf in (int, float) and info.min is None and info.max is None:
            if type(value) is leaf:
                return value
            if isinstance(value, str) and _NUMBER[leaf].fullmatch(value):
                return leaf(value)
        if leaf is bool and type(value) is bool:
            return value
        return _OTHER


_OTHER = object()
# The numbers read here (any other spelling goes to typer: its messages for a bad one).
_NUMBER = {
    int: re.compile(r"-?[0-9]+"),
    float: re.compile(r"-?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?"),
}


def _spare_pydantic(params: list[Any]) -> None:
    """Each typer parameter's coercion, not yet built, replaced by a `_Coercion`."""
    if _PATH_CHECKS is not None:
        for param in params:
            if getattr(param, "_runtime_param", False) is None:
                param._runtime_param = _Coercion(param.type_descriptor)


class LazyGroup(TyperGroup):
    """The commands of COMMANDS, each module imported when its command is looked up: the options
    of ten commands (and the modules they come from) cost `modeltap --help` a third of its time.
    Commands registered on `app` by a module imported earlier are built by typer as usual."""

    _listing = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = _Commands(self.commands)

    def list_commands(self, ctx: Any) -> list[str]:
        return [*COMMANDS, *(n for n in super().list_commands(ctx) if n not in COMMANDS)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name in COMMANDS and cmd_name not in self.commands:
            if self._listing:  # the command list needs only the summary
                return TyperCommand(name=cmd_name, help=COMMANDS[cmd_name][1])
            self.commands[cmd_name] = _load(cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_epilog(self, ctx: Any, formatter: Any) -> None:
        super().format_epilog(ctx, formatter)
        formatter.write_paragraph()
        formatter.write_text("Docs: docs/index.md (a page per command: docs/commands/COMMAND.md)")

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_commands(ctx, formatter)
        finally:
            self._listing = False

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        _spare_pydantic(self.get_params(ctx))
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        try:
            return super().resolve_command(ctx, args)
        except UsageError as exc:  # typer suggests from the commands built so far only
            import difflib

            matches = difflib.get_close_matches(args[0], self.list_commands(ctx)) if args else []
            if matches and "Did you mean" not in exc.message:
                names = ", ".join(f"{m!r}" for m in matches)
                exc.message = f"{exc.message.rstrip('.')}. Did you mean {names}?"
            raise


class _Commands(dict):  # type: ignore[type-arg]
    """The group's commands by name: `commands["dump"]` builds one of COMMANDS not built yet."""

    def __missing__(self, name: str) -> Any:
        if name not in COMMANDS:
            raise KeyError(name)
        self[name] = command = _load(name)
        return command


def _load(name: str) -> Any:
    """The click command of COMMANDS' `name`, its module imported (which registers it on app)."""
    from typer.main import get_command_from_info, get_command_name

    importlib.import_module(COMMANDS[name][0])
    for info in app.registered_commands:
        if (info.name or get_command_name(info.callback.__name__)) == name:  # type: ignore[union-attr]
            return get_command_from_info(
                info,
                pretty_exceptions_short=app.pretty_exceptions_short,
                rich_markup_mode=app.rich_markup_mode,
            )
    raise LookupError(f"{COMMANDS[name][0]} registers no command '{name}'")


class ModeltapApp(typer.Typer):
    """Every command gets the panelled help."""

    def command(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("cls", PanelCommand)
        return super().command(*args, **kwargs)


app = ModeltapApp(
    name="modeltap",
    help="Inspect what a PyTorch / Hugging Face model computes, layer by layer.",
    cls=LazyGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    # Rich markup would eat `[default: ...]` in help texts and cut option names at 80 columns.
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)

F = TypeVar("F", bound=Callable[..., Any])


def stdout() -> Console:
    from rich.console import Console

    return Console(soft_wrap=False)


def stderr() -> Console:
    from rich.console import Console

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
        from modeltap._version import __version__

        print(f"modeltap {__version__}")
        raise typer.Exit(0)


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

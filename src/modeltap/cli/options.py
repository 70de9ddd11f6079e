"""Command-line parameters built from the one declaration of each option.

A settings option is declared once, as a field of `modeltap.config.Settings` (flags, help, panel,
metavar); an option of the command line only (--json, --config...) in `CLI_ONLY` here, one of a
single command in that command's module. `command` composes a command's signature (typer reads
`__signature__`) from a list of names and hands its body one `Settings` (habit 4 in STYLE.md);
`option_table` writes the table a docs page shows.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from modeltap.config.declare import INPUTS, LOADING, OUTPUT, CliOption
from modeltap.config.settings import FIELDS, HINTS, TYPES

# Options of the command line only: how to run the command, not what a run is.
CLI_ONLY: dict[str, CliOption] = {
    "config": CliOption(
        ("--config", "-c"),
        help="TOML settings file (see configs/).",
        show_default=False,
        panel=OUTPUT,
        metavar="FILE",
        type=Path | None,
    ),
    "json_out": CliOption(
        ("--json",),
        help="Print JSON on stdout instead of a table.",
        panel=OUTPUT,
        type=bool,
        default=False,
    ),
    "text": CliOption(
        argument=True,
        help="Text, or image / audio files (told apart by content), run as one batch.",
        metavar="TEXT|FILE",
        type=list[str] | None,
        variants={
            "generate": {
                "help": "Prompts, generated from as one left-padded batch; image or audio files "
                "(by content) go with them through the model's processor (a vision-language or "
                "speech model).",
                "metavar": "PROMPT|FILE",
            }
        },
    ),
    "sentences": CliOption(
        argument=True,
        help="Sentences, run as one padded batch.",
        metavar="TEXT",
        type=list[str] | None,
    ),
    "text_opt": CliOption(
        ("--text",),
        help="Text, even where a file of that name exists; repeatable.",
        panel=INPUTS,
        metavar="TEXT",
        type=list[str] | None,
    ),
    "images_dir": CliOption(
        ("--images-dir",),
        help="Every image file in this folder, by name, added to the batch.",
        panel=INPUTS,
        metavar="DIR",
        type=Path | None,
    ),
    "audio_dir": CliOption(
        ("--audio-dir",),
        help="Every audio file in this folder, by name, added to the batch.",
        panel=INPUTS,
        metavar="DIR",
        type=Path | None,
    ),
    "limit": CliOption(
        ("--batch", "--limit"),
        help="Only the first N files of --images-dir / --audio-dir, by name: the batch they make.",
        min=1,
        panel=INPUTS,
        metavar="N",
        type=int | None,
    ),
    "junit": CliOption(
        help="Also write JUnit XML, one test case per tensor.",
        metavar="FILE",
        panel=OUTPUT,
        type=Path | None,
    ),
    "html": CliOption(
        ("--html",),
        help="Also write the report as one self-contained HTML page (see `modeltap report`).",
        metavar="FILE",
        panel=OUTPUT,
        type=Path | None,
    ),
    "show_all": CliOption(
        ("--all",),
        help="List every module.",
        panel=OUTPUT,
        type=bool,
        default=False,
        variants={"diff": {"help": "List every pair, in order."}},
    ),
    "allow_pickle": CliOption(
        ("--allow-pickle/--no-allow-pickle",),
        help="Load a .pt2 archive that needs a full unpickle (runs its code; trusted files only).",
        panel=LOADING,
        type=bool | None,
    ),
}
_CHOICES: dict[tuple[str, ...], type[Enum]] = {}


def _choice(name: str, choices: tuple[str, ...]) -> type[Enum]:
    """One enum per set of choices: typer offers them and names them in its errors."""
    if choices not in _CHOICES:
        _CHOICES[choices] = Enum(name.title().replace("_", ""), {c: c for c in choices}, type=str)
    return _CHOICES[choices]


def declaration(name: str, command: str | None = None) -> CliOption:
    """The declaration of parameter `name`: a Settings field's, or one of CLI_ONLY."""
    if name in CLI_ONLY:
        return CLI_ONLY[name].for_command(command)
    declared = FIELDS[name].metadata.get("cli")
    if declared is None:
        raise LookupError(f"Settings.{name} declares no command-line option")
    return declared.for_command(command)


def _value_type(name: str, declared: CliOption) -> Any:
    """The type typer parses: a Settings field's type as given on the command line (a path, a
    choice, a switch that may be absent), or a CLI_ONLY option's own."""
    if declared.type is not None:
        return declared.type
    leaf = _choice(name, declared.choices) if declared.choices else TYPES[name]
    if declared.path:
        leaf = Path
    if TYPES[name] is list:
        leaf = list[Path] if declared.path else HINTS[name]
    return leaf | None


def _annotated(name: str, kind: Any, d: CliOption) -> Any:
    if d.argument:
        info = typer.Argument(help=d.help, metavar=d.metavar, show_default=d.show_default)
        return Annotated[kind, info]
    # Named even when the declaration gives no flags: typer before 0.29 upper-cases the flag it
    # derives for an option with a metavar (`--DEVICE`).
    info = typer.Option(
        *(d.flags or ("--" + name.replace("_", "-"),)),
        help=d.help,
        rich_help_panel=d.panel,
        metavar=d.metavar,
        show_default=d.show_default,
        min=d.min,
    )
    return Annotated[kind, info]


Param = str | tuple[str, CliOption]
# What `sorted_inputs` sorts into texts, images and audio, in its order.
MEDIA = ("text", "images", "audio", "text_opt", "images_dir", "audio_dir", "limit")
# Groups of parameters that commands take together, in `--help` order.
INPUT = (*MEDIA, "processor", "chat", "input_file")
SELECT = ("depth", "include", "exclude")
LOAD = ("revision", "model_class", "tokenizer", "trust_remote_code", "allow_missing_weights")
RUN = ("dtype", "device", "seed", "train_mode")
PLACEMENT = ("device_map", "max_memory", "offload_folder")
COMPILE = ("compile", "compile_backend", "fullgraph")
DIFF = ("atol", "rtol", "preset", "map", "include", "exclude", "equal_nan", "upcast", "strict")


class Given(dict[str, Any]):
    """Each settings parameter's command-line value, None when it was not typed."""

    def flags(self, *names: str) -> list[str]:
        """The typed ones among `names`, as `--flag` (`--no-flag` for a switch turned off): for
        refusing an option that cannot apply instead of ignoring it."""
        from modeltap.cli.app import given

        return given(**{name.rstrip("_"): self.get(name) for name in names})


def command(
    name: str, *params: Param, settings: bool = True, apart: tuple[str, ...] = ()
) -> Callable[..., Any]:
    """Give the decorated body a typer signature composed from `params`, in `--help` order:
    names of Settings fields or CLI_ONLY options, or `(name, CliOption(...))` for a parameter of
    this command alone (`type` and `default` given).

    With `settings`, the body is called as `body(s, given, **cli)`: `s` the Settings of the
    defaults, config files, MODELTAP_* variables and the flags typed (`--config` names a file),
    `given` each settings parameter's command-line value (None when absent: for refusing a flag
    that cannot apply), `cli` the CLI_ONLY and command-only values. The settings options named
    in `apart` are not merged (the body applies them itself from `given`, as compare and diff
    put --atol/--rtol over a preset). Without `settings`, `body(**values)`."""

    def build(body: Callable[..., Any]) -> Callable[..., Any]:
        declared = []
        for item in params:
            pname, d = item if isinstance(item, tuple) else (item, declaration(item, name))
            kind = _value_type(pname, d)
            default = inspect.Parameter.empty if d.required else d.default
            declared.append((pname, d, kind, default))
        signature = inspect.Signature(
            [
                inspect.Parameter(
                    d.param or pname,
                    inspect.Parameter.KEYWORD_ONLY,
                    annotation=_annotated(d.param or pname, kind, d),
                    default=default,
                )
                for pname, d, kind, default in declared
            ]
        )
        fields = {d.param or p: p for p, d, _, _ in declared if p in FIELDS and d.type is None}

        @functools.wraps(body)
        def run(**values: Any) -> Any:
            if not settings:
                return body(**values)
            from modeltap.config import load_settings

            # a repeatable option not given comes as [], None here
            given = Given({k: v if v != [] else None for k, v in values.items() if k in fields})
            flags = {fields[k]: _setting(v) for k, v in given.items() if k not in apart}
            cli = {k: v for k, v in values.items() if k not in fields and k != "config"}
            if "text" in values:  # TEXT|FILE, --image, --audio, --text and the folders
                from modeltap.cli.inputs import sorted_inputs

                media = [cli.pop(k) if k in cli else given.get(k) for k in MEDIA]
                flags.update(sorted_inputs(*media))
            elif "sentences" in values:
                flags["texts"] = cli.pop("sentences")
            s = load_settings(name, config_file=values.get("config"), flags=flags)
            return body(s, given, **cli)

        run.__signature__ = signature  # type: ignore[attr-defined]  # what typer reads
        run.__annotations__ = {}  # the body's are not the command's parameters
        return run

    return build


def as_settings(name: str, values: dict[str, Any]) -> dict[str, Any]:
    """Command `name`'s values of settings options, by parameter name, as `load_settings` takes
    them (by field name, paths as strings, choices as their value)."""
    fields = {}
    for field_name, f in FIELDS.items():
        if "cli" in f.metadata:
            fields[declaration(field_name, name).param or field_name] = field_name
    return {fields[k]: _setting(v) for k, v in values.items()}


def _setting(value: Any) -> Any:
    """A command-line value as Settings holds it: paths as strings, choices as their value."""
    if isinstance(value, (list, tuple)):
        return [_setting(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    return value


def option_table(name: str) -> str:
    """A markdown table of `modeltap NAME`'s parameters as its `--help` lists them (headings,
    order, flags, help): what a page documenting the command shows, made from the declarations."""
    from typer.main import get_command

    from modeltap.cli.app import app

    group = get_command(app)
    parent = group.make_context("modeltap", [name], resilient_parsing=True)
    command = group.get_command(parent, name)
    ctx = command.make_context(name, [], parent=parent, resilient_parsing=True)
    lines = ["| option | meaning |", "|---|---|"]
    for heading, records in command.help_sections(ctx).items():
        lines.append(f"| **{heading}** | |")
        for flags, text in records:
            flags, meaning = flags.replace("|", "\\|"), text.replace("|", "\\|")
            lines.append(f"| `{flags}` | {meaning} |")
    return "\n".join(lines) + "\n"

"""The option declarations against what commands show (`--help`) and what the docs say."""

import inspect
import re
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from modeltap.cli import app
from modeltap.cli.app import COMMANDS
from modeltap.cli.options import option_table

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _flags(command_name):
    command = get_command(app).get_command(None, command_name)
    return {f for p in command.params for f in [*p.opts, *getattr(p, "secondary_opts", [])]}


@pytest.mark.parametrize("name", list(COMMANDS))
def test_option_table_lists_what_help_lists_in_its_order(name):
    help_text = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "300"}).output
    table = option_table(name)
    rows = [line for line in table.splitlines()[2:] if not line.startswith("| **")]
    headings = re.findall(r"^\| \*\*(\w+)\*\* \|", table, re.M)
    assert headings == re.findall(r"^(\w+):$", help_text, re.M)
    cells = [row.split("`")[1].replace("\\|", "|") for row in rows]
    at = 0
    for cell in cells:  # each row's flags start a line of --help, in the table's order
        at = help_text.index(f"\n  {cell.split(',')[0].split()[0]}", at) + 1
    listed = {f for cell in cells for f in re.findall(r"--[\w][\w-]*", cell)} - {"--help"}
    assert listed == {f for f in _flags(name) if f.startswith("--")}


def _page_rows():
    """Each command page's option-table rows (docs/commands/NAME.md, and the dump options of
    the images guide): (command, the flags its first cell names)."""
    pages = {p: p.stem for p in (DOCS / "commands").glob("*.md")}
    pages[DOCS / "guides" / "media.md"] = "dump"
    for page, command in pages.items():
        if command not in COMMANDS:
            continue  # record is a library call
        for line in page.read_text().splitlines():
            if line.startswith("| `"):
                yield command, re.findall(r"--[\w][\w-]*", line.split("|")[1])


def test_page_option_tables_name_only_options_their_command_has():
    rows = list(_page_rows())
    assert sum(len(flags) for _, flags in rows) > 20
    for command, flags in rows:
        unknown = sorted(set(flags) - _flags(command))
        assert not unknown, f"docs' `modeltap {command}` table names {unknown}"


def _declared_flags(owner, declared, name):
    """(flag, owner) for each long flag of a declaration and its per-command variants."""
    for d in [declared, *(declared.for_command(c) for c in declared.variants)]:
        for flags in d.flags or (
            [] if d.argument else [f"--{(d.param or name).replace('_', '-')}"]
        ):
            for flag in flags.split("/"):
                if flag.startswith("--"):
                    yield flag, owner


def test_each_option_is_declared_once():
    """Before, --out was written in five places and compare restated six shared options: now a
    flag belongs to one declaration (a Settings field, CLI_ONLY, or a command's own), and no
    command module builds typer parameters itself."""
    import dataclasses
    import importlib

    from modeltap.cli.options import CLI_ONLY
    from modeltap.config import CliOption, Settings

    src = Path(__file__).resolve().parent.parent / "src" / "modeltap" / "cli"
    for path in src.glob("*.py"):
        if path.name not in ("options.py", "app.py"):  # app: --version only
            text = path.read_text()
            assert "typer.Option(" not in text and "typer.Argument(" not in text, path
    owners = {}
    found = [
        *(
            flag_owner
            for f in dataclasses.fields(Settings)
            if "cli" in f.metadata
            for flag_owner in _declared_flags(f"Settings.{f.name}", f.metadata["cli"], f.name)
        ),
        *(x for n, d in CLI_ONLY.items() for x in _declared_flags(f"CLI_ONLY.{n}", d, n)),
    ]
    for module, _ in COMMANDS.values():
        for n, d in vars(importlib.import_module(module)).items():
            if isinstance(d, CliOption):
                found.extend(_declared_flags(f"{module}.{n}", d, n.lower()))
    for flag, owner in found:
        owners.setdefault(flag, set()).add(owner)
    assert {f: o for f, o in owners.items() if len(o) > 1} == {}
    commands = {f for name in COMMANDS for f in _flags(name) if f.startswith("--")}
    assert commands - {"--help"} <= set(owners)



@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_names_its_flags(name):
    """typer before 0.29 upper-cases a flag it derives itself (`--DEVICE`): each option built
    hands typer its flag names, none is left to typer to derive."""
    from typing import get_args

    get_command(app).get_command(None, name)  # imports the command's module, registering it
    (callback,) = [
        c.callback for c in app.registered_commands if (c.name or c.callback.__name__) == name
    ] or [c.callback for c in app.registered_commands if c.callback.__name__.startswith(name)]
    for parameter in inspect.signature(callback).parameters.values():
        info = get_args(parameter.annotation)[1]
        if type(info).__name__ == "OptionInfo":
            # inside Annotated, typer reads the first flag from `default`
            decls = [d for d in (info.default, *info.param_decls) if isinstance(d, str)]
            assert any(d.startswith("--") for d in decls), parameter.name
            assert all(f == f.lower() for f in decls if f.startswith("--")), parameter.name

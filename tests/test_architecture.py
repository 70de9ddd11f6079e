"""The layout of the house: what the code's own map says, and who may import whom in tests."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in one file, relative ones with their leading dots."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            found.append((node.lineno, base))
            if not node.module:  # `from . import test_x`
                found += [(node.lineno, base + alias.name) for alias in node.names]
    return found


def test_no_test_module_or_script_imports_a_test_module() -> None:
    """Shared helpers live in tests/fixtures/, named for what they hold; a test module is never
    imported (running one test file would load another's, and a helper's home would depend on
    which test happened to need it first)."""
    offenders = []
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]):
        for line, name in _imported_modules(path):
            if name.lstrip(".").split(".")[-1].startswith("test_") or ".test_" in name:
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not offenders, "\n".join(offenders)


SRC = ROOT / "src"


def _lazy_facades() -> list[str]:
    """Every package whose `__init__` has a table of homes for its lazy names."""
    found = []
    for path in sorted((SRC / "modeltap").rglob("__init__.py")):
        names = {
            target.id
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        if names & {"_HOMES", "_EXPORTS"}:
            found.append(".".join(path.parent.relative_to(SRC).parts))
    return found


def _type_checking_imports(path: Path) -> dict[str, str]:
    """name -> module of each import under the facade's `if TYPE_CHECKING:`."""
    found: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom), ast.unparse(stmt)
                found.update({alias.asname or alias.name: stmt.module for alias in stmt.names})
    return found


def test_each_lazy_facade_declares_its_names_once() -> None:
    """A lazy facade's names are declared once, in its table of homes (`_HOMES`, name -> the
    submodule; the top level's `_EXPORTS`, name -> the module): `__all__` is made from it, and the
    imports type checkers read under TYPE_CHECKING name the same names from the same modules."""
    import importlib

    facades = _lazy_facades()
    assert {"modeltap", "modeltap.capture", "modeltap.loading", "modeltap.record"} <= set(facades)
    for package in facades:
        module = importlib.import_module(package)
        if package == "modeltap":
            homes = dict(module._EXPORTS)
        else:
            homes = {name: f"{package}.{home}" for name, home in module._HOMES.items()}
        path = Path(module.__file__)
        assert _type_checking_imports(path) == homes, package
        # __all__ is the table's names and the facade's own: its verbs, the version, and the
        # subpackages that are verbs themselves (modeltap.diff)
        tree = ast.parse(path.read_text())
        own = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        own |= {p.name for p in path.parent.iterdir() if p.is_dir()}
        own |= {"__version__"} if package == "modeltap" else set()
        public = {name for name in own if not name.startswith("_") or name == "__version__"}
        assert set(homes) <= set(module.__all__) <= set(homes) | public, package
        assert {n for n in public if not (path.parent / n).is_dir()} <= set(module.__all__)
        assert list(module.__all__) == sorted(module.__all__), package
        for name in module.__all__:
            assert getattr(module, name) is not None, (package, name)


def _package_docstring() -> str:
    return ast.get_docstring(ast.parse((SRC / "modeltap" / "__init__.py").read_text())) or ""


def _map_lines() -> list[str]:
    """The lines of the package docstring's map: indented, starting with a package or module."""
    return [
        line.strip()
        for line in _package_docstring().splitlines()
        if line.startswith("    ") and re.match(r"[\w/]+(/|\.py)\s", line.strip() + " ")
    ]


def test_the_map_of_the_house_names_every_stage_and_only_what_exists() -> None:
    """The package docstring draws the stages and the package that holds each: every package or
    module it names exists (a name in an entry's text is looked up in that entry's package, then
    at the top), and every public package and module of src/modeltap has its line."""
    top = SRC / "modeltap"
    lines = _map_lines()
    assert len(lines) >= 10, lines
    entries = []
    for line in lines:
        first, _, text = line.partition(" ")
        entries.append(first)
        assert (top / first).exists(), first
        for name in re.findall(r"(?<![\w./-])(\w+(?:/|\.py))(?![\w/])", text):
            here = top / first if first.endswith("/") else top
            assert (here / name).exists() or (top / name).exists(), (first, name)
    public = {
        p.name + ("/" if p.is_dir() else "")
        for p in top.iterdir()
        if (p.suffix == ".py" or (p / "__init__.py").is_file()) and not p.name.startswith("_")
    }
    assert public <= set(entries), sorted(public - set(entries))
    stages = "load -> select -> capture -> stats -> write -> render / diff / compare"
    assert stages in " ".join(_package_docstring().split())

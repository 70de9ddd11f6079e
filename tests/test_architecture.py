"""The layout of the house: what the code's own map says, and who may import whom in tests."""

from __future__ import annotations

import ast
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

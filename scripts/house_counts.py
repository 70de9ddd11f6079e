"""The house's counts, for a redesign's closing note: longest functions, largest files, import
cycles, and (where the `duplicates` command is on PATH) the pairs of places sharing six or more
lines.

    python scripts/house_counts.py [SRC] [--top 15] [--files 10] [--no-duplicates]

SRC is the folder that holds the `modeltap` package (default: this checkout's src/), so an older
tree checked out elsewhere (`git worktree add /tmp/base REV`) is counted the same way. The source
is read, never imported. A function's length is its lines from `def` to its last line (nested
functions are counted on their own, and inside their parent's length too); a file's length is its
line count. The import graph has an edge from a module to each `modeltap` module it imports:
`from a.b import c` reaches `a.b.c` when that is a module, else `a.b` (not the packages `a` and
`a.b` that Python runs first: every module would then reach the top). Imports under
`if TYPE_CHECKING:` are left out; imports inside functions are counted apart, as they run later.
A cycle is a set of modules that reach one another (a strongly connected component of more than
one module).
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules(src: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package under `src`."""
    found = {}
    for path in sorted((src / "modeltap").rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def functions(tree: ast.AST, prefix: str = "") -> list[tuple[int, str, int]]:
    """(lines, qualified name, first line) of every function and method in `tree`."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + node.name
            found.append((node.end_lineno - node.lineno + 1, name, node.lineno))
            found += functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            found += functions(node, prefix + node.name + ".")
        else:
            found += functions(node, prefix)
    return found


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def _imports(node: ast.AST, in_function: bool = False):  # noqa: ANN202 - a generator
    """(import node, inside a function) for every import below `node`, TYPE_CHECKING left out."""
    for child in ast.iter_child_nodes(node):
        if _is_type_checking(child):
            for other in child.orelse:
                yield from _imports(other, in_function)
            continue
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, in_function
        is_function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _imports(child, in_function or is_function)


def import_graph(src: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Edges between the package's modules: (at import time, inside functions)."""
    names = modules(src)
    top: dict[str, set[str]] = {name: set() for name in names}
    late: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node, in_function in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base
                    for alias in node.names
                ]
            hits = {t for t in targets if t in names and t != name}
            (late if in_function else top)[name] |= hits
    return top, late


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def mutual(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of modules that import each other."""
    return sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph.get(b, ()))


def duplicates(src: Path) -> list[str]:
    """The `duplicates` command's report on `src` (its first line counts the pairs)."""
    command = ["duplicates", "--repo", str(src), "--most", "200", "--seconds", "120"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=src)
    return done.stdout.splitlines()


def _relative(path: Path, src: Path) -> str:
    return str(path.relative_to(src))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", nargs="?", type=Path, default=ROOT / "src")
    parser.add_argument("--top", type=int, default=15, help="how many longest functions")
    parser.add_argument("--files", type=int, default=10, help="how many largest files")
    parser.add_argument("--no-duplicates", action="store_true", help="skip `duplicates`")
    args = parser.parse_args()
    src = args.src.resolve()
    names = modules(src)
    lines = {path: len(path.read_text().splitlines()) for path in names.values()}
    print(f"{src}: {len(names)} modules, {sum(lines.values())} lines")

    print(f"\nlongest functions (top {args.top}):")
    every = [
        (n, f"{_relative(path, src)}:{line} {name}")
        for path in names.values()
        for n, name, line in functions(ast.parse(path.read_text(), str(path)))
    ]
    for n, where in sorted(every, key=lambda e: (-e[0], e[1]))[: args.top]:
        print(f"  {n:5d}  {where}")
    print(f"  functions over 80 lines: {sum(n > 80 for n, _ in every)}")

    print(f"\nlargest files (top {args.files}):")
    for path, n in sorted(lines.items(), key=lambda e: (-e[1], str(e[0])))[: args.files]:
        print(f"  {n:5d}  {_relative(path, src)}")
    print(f"  files over 600 lines: {sum(n > 600 for n in lines.values())}")

    top, late = import_graph(src)
    both = {name: top[name] | late[name] for name in top}
    for title, graph in (("at import time", top), ("counting imports inside functions", both)):
        found = cycles(graph)
        print(f"\nimport cycles {title}: {len(found)}")
        for component in found:
            print(f"  {len(component)} modules: {', '.join(component)}")
        for a, b in mutual(graph):
            print(f"  mutual: {a} <-> {b}")

    if args.no_duplicates:
        return
    if shutil.which("duplicates") is None:
        print("\nduplicates: the command is not on PATH")
        return
    report = duplicates(src)
    print(f"\nduplicates --repo {src} --most 200 --seconds 120:")
    for row in report:
        print(f"  {row}")


if __name__ == "__main__":
    main()

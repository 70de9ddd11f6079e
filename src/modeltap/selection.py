"""named_modules -> the selected module names (depth, include, exclude)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from modeltap.errors import SelectionError

if TYPE_CHECKING:
    from torch import nn

# The root module has the empty name in named_modules(); keys and patterns use this instead.
ROOT = "__root__"

_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class Selection:
    """Which modules to hook: at most `depth` dotted components, matching include, not exclude."""

    depth: int | None = None
    include: tuple[str, ...] = field(default_factory=tuple)
    exclude: tuple[str, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict[str, object]:
        return {"depth": self.depth, "include": list(self.include), "exclude": list(self.exclude)}


def display_name(name: str) -> str:
    """The name a module has in keys and patterns: its dotted name, or ROOT for the model itself."""
    return name or ROOT


def module_depth(name: str) -> int:
    """Number of dotted components: root 0, `encoder` 1, `encoder.layer.9` 3."""
    return 0 if name in ("", ROOT) else name.count(".") + 1


def select_names(names: Sequence[str], selection: Selection) -> list[str]:
    """The names (in the given order) that the selection keeps; raises when it keeps none."""
    if selection.depth is not None and selection.depth < 0:
        raise SelectionError(f"--depth must be 0 or more, got {selection.depth}")
    shown = [display_name(n) for n in names]
    for pattern in selection.include:
        if not any(fnmatchcase(s, pattern) for s in shown):
            raise SelectionError(_no_match_message(pattern, shown, "--include"))
    for pattern in selection.exclude:
        if not any(fnmatchcase(s, pattern) for s in shown):
            raise SelectionError(_no_match_message(pattern, shown, "--exclude"))
    kept = [
        s
        for s in shown
        if (selection.depth is None or module_depth(s) <= selection.depth)
        and (not selection.include or any(fnmatchcase(s, p) for p in selection.include))
        and not any(fnmatchcase(s, p) for p in selection.exclude)
    ]
    if not kept:
        raise SelectionError(
            f"the selection {_describe(selection)} keeps no module; "
            "loosen --depth/--include/--exclude (`modeltap ls MODEL` lists the names)"
        )
    return kept


def select_modules(model: nn.Module, selection: Selection) -> list[str]:
    """Selected display names of `model`'s modules, in registration order."""
    return select_names([n for n, _ in model.named_modules()], selection)


def suggest(name: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to a misspelt name, if any is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_name_message(name: str, candidates: Iterable[str], what: str = "module") -> str:
    guess = suggest(name, candidates)
    hint = f"did you mean '{guess}'?" if guess else "`modeltap ls MODEL` lists the names"
    return f"no {what} '{name}'; {hint}"


def _no_match_message(pattern: str, shown: list[str], option: str) -> str:
    if _GLOB_CHARS.isdisjoint(pattern):
        return f"{option}: " + unknown_name_message(pattern, shown)
    return f"{option} '{pattern}' matches no module; `modeltap ls MODEL` lists the names"


def _describe(selection: Selection) -> str:
    parts = []
    if selection.depth is not None:
        parts.append(f"--depth {selection.depth}")
    parts += [f"--include '{p}'" for p in selection.include]
    parts += [f"--exclude '{p}'" for p in selection.exclude]
    return " ".join(parts) or "(everything)"

"""Diff: two dumps, two generations or two recorded runs -> a report, under one tolerance model.

One module per concern: `tolerance` (the allclose rule every diff applies: `Tolerance`, `margin`,
`close` for one number against another), `pairs` (one tensor against its match: `compare`),
`keymap` (which key of B a key of A meets: `--map` rules, structural matches), then one per kind of
input: `dumps` (`diff_dumps` -> `DiffReport`, `junit_xml`), `generations` (`diff_generations`,
step by step) and `runs` (`diff_runs`, run folders of `modeltap.record`, step by step and rank by
rank). Importing this package imports no torch, and each module only when one of its names is
first used. (No name here is also a module's: importing the module would bind it over the name.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modeltap._lazy import lazy_names

if TYPE_CHECKING:
    from modeltap.diff.dumps import REPORT_SCHEMA, DiffReport, MetaChange, diff_dumps, junit_xml
    from modeltap.diff.generations import (
        GenerationDiff,
        TokenSplit,
        diff_generations,
        is_generation,
        token_split,
    )
    from modeltap.diff.keymap import (
        MAP_SECTIONS,
        KeyRule,
        apply_map,
        parse_map,
        read_map_file,
        structural_matches,
    )
    from modeltap.diff.pairs import Pair, compare, failure_message, nan_note
    from modeltap.diff.runs import RunDiff, diff_runs
    from modeltap.diff.tolerance import Tolerance, margin

_HOMES = {
    **dict.fromkeys(["Tolerance", "margin"], "tolerance"),
    **dict.fromkeys(["Pair", "compare", "failure_message", "nan_note"], "pairs"),
    **dict.fromkeys(
        ["KeyRule", "MAP_SECTIONS", "apply_map", "parse_map", "read_map_file"], "keymap"
    ),
    "structural_matches": "keymap",
    **dict.fromkeys(
        ["REPORT_SCHEMA", "DiffReport", "MetaChange", "diff_dumps", "junit_xml"], "dumps"
    ),
    **dict.fromkeys(
        ["GenerationDiff", "TokenSplit", "diff_generations", "is_generation", "token_split"],
        "generations",
    ),
    **dict.fromkeys(["RunDiff", "diff_runs"], "runs"),
}

__getattr__ = lazy_names(__name__, _HOMES)

__all__ = [
    "DiffReport",
    "GenerationDiff",
    "KeyRule",
    "MAP_SECTIONS",
    "MetaChange",
    "Pair",
    "REPORT_SCHEMA",
    "RunDiff",
    "TokenSplit",
    "Tolerance",
    "apply_map",
    "compare",
    "diff_dumps",
    "diff_generations",
    "diff_runs",
    "failure_message",
    "is_generation",
    "junit_xml",
    "margin",
    "nan_note",
    "parse_map",
    "read_map_file",
    "structural_matches",
    "token_split",
]

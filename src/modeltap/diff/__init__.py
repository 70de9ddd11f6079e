"""`modeltap.diff(a, b, preset=...)`: two dumps, two generation dumps or two run folders ->
a report with `.passed`, under one tolerance model; and the package that computes it.

One module per concern: `tolerance` (the allclose rule every diff applies: `Tolerance`, `margin`,
`close` for one number against another), `pairs` (one tensor against its match: `compare`),
`keymap` (which key of B a key of A meets: `--map` rules, structural matches), then one per kind of
input: `dumps` (`diff_dumps` -> `DiffReport`, `junit_xml`), `generations` (`diff_generations`,
step by step) and `runs` (`diff_runs`, run folders of `modeltap.record`, step by step and rank by
rank); `verb` chooses among them (`diff`), and `from_settings` reads `modeltap diff`'s and
`report A B`'s settings. Importing this package imports no torch, and each module only when one
of its names is first used. (No name here is also a module's: importing the module would bind it
over the name.)

This package is also the verb: calling it calls `diff` (`_lazy.callable_package`). A function on the
facade named like the package would hide the package's names from `modeltap.diff.diff_dumps`
and `import modeltap.diff as d`; one object that is both leaves nothing to shadow, whichever
import comes first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modeltap._lazy import callable_package, lazy_names

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
    from modeltap.diff.tolerance import Tolerance, close, margin
    from modeltap.diff.verb import diff

_HOMES = {
    **dict.fromkeys(["Tolerance", "close", "margin"], "tolerance"),
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
    "diff": "verb",
}

__getattr__ = lazy_names(__name__, _HOMES)

# _HOMES declares the names; the imports under TYPE_CHECKING repeat them for type checkers
# (tests/test_architecture.py checks that they match).
__all__ = sorted(_HOMES)

callable_package(__name__, "modeltap.diff.verb", "diff")

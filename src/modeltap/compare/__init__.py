"""`compare`: run two variants of a model, replay every module with its selected children
short-circuited to the reference's outputs (`replay`, `shortcut`), and say which one introduced
the error, as a report (`report`) on a candidate built from the reference (`variants`).

Reuses diff for every tensor comparison, tolerance and the first divergence. This package is also
the verb: `modeltap.compare(model, candidate, inputs)` calls `verb.compare`
(`_lazy.callable_package`).
"""

from __future__ import annotations

from modeltap._lazy import callable_package
from modeltap.compare.bisect import Bisection, bisect
from modeltap.compare.replay import CANDIDATE_FILE, REFERENCE_FILE, Options, compare_models
from modeltap.compare.report import REPORT_SCHEMA, CompareReport, ModuleResult
from modeltap.compare.variants import DEFAULT_PRESET, Variant, make_candidate, parse_against

__all__ = [
    "Bisection",
    "CANDIDATE_FILE",
    "DEFAULT_PRESET",
    "REFERENCE_FILE",
    "REPORT_SCHEMA",
    "CompareReport",
    "ModuleResult",
    "Options",
    "Variant",
    "bisect",
    "compare_models",
    "make_candidate",
    "parse_against",
]

callable_package(__name__, "modeltap.compare.verb", "compare")

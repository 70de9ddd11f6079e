"""Recording during training: `record` (steps, ranks), the non-finite tripwire, rules, the index.

One module per concern: `recording` (`record` and `Recording`, the recorder, whose parts are
`options` (RecordOptions: record's keywords, checked), `steps`, `metadata`, `run_folder`,
`evaluation`, `optimizer_hooks`, `nonfinite` and `trip_files`), `tripwire` (which module made the
first NaN/Inf) and `sentinel` (the cheap check of steps not recorded), `flight` and
`flight_replay` (a trip's module re-run offline), `rules` (small functions over statistics),
`index` (the per-rank index that `modeltap show DIR` reads), `dist` (ranks and sharded tensors).
Importing this package imports no torch, and each of these modules only when one of its names is
first used. This package is also the verb: `modeltap.record(model, dir)` calls `recording.record`
(`_lazy.callable_package`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modeltap._lazy import callable_package, lazy_names

if TYPE_CHECKING:
    from modeltap.record.index import RunIndex, read_run, step_file_name
    from modeltap.record.options import RecordOptions
    from modeltap.record.recording import Recording, record
    from modeltap.record.rules import (
        DeadUnits,
        ExplodingGradient,
        Observation,
        Rule,
        RuleHit,
        Saturation,
        UpdateRatio,
        VanishingGradient,
        default_rules,
    )
    from modeltap.record.tripwire import NonFiniteError, Trip

# Each name from the module that defines it, when first asked for: `modeltap show` and the other
# commands import this package's index only, and should not pay for the recorder.
_HOMES = {
    "RunIndex": "index",
    "read_run": "index",
    "step_file_name": "index",
    "Recording": "recording",
    "RecordOptions": "options",
    "record": "recording",
    "NonFiniteError": "tripwire",
    "Trip": "tripwire",
    **dict.fromkeys(
        [
            "DeadUnits",
            "ExplodingGradient",
            "Observation",
            "Rule",
            "RuleHit",
            "Saturation",
            "UpdateRatio",
            "VanishingGradient",
            "default_rules",
        ],
        "rules",
    ),
}


__getattr__ = lazy_names(__name__, _HOMES)


# _HOMES declares the names; the imports under TYPE_CHECKING repeat them for type checkers
# (tests/test_architecture.py checks that they match).
__all__ = sorted(_HOMES)

callable_package(__name__, "modeltap.record.recording", "record")

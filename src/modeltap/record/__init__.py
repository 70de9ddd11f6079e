"""Recording during training: `record` (steps, ranks), the non-finite tripwire, rules, the index.

One module per concern: `recording` (the recorder and its hooks), `tripwire` (which module made
the first NaN/Inf), `rules` (small functions over statistics), `index` (the per-rank index that
`modeltap show DIR` reads), `dist` (ranks and sharded tensors). Importing this package imports no
torch, and each of these modules only when one of its names is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modeltap._lazy import lazy_names

if TYPE_CHECKING:
    from modeltap.record.index import RunIndex, read_run, step_file_name
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


__all__ = [
    "DeadUnits",
    "ExplodingGradient",
    "NonFiniteError",
    "Observation",
    "Recording",
    "Rule",
    "RuleHit",
    "RunIndex",
    "Saturation",
    "Trip",
    "UpdateRatio",
    "VanishingGradient",
    "default_rules",
    "read_run",
    "record",
    "step_file_name",
]

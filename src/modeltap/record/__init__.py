"""Recording during training: `record` (steps, ranks), the non-finite tripwire, rules, the index.

One module per concern: `recording` (the recorder and its hooks), `tripwire` (which module made
the first NaN/Inf), `rules` (small functions over statistics), `index` (the per-rank index that
`modeltap show DIR` reads), `dist` (ranks and sharded tensors). Importing this package imports no
torch.
"""

from __future__ import annotations

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

"""What `compare` found, per module: local error (replay), cumulative error (diff), attribution.

A module's local error is that of its own code: it is replayed with its selected children
short-circuited (`SHORT_CIRCUIT`: each returns the reference child's output on the input the
replay hands it, so the module's own error reaches its output through them and theirs does not),
or is a leaf (`LEAF`). An **origin**
is a module whose local error is out of tolerance: the error arises in its own code. A module
replayed in full (`FULL`: its children could not stand in, see its `replay_note`) measures its
children's error too, so it is an origin only when no selected descendant's local error is out.
A module that is not an origin but holds one is **via child**; a module whose cumulative error is
out of tolerance with its local error within, and no origin inside, is **inherited**: it only
passes on what it received.

Local errors are judged with the tolerance asked for; cumulative errors with that tolerance
widened for rounding accumulated from module to module (`Options.accumulated`). The verdict is
PASS when no module is an origin and every cumulative error is within its widened tolerance.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from modeltap.capture import split_key
from modeltap.diff.dumps import DiffReport
from modeltap.diff.pairs import Pair
from modeltap.diff.tolerance import Tolerance
from modeltap.selection import ROOT

REPORT_SCHEMA = "modeltap.compare/3"

# How a module's replay ran (ModuleResult.replay).
LEAF = "leaf"  # no selected child was called: replayed as it is
SHORT_CIRCUIT = "short_circuit"  # its selected children returned the reference child's outputs
FULL = "full"  # its children were computed again (replay_note says why)

# Module statuses: replayed, or why not.
REPLAYED = "replayed"
NOT_COMPARED = {
    "nondeterministic": "uses randomness (dropout in train mode): reported, not compared",
    "stateful": "takes a cache or other state: reported, not compared",
    "unmapped": "has no counterpart in the candidate (see --map)",
    "not_called": "never called in the forward (a container such as ModuleList)",
    "replay_error": "the candidate's module failed on the reference's inputs",
    "not_replayed": "below the replay depth",
}


@dataclass
class ModuleResult:
    """One selected module of the reference."""

    name: str
    other: str | None = None  # the candidate's module
    status: str = REPLAYED
    calls: int = 0
    local: list[Pair] = field(default_factory=list)
    cumulative: list[Pair] = field(default_factory=list)
    # False when replaying the reference module on its own inputs did not reproduce its output
    # bit for bit: its local error can't be trusted (hidden state, randomness, in-place inputs).
    valid: bool = True
    note: str = ""
    origin: bool = False
    replay: str = ""  # LEAF, SHORT_CIRCUIT or FULL; "" when never replayed
    replay_note: str = ""  # why FULL
    holds_origin: bool = False  # a selected descendant is an origin

    @property
    def compared(self) -> bool:
        return self.status == REPLAYED and self.valid and bool(self.local)

    @property
    def local_out(self) -> bool:
        return self.compared and any(not p.ok for p in self.local)

    @property
    def cumulative_out(self) -> bool:
        return any(not p.ok for p in self.cumulative)

    @property
    def local_error(self) -> float | None:
        """The largest max |a - b| / max |b| over the module's outputs, replayed."""
        return _worst(self.local)

    @property
    def cumulative_error(self) -> float | None:
        return _worst(self.cumulative)

    @property
    def verdict(self) -> str:
        if self.status != REPLAYED:
            return self.status
        if not self.valid:
            return "replay_invalid"
        if self.origin:
            return "origin"
        if self.holds_origin and (self.local_out or self.cumulative_out):
            return "via_child"  # out of tolerance because a descendant is
        if self.cumulative_out:
            return "inherited"
        return "ok"

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.name,
            "candidate": self.other,
            "status": self.status,
            "verdict": self.verdict,
            "calls": self.calls,
            "valid": self.valid,
            "replay": self.replay or None,
            "local_error": self.local_error,
            "cumulative_error": self.cumulative_error,
            "local": [p.to_json() for p in self.local],
            "cumulative": [p.other for p in self.cumulative],
            "note": self.note or None,
            "replay_note": self.replay_note or None,
        }


def _worst(pairs: list[Pair]) -> float | None:
    values = [p.max_scaled for p in pairs if p.max_scaled is not None]
    if any(p.status in ("shape", "dtype") or p.nan_mismatch for p in pairs):
        return float("inf")
    return max(values) if values else None


def _descends(name: str, ancestor: str) -> bool:
    return ancestor == ROOT and name != ROOT or name.startswith(ancestor + ".")


def attribute(modules: list[ModuleResult]) -> None:
    """Mark origins: local error (of the module's own code) out of tolerance; for a module
    replayed in full, also no selected descendant's."""
    out = [m.name for m in modules if m.local_out]
    for module in modules:
        module.origin = module.local_out and (
            module.replay != FULL or not any(_descends(o, module.name) for o in out)
        )
    origins = [m.name for m in modules if m.origin]
    for module in modules:
        module.holds_origin = any(_descends(o, module.name) for o in origins)


@dataclass
class CompareReport:
    reference: dict[str, str]
    candidate: dict[str, str]
    cumulative: DiffReport  # judged with the accumulated tolerance: see `Options.accumulated`
    modules: list[ModuleResult]
    tolerance: Tolerance = field(default_factory=Tolerance)  # the local errors'
    preset: str | None = None
    replay_depth: int | None = None
    replay_note: str = ""
    warnings: list[str] = field(default_factory=list)
    bisection: Any = None  # compare.bisect.Bisection, with --bisect
    op_blame: Any = None  # compare.ops.OpBlame, with --ops: the worst origin's ops

    @property
    def origins(self) -> list[ModuleResult]:
        """Origins, largest local error first."""
        found = [m for m in self.modules if m.origin]
        return sorted(found, key=lambda m: -(m.local_error or 0.0))

    @property
    def inherited(self) -> list[ModuleResult]:
        return [m for m in self.modules if m.verdict == "inherited"]

    @property
    def invalid(self) -> list[ModuleResult]:
        return [m for m in self.modules if m.status == REPLAYED and not m.valid]

    @property
    def full_replays(self) -> list[ModuleResult]:
        """Modules replayed with their children computed again (their note says why)."""
        return [m for m in self.modules if m.status == REPLAYED and m.replay == FULL]

    @property
    def not_compared(self) -> list[ModuleResult]:
        return [m for m in self.modules if m.status != REPLAYED]

    @property
    def first_divergence(self) -> Pair | None:
        return self.cumulative.first_divergence

    @property
    def passed(self) -> bool:
        return self.cumulative.passed and not any(m.local_out for m in self.modules)

    def module_of(self, pair: Pair) -> str:
        """The reference module a cumulative pair belongs to (B, the reference, is `other`)."""
        return split_key(pair.other)[0]

    def to_json(self) -> dict[str, Any]:
        first = self.first_divergence
        bisect = {} if self.bisection is None else {"bisect": self.bisection.to_json()}
        return {
            "schema": REPORT_SCHEMA,
            "passed": self.passed,
            "reference": self.reference,
            "candidate": self.candidate,
            "preset": self.preset,
            "tolerance": asdict(self.tolerance),
            "accumulated_tolerance": asdict(self.cumulative.tolerance),
            "replay": {"depth": self.replay_depth, "note": self.replay_note},
            "origins": [
                {
                    "module": m.name,
                    "local_error": m.local_error,
                    "keys": [p.other for p in m.local if not p.ok],
                }
                for m in self.origins
            ],
            "first_divergence": first.other if first else None,
            "inherited": [m.name for m in self.inherited],
            "replay_invalid": [m.name for m in self.invalid],
            "not_compared": {m.name: m.status for m in self.not_compared},
            "full_replay": {m.name: m.replay_note for m in self.full_replays},
            "counts": {
                "modules": len(self.modules),
                "replayed": sum(m.status == REPLAYED for m in self.modules),
                "full_replay": len(self.full_replays),
                "origins": len(self.origins),
                "inherited": len(self.inherited),
                "replay_invalid": len(self.invalid),
                "not_compared": len(self.not_compared),
            },
            "warnings": self.warnings,
            **bisect,
            **({} if self.op_blame is None else {"ops": self.op_blame.to_json()}),
            "modules": [m.to_json() for m in self.modules],
            "cumulative": self.cumulative.to_json(),
        }

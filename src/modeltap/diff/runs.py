"""Two recorded runs compared step by step and rank by rank: where do they part ways?

From the indexes first: every key's norm and absmax of every step both runs recorded, on every
rank both have, with allclose semantics (|a - b| <= atol + rtol * |b|). Step files are read only
where both runs hold full tensors for a step (`full_every`), and there the tensors themselves are
compared (`diff_dumps`), since equal statistics do not make equal tensors. The report names the
first (step, rank, key) out of tolerance, in step order and then in the order the step recorded
its keys (forward, then backward).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeltap.errors import InputError

if TYPE_CHECKING:
    from modeltap.diff.formats import Crossing
    from modeltap.diff.tolerance import Tolerance
    from modeltap.record.index import RunIndex

SCHEMA = 2  # 2: a step's `worst` is the key nearest its limit (`worst_of_limit`)
_FIELDS = ("norm", "absmax")


@dataclass
class StepDiff:
    """One step of one rank, both runs."""

    step: int
    rank: int
    compared: int  # keys compared
    failed: list[str] = field(default_factory=list)  # keys out of tolerance, in recorded order
    # The key with the largest difference for its own limit, |a - b| / (atol + rtol * |b|) of
    # its norm and absmax (of its elements, for tensors): above 1 out of tolerance. (Not the
    # largest relative difference: that is a key near zero, well inside atol.)
    worst: str | None = None
    worst_of_limit: float = 0.0
    tensors: bool = False  # compared tensor by tensor (both files full)

    @property
    def first(self) -> str | None:
        return self.failed[0] if self.failed else None


@dataclass
class RunDiff:
    a: Path
    b: Path
    tolerance: Tolerance
    steps: list[StepDiff]
    only_a: list[tuple[int, int]]  # (step, rank) recorded in A only
    only_b: list[tuple[int, int]]
    first_values: dict[str, Any] = field(default_factory=dict)  # A's and B's stats at the first
    # with record(..., formats=[...]) in both runs: the formats both measured, and per rank, key
    # and format the first common step its SQNR in A is below a threshold that B's is above
    # (`crossed`), or above one that B's is below (`recovered`)
    formats: list[str] = field(default_factory=list)
    crossed: list[Crossing] = field(default_factory=list)
    recovered: list[Crossing] = field(default_factory=list)

    @property
    def first(self) -> StepDiff | None:
        return next((s for s in self.steps if s.failed), None)

    @property
    def passed(self) -> bool:
        return self.first is None

    def to_json(self) -> dict[str, Any]:
        first = self.first
        return {
            "schema": SCHEMA,
            "kind": "runs",
            "a": str(self.a),
            "b": str(self.b),
            "passed": self.passed,
            "tolerance": asdict(self.tolerance),
            "first_divergence": None
            if first is None
            else {"step": first.step, "rank": first.rank, "key": first.first, **self.first_values},
            "steps": [{**asdict(s), "first": s.first} for s in self.steps],
            "only_a": [list(x) for x in self.only_a],
            "only_b": [list(x) for x in self.only_b],
            **({"formats": self._formats_json()} if self.formats else {}),
        }

    def _formats_json(self) -> dict[str, Any]:
        from modeltap.diff.formats import summary_json

        return summary_json(self.formats, self.crossed, self.recovered)


def diff_runs(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    tolerance: Tolerance | None = None,
) -> RunDiff:
    """Compare two runs written by `modeltap.record` (see the module docstring)."""
    from modeltap.diff.dumps import diff_dumps
    from modeltap.diff.keymap import sides
    from modeltap.diff.tolerance import Tolerance, close, margin, of_limit
    from modeltap.record.index import read_run

    tol = tolerance or Tolerance()
    run_a, run_b = read_run(a), read_run(b)
    ranks = sorted(set(run_a.ranks) & set(run_b.ranks))
    if not ranks:
        raise InputError(
            f"'{a}' (ranks {list(run_a.ranks)}) and '{b}' (ranks {list(run_b.ranks)}) share no "
            "rank; compare runs of the same world size"
        )
    steps: list[StepDiff] = []
    only_a: list[tuple[int, int]] = []
    only_b: list[tuple[int, int]] = []
    for rank in ranks:
        by_step_a = {s["step"]: s for s in run_a.ranks[rank].steps}
        by_step_b = {s["step"]: s for s in run_b.ranks[rank].steps}
        common, steps_a, steps_b = sides(sorted(by_step_a), sorted(by_step_b))
        only_a += [(s, rank) for s in steps_a]
        only_b += [(s, rank) for s in steps_b]
        for step in common:
            sa, sb = by_step_a[step], by_step_b[step]
            common = [k for k in sa["keys"] if k in sb["keys"]]
            result = StepDiff(step, rank, len(common))
            for key in common:
                ea, eb = sa["keys"][key], sb["keys"][key]
                share = max(of_limit(ea.get(f), eb.get(f), tol) for f in _FIELDS)
                if share > result.worst_of_limit:
                    result.worst, result.worst_of_limit = key, share
                out = any(
                    not close(ea.get(f), eb.get(f), tol) for f in _FIELDS
                ) or bool(ea.get("nonfinite")) != bool(eb.get("nonfinite"))
                if out:
                    result.failed.append(key)
            if sa.get("full") and sb.get("full"):
                # Full tensors on both sides: the tensors decide, not their statistics.
                report = diff_dumps(
                    run_a.folder / sa["file"], run_b.folder / sb["file"], tolerance=tol
                )
                order = {k: i for i, k in enumerate(sa["keys"])}
                failed = sorted(
                    (p.key for p in report.failed), key=lambda k: order.get(k, len(order))
                )
                result.failed, result.tensors = failed, True
                shares = [(margin(p, tol), p.key) for p in report.pairs]
                share, key = max(shares, default=(0.0, None))
                result.worst, result.worst_of_limit = (key, share) if share > 0 else (None, 0.0)
            steps.append(result)
    steps.sort(key=lambda s: (s.step, s.rank))
    # The first divergence is the earliest step's, on the lowest rank that diverged there.
    first = next((s for s in steps if s.failed), None)
    first_values: dict[str, Any] = {}
    if first is not None:
        sa = {s["step"]: s for s in run_a.ranks[first.rank].steps}[first.step]
        sb = {s["step"]: s for s in run_b.ranks[first.rank].steps}[first.step]
        key = first.failed[0]
        first_values = {
            "a": {f: sa["keys"].get(key, {}).get(f) for f in _FIELDS},
            "b": {f: sb["keys"].get(key, {}).get(f) for f in _FIELDS},
        }
    if not steps:
        raise InputError(
            f"'{a}' and '{b}' recorded no common step; record both with the same every and "
            "start_step"
        )
    report = RunDiff(Path(a), Path(b), tol, steps, only_a, only_b, first_values)
    report.formats, report.crossed, report.recovered = _format_crossings(run_a, run_b, ranks)
    return report


def _format_crossings(
    run_a: RunIndex, run_b: RunIndex, ranks: list[int]
) -> tuple[list[str], list[Crossing], list[Crossing]]:
    """(formats both runs measured, crossings down, crossings up): per rank, key and format, the
    first step both recorded where A's SQNR sits at a worse (better) level than B's."""
    from modeltap.diff.formats import crossings
    from modeltap.record.index import step_formats

    formats: list[str] = []
    found: dict[bool, dict[tuple[int, str, str], Crossing]] = {False: {}, True: {}}
    for rank in ranks:
        names_a, steps_a = step_formats(run_a, rank)
        names_b, steps_b = step_formats(run_b, rank)
        names = [n for n in names_a if n in names_b]
        formats += [n for n in names if n not in formats]
        by_step_b = dict(steps_b)
        for step, keys_a in steps_a:
            keys_b = by_step_b.get(step, {})
            for key in (k for k in keys_a if k in keys_b):
                figures = {n: {"a": keys_a[key].get(n), "b": keys_b[key].get(n)} for n in names}
                for up in (False, True):
                    for c in crossings(key, figures, recovered=up):
                        c.step, c.rank = step, rank
                        found[up].setdefault((rank, key, c.format), c)
    down, up = (sorted(found[k].values(), key=lambda c: (c.step, c.rank)) for k in (False, True))
    return formats, down, up


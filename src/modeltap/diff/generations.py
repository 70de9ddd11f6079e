"""Two generation dumps -> where their tokens part, and per step where their values do.

The steps both dumps have are compared one by one, each as a one-forward dump (`step_view`): with
diff's metrics where both sides kept the step's tensors, else on the statistics both always keep
(the L2 norm, mean and largest magnitude of each tensor, within the same tolerance). After the
first step whose chosen token differs the two runs read different inputs; those steps are still
compared (a teacher-forced run, as `compare --generate` makes, stays comparable throughout).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from modeltap.diff.dumps import diff_dumps
from modeltap.diff.keymap import sides
from modeltap.diff.tolerance import Tolerance, close
from modeltap.dump import Dump, load_dump
from modeltap.errors import InputError
from modeltap.generate import generation_meta, step_view, steps_of

REPORT_SCHEMA = "modeltap.generation-diff/1"


@dataclass
class StepDiff:
    """One decoding step of A against the same step of B."""

    step: int
    by: str  # "tensors" or "statistics"
    compared: int
    failed: int
    first: str | None  # the step's first key out of tolerance, in execution order
    max_abs: float | None  # the step's largest absolute error (tensors) or norm difference
    worst: str | None  # the key it is on
    token_a: list[int] = field(default_factory=list)
    token_b: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failed == 0

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "by": self.by,
            "compared": self.compared,
            "failed": self.failed,
            "first": self.first,
            "max_abs": self.max_abs,
            "worst": self.worst,
            "token_a": self.token_a,
            "token_b": self.token_b,
        }


@dataclass
class TokenSplit:
    """The first step whose chosen token differs (batch row `row`), with both sides' choices."""

    step: int
    row: int
    token_a: int
    token_b: int
    text_a: str | None
    text_b: str | None
    p_a: float
    p_b: float


@dataclass
class GenerationDiff:
    a: Dump
    b: Dump
    tolerance: Tolerance
    steps: list[StepDiff]
    only_a: list[int]  # steps one side has and the other not
    only_b: list[int]
    split: TokenSplit | None

    @property
    def first_divergence(self) -> StepDiff | None:
        return next((s for s in self.steps if not s.ok), None)

    @property
    def passed(self) -> bool:
        return (
            self.split is None
            and all(s.ok for s in self.steps)
            and not (self.only_a or self.only_b)
        )

    def to_json(self) -> dict[str, Any]:
        first = self.first_divergence
        split = self.split
        return {
            "schema": REPORT_SCHEMA,
            "a": str(self.a.path),
            "b": str(self.b.path),
            "passed": self.passed,
            "tolerance": vars(self.tolerance),
            "token_split": None if split is None else vars(split),
            "first_divergence": None if first is None else {"step": first.step, "key": first.first},
            "only_a": self.only_a,
            "only_b": self.only_b,
            "steps": [s.to_json() for s in self.steps],
        }


def is_generation(path: str | os.PathLike[str]) -> bool:
    try:
        return "generate" in load_dump(path).metadata
    except InputError:
        return False


def diff_generations(
    a: str | os.PathLike[str] | Dump,
    b: str | os.PathLike[str] | Dump,
    *,
    tolerance: Tolerance | None = None,
    overrides: Any = (),
    equal_nan: bool = False,
    upcast: bool = False,
) -> GenerationDiff:
    """Compare generation dump `a` with `b` (the reference) step by step."""
    da = a if isinstance(a, Dump) else load_dump(a)
    db = b if isinstance(b, Dump) else load_dump(b)
    gens = [generation_meta(d) for d in (da, db)]
    for dump, gen in zip((da, db), gens, strict=True):
        if gen is None:
            raise InputError(
                f"'{dump.path}' is not a generation dump; diff two files of `modeltap generate`, "
                "or two of `modeltap dump`"
            )
    gen_a, gen_b = gens
    assert gen_a is not None and gen_b is not None
    tolerance = tolerance or Tolerance()
    steps_a, steps_b = steps_of(da), steps_of(db)
    common, only_a, only_b = sides(steps_a, steps_b)
    tokens_a = {s["step"]: s for s in gen_a["steps"]}
    tokens_b = {s["step"]: s for s in gen_b["steps"]}
    results = []
    for step in common:
        va, vb = step_view(da, step), step_view(db, step)
        if va.stats_only or vb.stats_only:
            result = _by_statistics(step, va, vb, tolerance)
        else:
            report = diff_dumps(
                va, vb, tolerance=tolerance, overrides=overrides, equal_nan=equal_nan,
                upcast=upcast,
            )  # fmt: skip
            worst = max(
                (p for p in report.pairs if p.max_abs is not None),
                key=lambda p: p.max_abs or 0.0,
                default=None,
            )
            first = report.first_divergence
            result = StepDiff(
                step, "tensors", len(report.pairs), len(report.failed),
                first.key if first else None, worst.max_abs if worst else None,
                worst.key if worst else None,
            )  # fmt: skip
        result.token_a = tokens_a.get(step, {}).get("token", [])
        result.token_b = tokens_b.get(step, {}).get("token", [])
        results.append(result)
    return GenerationDiff(
        da,
        db,
        tolerance,
        results,
        only_a,
        only_b,
        token_split(gen_a, gen_b),
    )


def token_split(gen_a: dict[str, Any], gen_b: dict[str, Any]) -> TokenSplit | None:
    """The first step (and batch row) whose chosen token differs between two generations."""
    for sa, sb in zip(gen_a["steps"], gen_b["steps"], strict=False):
        for row, (ta, tb) in enumerate(zip(sa["token"], sb["token"], strict=False)):
            if ta != tb:
                texts_a, texts_b = sa.get("text") or [], sb.get("text") or []
                return TokenSplit(
                    sa["step"], row, ta, tb,
                    texts_a[row] if texts_a else None, texts_b[row] if texts_b else None,
                    sa["p"][row], sb["p"][row],
                )  # fmt: skip
    return None


def _by_statistics(step: int, a: Dump, b: Dump, tol: Tolerance) -> StepDiff:
    """A step without tensors on one side: each key's norm, mean and largest magnitude, each
    number judged by `close` (the rule run diffs apply to their statistics)."""
    keys_b = set(b.keys())
    compared = failed = 0
    first = worst = None
    largest: float | None = None
    for key in a.keys():
        if key not in keys_b:
            continue
        sa, sb = a.stats_for(key), b.stats_for(key)
        if sa is None or sb is None:
            continue
        compared += 1
        values = ((sa.norm, sb.norm), (sa.mean, sb.mean), (sa.absmax, sb.absmax))
        out = any(not close(x, y, tol) for x, y in values if x is not None and y is not None)
        gap = abs(sa.norm - sb.norm) if sa.norm is not None and sb.norm is not None else None
        if gap is not None and (largest is None or gap > largest):
            largest, worst = gap, key
        if out:
            failed += 1
            first = first or key
    return StepDiff(step, "statistics", compared, failed, first, largest, worst)

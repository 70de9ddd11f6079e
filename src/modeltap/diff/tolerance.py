"""The one tolerance model of every diff: allclose, |a - b| <= atol + rtol * |b|, widened by a
scale-relative term and a cosine floor; how far a value is from its limit (`of_limit`, `margin`).

Dumps compare tensors elementwise (`pairs.compare`); generations without tensors and recorded runs
compare statistics, one number against another, with `close` and `of_limit` below.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from modeltap.errors import InputError

if TYPE_CHECKING:
    from modeltap.diff.pairs import Pair


@dataclass(frozen=True)
class Tolerance:
    """allclose semantics, as torch: |a - b| <= atol + rtol * |b|, widened by a scale-relative term.

    `scaled_atol` adds `scaled_atol * max|b|` to atol: low-precision arithmetic errs in proportion
    to the magnitudes a tensor holds, so an element near zero next to large ones carries the large
    ones' rounding error, which no per-element rtol accepts. `min_cosine`, when set, also fails a
    pair whose cosine similarity falls below it (a whole tensor drifting within the elementwise
    bounds).
    """

    atol: float = 1e-8
    rtol: float = 1e-5
    scaled_atol: float = 0.0
    min_cosine: float | None = None

    def describe(self) -> str:
        text = f"atol={self.atol:g}, rtol={self.rtol:g}"
        if self.scaled_atol:
            text += f", scaled_atol={self.scaled_atol:g}"
        if self.min_cosine is not None:
            text += f", min_cosine={self.min_cosine:g}"
        return text


def from_preset(preset: str | None = None, **given: float | None) -> tuple[Tolerance, bool]:
    """The tolerance of `preset` (modeltap's tolerances.toml, or the one in $MODELTAP_CONFIGS or
    ./configs) with each value `given` (atol, rtol, scaled_atol, min_cosine; None: not given)
    over it, and whether the preset says to upcast (one made for comparing dtypes: bf16, fp16)."""
    values: dict[str, float | None] = {}
    upcast = False
    if preset:
        from modeltap.config import read_preset

        chosen = read_preset(preset)
        values = {f.name: chosen[f.name] for f in fields(Tolerance) if f.name in chosen}
        upcast = bool(chosen.get("upcast"))
    values.update({k: v for k, v in given.items() if v is not None})
    tolerance = Tolerance(**values)  # type: ignore[arg-type]
    if min(tolerance.atol, tolerance.rtol, tolerance.scaled_atol) < 0:
        raise InputError("atol, rtol and scaled_atol must be 0 or more")
    return tolerance, upcast


def per_key(
    tolerance: Tolerance, overrides: Mapping[str, Mapping[str, float]]
) -> list[tuple[str, Tolerance]]:
    """(glob of A's keys, its tolerance) for each entry of `overrides` (a config's
    `[diff.overrides."pooler*"]`, the verb's `overrides=`): `tolerance` with the entry's values
    over it."""
    return [(glob, replace(tolerance, **values)) for glob, values in overrides.items()]


def margin(pair: Pair, tolerance: Tolerance) -> float:
    """How far a pair is from failing, as a share of its own limit: the elementwise rule's
    (`of_limit`) or the cosine's, (1 - cosine) / (1 - min_cosine), whichever is larger; above 1
    out of tolerance, inf for a shape or dtype mismatch."""
    if pair.status in ("shape", "dtype"):
        return math.inf
    shares = [pair.of_limit or 0.0]
    if tolerance.min_cosine is not None and pair.cosine is not None:
        room = 1.0 - tolerance.min_cosine
        lost = 1.0 - pair.cosine
        shares.append(lost / room if room > 0 else (math.inf if lost > 0 else 0.0))
    return max(shares)


def close(a: float | None, b: float | None, tolerance: Tolerance) -> bool:
    """One number against another (a statistic of each side: a norm, a mean, an absmax) by the
    elementwise rule, |a - b| <= atol + rtol * |b|, with torch.isclose's non-finite values: NaN
    matches only NaN, an infinity only itself. None (not recorded) matches only None.
    `scaled_atol` and `min_cosine` speak of a tensor's elements and do not apply to one number."""
    if a is None or b is None:
        return a == b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= tolerance.atol + tolerance.rtol * abs(b)


def of_limit(a: float | None, b: float | None, tolerance: Tolerance) -> float:
    """|a - b| / (atol + rtol * |b|) of two numbers, as `close` judges them (above 1 out of
    tolerance): 0 when equal, inf where only one side is missing or not finite (or the limit
    is 0)."""
    if a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b)):
        return 0.0
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    limit = tolerance.atol + tolerance.rtol * abs(b)
    return abs(a - b) / limit if limit else math.inf

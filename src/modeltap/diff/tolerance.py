"""The one tolerance model of every diff: allclose, |a - b| <= atol + rtol * |b|, widened by a
scale-relative term and a cosine floor; how far a value is from its limit (`of_limit`, `margin`).

Dumps compare tensors elementwise (`pairs.compare`); generations without tensors and recorded runs
compare statistics, one number against another, with `close` and `of_limit` below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

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

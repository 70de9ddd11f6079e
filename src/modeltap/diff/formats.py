"""The `--formats` figures (stats/formats.py) of two sides side by side: each paired key's figures
in A and in B per format, and the keys that fall below a threshold in A, the candidate, while B's,
the reference, stayed above it (`Crossing`): "which layers stop taking int8 after this change" is
what a reader compares for. The thresholds are the dump tree's colours (render/tree.py,
FORMAT_BAD_DB in red, FORMAT_WARN_DB in yellow), read from there so every view says the same.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modeltap.stats import TensorStats

# From the best level to the worst: at or above FORMAT_WARN_DB, below it, below FORMAT_BAD_DB.
LEVELS = ("ok", "warn", "bad")

Figures = dict[str, float | None]  # rel_rmse, sqnr_db, underflow, clipped of one format
SideFigures = dict[str, dict[str, Figures | None]]  # format -> {"a": ..., "b": ...}


def thresholds() -> dict[str, float]:
    """The SQNR (dB) below which a format's figure is `bad` and `warn`: the tree's colours."""
    from modeltap.render.tree import FORMAT_BAD_DB, FORMAT_WARN_DB

    return {"bad": FORMAT_BAD_DB, "warn": FORMAT_WARN_DB}


def level(sqnr_db: float | None) -> str:
    """`bad` below FORMAT_BAD_DB, `warn` below FORMAT_WARN_DB, else `ok` (None: quantizing
    changes nothing, the best there is)."""
    if sqnr_db is None:
        return "ok"
    limits = thresholds()
    return "bad" if sqnr_db < limits["bad"] else "warn" if sqnr_db < limits["warn"] else "ok"


def worse(than_db: float | None, sqnr_db: float | None) -> bool:
    """Whether `sqnr_db` sits at a worse level than `than_db` (a threshold between them)."""
    return LEVELS.index(level(sqnr_db)) > LEVELS.index(level(than_db))


def metadata_formats(*metadata: Mapping[str, str]) -> list[str]:
    """The formats any of these dumps' metadata says its statistics hold figures of, in order."""
    names: dict[str, None] = {}
    for meta in metadata:
        names.update(dict.fromkeys(json.loads(meta.get("formats", "[]") or "[]")))
    return list(names)


def side_figures(
    a: TensorStats | None, b: TensorStats | None, formats: Sequence[str]
) -> SideFigures | None:
    """{format: {"a": figures, "b": figures}} of the formats either side measured (None where a
    side did not), or None when neither did."""
    out: SideFigures = {}
    for name in formats:
        fa = (a.formats or {}).get(name) if a is not None else None
        fb = (b.formats or {}).get(name) if b is not None else None
        if fa is not None or fb is not None:
            out[name] = {"a": fa, "b": fb}
    return out or None


@dataclass
class Crossing:
    """A key whose SQNR in a format sits at a worse level in A than in B (or a better one:
    `recovered` lists those). `step` and `rank` for two runs: the first step it does."""

    key: str
    format: str
    a_db: float | None  # None: quantizing changes nothing
    b_db: float | None
    level: str  # A's: warn or bad (for one that recovered: ok or warn)
    other: str | None = None  # B's key, where it is not `key`
    step: int | None = None
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        return {k: v for k, v in out.items() if v is not None or k in ("a_db", "b_db")}


def crossings(
    key: str, figures: SideFigures | None, *, other: str | None = None, recovered: bool = False
) -> list[Crossing]:
    """The formats in which `key`'s SQNR in A is below a threshold that B's is above (above one
    that B's is below: `recovered`); only where both sides measured it."""
    found = []
    for name, sides in (figures or {}).items():
        fa, fb = sides["a"], sides["b"]
        if fa is None or fb is None:
            continue
        a_db, b_db = fa.get("sqnr_db"), fb.get("sqnr_db")
        if worse(a_db, b_db) if recovered else worse(b_db, a_db):
            found.append(Crossing(key, name, a_db, b_db, level(a_db), other))
    return found


def summary_json(
    formats: Sequence[str], crossed: list[Crossing], recovered: list[Crossing]
) -> dict[str, Any]:
    """The `formats` part of a diff's JSON: the formats, the thresholds and the crossings."""
    return {
        "names": list(formats),
        "thresholds_db": thresholds(),
        "crossed": [c.to_json() for c in crossed],
        "recovered": [c.to_json() for c in recovered],
    }

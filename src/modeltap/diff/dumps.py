"""Compare two dumps: per-tensor verdicts and errors, the first diverging module, metadata changes.

Tensors are read one pair at a time from the memory-mapped files, so memory stays around the
largest pair whatever the size of the dumps; as numpy arrays where numpy holds the dtype, so that
`modeltap diff` never waits for torch to import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from modeltap.diff.formats import Crossing, crossings, metadata_formats, side_figures, summary_json
from modeltap.diff.keymap import KeyRule, apply_map, op_matches, parse_map, structural_matches
from modeltap.diff.pairs import Pair, _Buffers, compare, failure_message
from modeltap.diff.tolerance import Tolerance
from modeltap.dump import Dump, load_dump
from modeltap.dump.format import INPUTS_PREFIX
from modeltap.errors import DumpFormatError, InputError

REPORT_SCHEMA = "modeltap.diff/1"

# Metadata that, when it differs, usually explains why two runs differ. "warning" ones are said
# at the top of the report; a different format is an error.
_META_LEVELS = {
    "format_version": "error",
    "inputs": "warning",
    "model": "info",
    "revision": "info",
    "model_class": "info",
    "dtype": "info",
    "device": "info",
    "torch": "info",
    "transformers": "info",
    "modeltap_version": "info",
    "seed": "info",
    "train_mode": "info",
    "selection": "info",
}


@dataclass
class MetaChange:
    key: str
    a: str | None
    b: str | None
    level: str
    # For a JSON field (`inputs`, `selection`): which of its settings differ, e.g.
    # `resample 2 vs 3`; empty for a plain value
    detail: str = ""

    def describe(self) -> str:
        """`what differs: A vs B`, by setting where the field is JSON."""
        return self.detail or f"{self.a} vs {self.b}"


@dataclass
class DiffReport:
    a: Path
    b: Path
    tolerance: Tolerance
    pairs: list[Pair]
    only_a: list[str]
    only_b: list[str]
    metadata: list[MetaChange]
    ordered: bool
    strict: bool = False
    # (A's key, B's key, "mapped" or "structural") for every key paired other than by its name,
    # aliases included (their pair is listed once, under the first key)
    matches: list[tuple[str, str, str]] = field(default_factory=list)
    # op key -> the source line that called it (`dump --ops`), A's ops then B's
    sources: dict[str, str] = field(default_factory=dict)
    # the formats either dump measured with --formats (each pair's `formats` holds both sides)
    formats: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[Pair]:
        return [p for p in self.pairs if not p.ok]

    @property
    def inputs_differ(self) -> list[Pair]:
        """Processed inputs (`inputs/...`, from images or audio) out of tolerance: the numbers
        changed before layer 0, in the preprocessing, and every module downstream follows."""
        return [p for p in self.failed if p.key.startswith(INPUTS_PREFIX)]

    @property
    def first_divergence(self) -> Pair | None:
        """The earliest module out of tolerance in execution order (None without a recorded
        order); differing inputs are reported apart, by `inputs_differ`."""
        failed = [p for p in self.failed if not p.key.startswith(INPUTS_PREFIX)]
        return failed[0] if failed and self.ordered else None

    def matched(self, how: str) -> list[tuple[str, str]]:
        """(A's key, B's key) of the keys paired `how`: "mapped" or "structural"."""
        return [(a, b) for a, b, kind in self.matches if kind == how]

    @property
    def passed(self) -> bool:
        return not self.failed and not (self.strict and (self.only_a or self.only_b))

    def crossings(self, *, recovered: bool = False) -> list[Crossing]:
        """The keys whose SQNR in a format is below a threshold in A (the candidate) that B's is
        above (above one B's is below: `recovered`), in A's order (diff/formats.py)."""
        return [
            c
            for p in self.pairs
            for c in crossings(
                p.key, p.formats, other=p.other if p.other != p.key else None, recovered=recovered
            )
        ]

    def to_json(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "schema": REPORT_SCHEMA,
            "a": str(self.a),
            "b": str(self.b),
            "passed": self.passed,
            "inputs_differ": [p.key for p in self.inputs_differ],
            "strict": self.strict,
            "tolerance": asdict(self.tolerance),
            "ordered": self.ordered,
            "first_divergence": first.key if first else None,
            "first_divergence_source": self.sources.get(first.key) if first else None,
            "counts": {
                "compared": len(self.pairs),
                "failed": len(self.failed),
                "only_a": len(self.only_a),
                "only_b": len(self.only_b),
                "mapped": len(self.matched("mapped")),
                "structural": len(self.matched("structural")),
            },
            "metadata": [asdict(m) for m in self.metadata],
            "pairs": [p.to_json() for p in self.pairs],
            "matches": [{"key": a, "other": b, "match": how} for a, b, how in self.matches],
            "only_a": self.only_a,
            "only_b": self.only_b,
            **({"formats": self._formats_json()} if self.formats else {}),
        }

    def _formats_json(self) -> dict[str, Any]:
        return summary_json(self.formats, self.crossings(), self.crossings(recovered=True))


def _selected(key: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    return (not include or any(fnmatchcase(key, p) for p in include)) and not any(
        fnmatchcase(key, p) for p in exclude
    )


def _meta_changes(a: Dump, b: Dump) -> list[MetaChange]:
    changes = []
    if not (a.is_modeltap and b.is_modeltap):
        return changes
    for key, level in _META_LEVELS.items():
        va, vb = a.metadata.get(key), b.metadata.get(key)
        if va != vb:
            changes.append(MetaChange(key, va, vb, level, _settings_changed(va, vb)))
    return changes


_ABSENT = object()


def _settings_changed(a: str | None, b: str | None, shown: int = 4) -> str:
    """Which settings of two JSON objects differ (nested ones dotted), `name A vs B` each; a
    processor's own settings speak for its hash. Empty when either is not a JSON object."""

    def flat(text: str | None) -> dict[str, Any] | None:
        try:
            value = json.loads(text) if text else None
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        out: dict[str, Any] = {}

        def walk(item: Any, path: str) -> None:
            if isinstance(item, dict) and item:
                for key, inner in item.items():
                    walk(inner, f"{path}.{key}" if path else str(key))
            else:
                out[path] = item

        walk(value, "")
        return out

    fa, fb = flat(a), flat(b)
    if fa is None or fb is None:
        return ""
    names = list(dict.fromkeys([*fa, *fb]))
    changed = [n for n in names if fa.get(n, _ABSENT) != fb.get(n, _ABSENT)]
    settings = "processor_settings."
    if any(n.startswith(settings) for n in changed):
        changed = [n for n in changed if n != "processor_sha256"]
    elif "processor_sha256" in changed:
        changed.remove("processor_sha256")
        changed.insert(0, "processor settings (their sha256; this dump keeps no settings)")

    def value(side: dict[str, Any], name: str) -> str:
        item = side.get(name, _ABSENT)
        text = "absent" if item is _ABSENT else json.dumps(item)
        return text if len(text) <= 40 else text[:39] + "…"

    parts = [
        n if n not in fa and n not in fb else f"{n.removeprefix(settings)} "
        f"{value(fa, n)} vs {value(fb, n)}"
        for n in changed[:shown]
    ]
    if len(changed) > shown:
        parts.append(f"{len(changed) - shown} more")
    return "; ".join(parts)


def diff_dumps(
    a: str | os.PathLike[str] | Dump,
    b: str | os.PathLike[str] | Dump,
    *,
    tolerance: Tolerance | None = None,
    overrides: Sequence[tuple[str, Tolerance]] = (),
    rename: Sequence[str] = (),
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    equal_nan: bool = False,
    upcast: bool = False,
    strict: bool = False,
    structural: bool = True,
) -> DiffReport:
    """Compare every tensor of `a` with its match in `b` (B is the reference for rtol).

    A key's match is the key of B that `rename` (`parse_map` rules) makes of it; with
    `structural`, keys still unmatched are paired across an output structure that differs
    (`structural_matches`). `overrides` are (glob, Tolerance) pairs on A's keys; the first match
    wins over `tolerance`.
    """
    da, db, changes = _open(a, b)
    tolerance = tolerance or Tolerance()
    keys_a = [k for k in da.keys() if _selected(k, include, exclude)]
    partner = _partners(da, db, keys_a, parse_map(rename), structural=structural)
    matched_b = {other for other, _ in partner.values()}
    only_a = [k for k in keys_a if k not in partner]
    only_b = [k for k in db.keys() if k not in matched_b and _selected(k, include, exclude)]

    formats = metadata_formats(da.metadata, db.metadata)
    pairs: list[Pair] = []
    done: dict[tuple[str, str], Pair] = {}
    buffers = _Buffers()
    for key in keys_a:
        if key not in partner:
            continue
        other, how = partner[key]
        stored = (da.resolve(key), db.resolve(other))
        if stored in done:  # an alias on both sides: the same comparison, said once
            done[stored].aliases.append(key)
            continue
        tol = next((t for glob, t in overrides if fnmatchcase(key, glob)), tolerance)
        norms = (_norm(da, key), _norm(db, other))
        x, y, dtypes = _values(da, db, key, other)
        pair = compare(
            key,
            other,
            x,
            y,
            tol,
            equal_nan=equal_nan,
            upcast=upcast,
            norms=norms,
            buffers=buffers,
            dtypes=dtypes,
        )
        pair.match = how
        if formats:
            pair.formats = side_figures(da.stats_for(key), db.stats_for(other), formats)
        done[stored] = pair
        pairs.append(pair)
    ordered = da.order is not None
    matches = [(k, *partner[k]) for k in keys_a if k in partner and partner[k][1]]
    report = DiffReport(
        da.path, db.path, tolerance, pairs, only_a, only_b, changes, ordered, strict, matches
    )
    report.sources = {**_op_sources(db), **_op_sources(da)}
    report.formats = formats
    return report


def _op_sources(dump: Dump) -> dict[str, str]:
    """Op key -> its source line, from a `dump --ops` dump's `ops` metadata."""
    ops = json.loads(dump.metadata.get("ops", "{}"))
    return {key: op["source"] for key, op in ops.items() if op.get("source")}


def _open(
    a: str | os.PathLike[str] | Dump, b: str | os.PathLike[str] | Dump
) -> tuple[Dump, Dump, list[MetaChange]]:
    """Both dumps, refused where they can't be compared, and their metadata changes."""
    da = a if isinstance(a, Dump) else load_dump(a)
    db = b if isinstance(b, Dump) else load_dump(b)
    for dump in (da, db):
        if dump.stats_only:
            raise InputError(
                f"'{dump.path}' was written with --stats-only and has no tensors to compare; "
                "dump it again without --stats-only"
            )
    changes = _meta_changes(da, db)
    formats = [c for c in changes if c.level == "error"]
    if formats:
        raise DumpFormatError(
            f"the dumps have different format versions ({formats[0].a} vs {formats[0].b}); "
            "re-create the older one with this modeltap"
        )
    return da, db, changes


def _partners(
    da: Dump, db: Dump, keys_a: Sequence[str], rules: Sequence[KeyRule], *, structural: bool
) -> dict[str, tuple[str, str | None]]:
    """A's key -> (B's key, how it was found: None by its name, "mapped", "structural", or
    "op": an op paired by module, position and name across an op inserted or removed)."""
    from modeltap.capture.keys import op_owner

    ops_a = [k for k in keys_a if op_owner(k) is not None]
    ops_b = [k for k in db.keys() if op_owner(k) is not None]
    partner = {k: (m, None if m == k else "op") for k, m in op_matches(ops_a, ops_b).items()}
    op_keys = set(ops_a)
    mapped = {k: apply_map(k, rules) for k in keys_a if k not in op_keys}
    keys_b = set(db.keys()) - set(ops_b)
    partner |= {k: (m, "mapped" if m != k else None) for k, m in mapped.items() if m in keys_b}
    if structural:
        taken = {other for other, _ in partner.values()}
        unmatched_b = [k for k in db.keys() if k not in taken]
        unmatched_a = [k for k in keys_a if k not in partner]
        found = structural_matches(da, db, unmatched_a, unmatched_b, rules)
        partner.update({k: (other, "structural") for k, other in found.items()})
    return partner


def _values(da: Dump, db: Dump, key: str, other: str) -> tuple[Any, Any, tuple[str, str] | None]:
    """The pair's values: numpy arrays (and their stored dtypes) where numpy holds the dtype, so
    no torch is imported; else torch tensors."""
    arrays = (da.array(key), db.array(other))
    if arrays[0] is not None and arrays[1] is not None:
        (x, dtype_x), (y, dtype_y) = arrays
        return x, y, (dtype_x, dtype_y)
    return da[key], db[other], None


def _norm(dump: Dump, key: str) -> float | None:
    stats = dump.stats_for(key)
    return stats.norm if stats is not None and stats.nan == 0 and stats.inf == 0 else None


def junit_xml(
    report: DiffReport, *, name: str = "modeltap diff", notes: dict[str, str] | None = None
) -> str:
    """JUnit XML: one test case per compared tensor (and per missing key), metrics in failures.

    `notes` (by key) are appended to a failure's message, e.g. compare's attribution.
    """
    from xml.etree import ElementTree as ET

    notes = notes or {}
    suite = ET.Element("testsuite", name=name)
    failures = skipped = 0
    for pair in report.pairs:
        case = ET.SubElement(
            suite, "testcase", classname=pair.key.split(":")[0], name=pair.key, time="0"
        )
        if pair.match:  # B's key, and how it was found
            props = ET.SubElement(case, "properties")
            ET.SubElement(props, "property", name="other", value=pair.other)
            ET.SubElement(props, "property", name="match", value=pair.match)
        if not pair.ok:
            failures += 1
            message = failure_message(pair) + (f"; {notes[pair.key]}" if pair.key in notes else "")
            failure = ET.SubElement(case, "failure", message=message, type=pair.status)
            failure.text = json.dumps(pair.to_json(), indent=1)
    for side, keys in (("only in A", report.only_a), ("only in B", report.only_b)):
        for key in keys:
            case = ET.SubElement(suite, "testcase", classname=key.split(":")[0], name=key, time="0")
            if report.strict:
                failures += 1
                ET.SubElement(
                    case, "failure", message=f"{side} ({report.a} vs {report.b})", type="missing"
                )
            else:
                skipped += 1
                ET.SubElement(case, "skipped", message=side)
    suite.set("tests", str(len(suite)))
    suite.set("failures", str(failures))
    suite.set("errors", "0")
    suite.set("skipped", str(skipped))
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)

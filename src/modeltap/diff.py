"""Compare two dumps: per-tensor verdicts and errors, the first diverging module, metadata changes.

Tensors are read one pair at a time from the memory-mapped files, so memory stays around the
largest pair whatever the size of the dumps; as numpy arrays where numpy holds the dtype, so that
`modeltap diff` never waits for torch to import.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

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


@dataclass
class Pair:
    """The comparison of one tensor of A with its match in B."""

    key: str
    other: str
    status: str  # ok | differs | shape | dtype
    shape: list[int]
    dtype: str
    other_shape: list[int] | None = None
    other_dtype: str | None = None
    atol: float = 0.0
    rtol: float = 0.0
    max_abs: float | None = None
    mean_abs: float | None = None
    max_rel: float | None = None
    mean_rel: float | None = None
    cosine: float | None = None
    out_fraction: float | None = None
    out_count: int | None = None
    numel: int = 0
    nan_mismatch: int = 0
    aliases: list[str] = field(default_factory=list)
    # max |a - b| / max |b|: the error on the tensor's own scale, comparable across modules
    max_scaled: float | None = None
    # max over elements of |a - b| / (atol + scaled_atol * max|b| + rtol * |b|): the elementwise
    # rule's margin, above 1 out of tolerance (inf where a NaN or Inf does not match)
    of_limit: float | None = None
    # how `other` was found when it is not `key` itself: "mapped" (--map) or "structural" (the
    # same module's output, named parts on one side and positional ones on the other)
    match: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v != []}


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
        }


@dataclass(frozen=True)
class KeyRule:
    """One rename of A's names to B's: `*` in `old` feeds the matching `*` in `new`. A module
    rule also renames everything under the module: its calls, output parts and children."""

    pattern: re.Pattern[str]
    new: str
    module: bool = False

    def apply(self, key: str) -> str | None:
        match = self.pattern.match(key)
        if match is None:
            return None
        groups = match.groups()
        stars = groups[:-1] if self.module else groups
        pieces = self.new.split("*")
        filled = zip(stars, pieces[1:], strict=False)
        renamed = pieces[0] + "".join(group + piece for group, piece in filled)
        return renamed + groups[-1] if self.module else renamed


def _rule(old: str, new: str, where: str, *, module: bool = False) -> KeyRule:
    if not old:
        raise InputError(f"{where}: an empty name can't be renamed")
    if new.count("*") > old.count("*"):
        raise InputError(f"{where}: '{new}' has more '*' than '{old}'")
    star = "([^.:@]*)" if module else "(.*)"  # a module's `*` stays inside one dotted name
    body = "".join(star if c == "*" else re.escape(c) for c in old)
    tail = r"((?:[.@:].*)?)\Z" if module else r"\Z"
    return KeyRule(re.compile(body + tail), new, module)


MAP_SECTIONS = ("keys", "modules")


def read_map_file(path: Path) -> list[KeyRule]:
    """A mapping file, TOML or JSON (by suffix): `[keys]` renames keys (exact or `*` globs),
    `[modules]` renames modules with all their keys; keys rules first, each table in file order."""
    where = f"--map file '{path}'"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"can't read {where} ({exc.strerror}); check the path") from exc
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            from modeltap.config import tomllib

            data = tomllib.loads(text)
    except ValueError as exc:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
        raise InputError(f"{where} is not valid {kind} ({exc}); fix it") from exc
    example = 'e.g. [modules] "bert" = "model"'
    if not isinstance(data, dict) or not data or not set(data) <= set(MAP_SECTIONS):
        raise InputError(f"{where} holds tables [keys] and/or [modules] only; {example}")
    rules = []
    for section in MAP_SECTIONS:
        table = data.get(section, {})
        if not isinstance(table, dict) or not all(
            isinstance(v, str) for v in table.values()
        ):
            raise InputError(f"{where}: [{section}] maps names to names (strings); {example}")
        for old, new in table.items():
            rules.append(_rule(old, new, f"{where} [{section}]", module=section == "modules"))
    return rules


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a rule too long for a file name
        return False


def parse_map(rules: Sequence[str]) -> list[KeyRule]:
    """Each entry is `OLD=NEW` (`bert.*=*`: each `*` of OLD feeds the matching `*` of NEW) or a
    mapping file (`read_map_file`); the first rule that matches a name wins."""
    parsed: list[KeyRule] = []
    for rule in rules:
        old, sep, new = rule.partition("=")
        path = Path(rule)
        if path.suffix.lower() in (".toml", ".json") or _is_file(path):
            if not _is_file(path):
                raise InputError(f"no --map file '{rule}'; check the path")
            parsed.extend(read_map_file(path))
            continue
        if not sep or not old:
            raise InputError(
                f"--map '{rule}' is neither OLD=NEW nor a mapping file; e.g. --map 'bert.*=*'"
            )
        parsed.append(_rule(old, new, f"--map '{rule}'"))
    return parsed


def apply_map(key: str, rules: Sequence[KeyRule]) -> str:
    for rule in rules:
        renamed = rule.apply(key)
        if renamed is not None:
            return renamed
    return key


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
    da = a if isinstance(a, Dump) else load_dump(a)
    db = b if isinstance(b, Dump) else load_dump(b)
    for dump in (da, db):
        if dump.stats_only:
            raise InputError(
                f"'{dump.path}' was written with --stats-only and has no tensors to compare; "
                "dump it again without --stats-only"
            )
    tolerance = tolerance or Tolerance()
    changes = _meta_changes(da, db)
    formats = [c for c in changes if c.level == "error"]
    if formats:
        raise DumpFormatError(
            f"the dumps have different format versions ({formats[0].a} vs {formats[0].b}); "
            "re-create the older one with this modeltap"
        )
    rules = parse_map(rename)

    keys_a = [k for k in da.keys() if _selected(k, include, exclude)]
    mapped = {k: apply_map(k, rules) for k in keys_a}
    keys_b = set(db.keys())
    partner = {k: (m, "mapped" if m != k else None) for k, m in mapped.items() if m in keys_b}
    if structural:
        taken = {other for other, _ in partner.values()}
        unmatched_b = [k for k in db.keys() if k not in taken]
        unmatched_a = [k for k in keys_a if k not in partner]
        found = structural_matches(da, db, unmatched_a, unmatched_b, rules)
        partner.update({k: (other, "structural") for k, other in found.items()})
    matched_b = {other for other, _ in partner.values()}
    only_a = [k for k in keys_a if k not in partner]
    only_b = [k for k in db.keys() if k not in matched_b and _selected(k, include, exclude)]

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
        arrays = (da.array(key), db.array(other))
        if arrays[0] is not None and arrays[1] is not None:  # numpy: no torch to import
            (x, dtype_x), (y, dtype_y) = arrays
            dtypes: tuple[str, str] | None = (dtype_x, dtype_y)
        else:
            x, y, dtypes = da[key], db[other], None
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
        done[stored] = pair
        pairs.append(pair)
    ordered = da.order is not None
    matches = [(k, *partner[k]) for k in keys_a if k in partner and partner[k][1]]
    return DiffReport(
        da.path, db.path, tolerance, pairs, only_a, only_b, changes, ordered, strict, matches
    )


_POSITIONAL = re.compile(r"\d+(?:\.\d+)*\Z")


def _positional(part: str) -> bool:
    """A bare key or a part made of tuple indices: an output known by position, not by name."""
    return not part or bool(_POSITIONAL.match(part))


def _in_output_order(dump: Dump, parts: list[tuple[str, str]]) -> tuple[bool, list[str]] | None:
    """(positional?, the keys in the order of the module's output) of one module call's
    (part, key) pairs; None when that order is unknown (names of a dump without a recorded
    order are sorted as in the file)."""
    if all(_positional(part) for part, _ in parts):
        ordered = sorted(parts, key=lambda p: [int(i) for i in p[0].split(".") if i])
        return True, [key for _, key in ordered]
    if dump.order is None and len(parts) > 1:
        return None
    return False, [key for _, key in parts]


def structural_matches(
    a: Dump, b: Dump, keys_a: Sequence[str], keys_b: Sequence[str], rules: Sequence[KeyRule] = ()
) -> dict[str, str]:
    """Pairs of keys (A's to B's) for one module's output kept by name on one side and by
    position on the other: a traced graph returns a ModelOutput as a tuple (`:last_hidden_state`
    against `:0`), or a (tensor, None) pair as the bare tensor (`:0` against the bare key).

    Per module call (after `rules`), the unmatched parts of both sides pair in order when they are
    as many, one side is positional (bare or tuple indices, taken in index order; named parts in
    the order the output held them, which only a dump's recorded order tells: without it, a
    named side pairs only a single part) and every pair has the same shape; otherwise none do.
    Two sides both named differently are a rename, for --map.
    """
    from modeltap.capture.keys import split_key

    def by_call(keys: Sequence[str], rename: bool) -> dict[tuple[str, int], list[tuple[str, str]]]:
        groups: dict[tuple[str, int], list[tuple[str, str]]] = {}
        for key in keys:
            module, call, part = split_key(apply_map(key, rules) if rename else key)
            groups.setdefault((module, call), []).append((part, key))
        return groups

    groups_b = by_call(keys_b, False)
    found: dict[str, str] = {}
    for where, parts_a in by_call(keys_a, True).items():
        parts_b = groups_b.get(where, [])
        if not parts_b or len(parts_a) != len(parts_b):
            continue
        side_a, side_b = _in_output_order(a, parts_a), _in_output_order(b, parts_b)
        if side_a is None or side_b is None:
            continue
        (pos_a, ordered_a), (pos_b, ordered_b) = side_a, side_b
        if not (pos_a or pos_b):
            continue
        pairs = list(zip(ordered_a, ordered_b, strict=True))
        if all(a.shape(x) is not None and a.shape(x) == b.shape(y) for x, y in pairs):
            found.update(pairs)
    return found


class _Buffers:
    """Work buffers reused from pair to pair: fresh temporaries per tensor cost more in page
    faults than the arithmetic on them."""

    def __init__(self) -> None:
        self._store: dict[tuple[Any, str], Any] = {}

    def get(self, ops: _Ops, like: Any, name: str, dtype: Any) -> Any:
        held = self._store.get((dtype, name))
        size = ops.numel(like)
        if held is None or ops.numel(held) < size or not ops.same_device(held, like):
            held = ops.empty(size, dtype, like)
            self._store[(dtype, name)] = held
        return held[:size].reshape(like.shape)


class _Ops:
    """What differs between numpy and torch in `compare`; everything else has the same name in
    both (`abs`, `subtract`, `count_nonzero`, `isclose`, `float32`...), so the metrics are one
    code for tensors in memory and for arrays read from dumps without torch."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp
        self.numpy = xp.__name__ == "numpy"
        self.boolean = xp.bool_ if self.numpy else xp.bool

    def numel(self, x: Any) -> int:
        return int(x.size) if self.numpy else x.numel()

    def cast(self, x: Any, dtype: Any) -> Any:
        return x.astype(dtype, copy=False) if self.numpy else x.to(dtype)

    def empty(self, size: int, dtype: Any, like: Any) -> Any:
        if self.numpy:
            return self.xp.empty(size, dtype=dtype)
        return self.xp.empty(size, dtype=dtype, device=like.device)

    def same_device(self, a: Any, b: Any) -> bool:
        return self.numpy or a.device == b.device

    def equal(self, a: Any, value: float, out: Any) -> Any:
        return self.xp.equal(a, value, out=out) if self.numpy else self.xp.eq(a, value, out=out)

    def zero_where(self, x: Any, mask: Any) -> None:
        if self.numpy:
            self.xp.putmask(x, mask, 0)
        else:
            x.masked_fill_(mask, 0)

    def norm(self, x: Any) -> float:
        """The L2 norm, accumulated in float64."""
        if self.numpy:
            flat = x.reshape(-1)
            wide = flat.astype(self.xp.complex128 if flat.dtype.kind == "c" else self.xp.float64)
            return float(self.xp.sqrt(self.xp.vdot(wide, wide).real))
        wide = self.xp.complex128 if x.is_complex() else self.xp.float64
        return float(self.xp.linalg.vector_norm(x, dtype=wide))

    def is_float(self, x: Any) -> bool:
        return x.dtype.kind == "f" if self.numpy else x.is_floating_point()

    def equal_all(self, a: Any, b: Any) -> bool:
        return bool(self.xp.array_equal(a, b)) if self.numpy else self.xp.equal(a, b)

    def extremes(self, x: Any) -> tuple[float, float]:
        if self.numpy:
            return float(x.min()), float(x.max())
        low, high = self.xp.aminmax(x)
        return float(low), float(high)

    def is_complex(self, x: Any) -> bool:
        return bool(self.xp.iscomplexobj(x)) if self.numpy else x.is_complex()

    def quiet(self) -> Any:
        """numpy warns where torch is silent (x / 0 is inf or nan in both)."""
        import contextlib

        return self.xp.errstate(all="ignore") if self.numpy else contextlib.nullcontext()


def _ops(x: Any) -> _Ops:
    if type(x).__module__ == "numpy":
        import numpy

        return _Ops(numpy)
    import torch

    return _Ops(torch)


# Float dtypes whose every value float32 holds exactly: a pair of them is compared in float32.
_FLOAT32_EXACT = {"bfloat16", "float16", "float32"}


def compare(
    key: str,
    other: str,
    a: Any,
    b: Any,
    tol: Tolerance,
    *,
    equal_nan: bool = False,
    upcast: bool = False,
    norms: tuple[float | None, float | None] = (None, None),
    buffers: _Buffers | None = None,
    dtypes: tuple[str, str] | None = None,
) -> Pair:
    """Errors and the allclose verdict of one pair; B is the reference (rtol scales |b|).

    `a` and `b` are both torch tensors or both numpy arrays (`dtypes` then names the stored
    dtypes, where an array was widened from bfloat16). `norms` are the L2 norms of a and b when
    already known (a dump's statistics), for the cosine.
    """
    from modeltap.stats import dtype_name

    ops = _ops(a)
    xp = ops.xp
    dtype_a, dtype_b = dtypes or (dtype_name(a.dtype), dtype_name(b.dtype))
    pair = Pair(key, other, "ok", list(a.shape), dtype_a, atol=tol.atol, rtol=tol.rtol)
    atol = tol.atol
    pair.numel = ops.numel(a)
    if tuple(a.shape) != tuple(b.shape):
        pair.status, pair.other_shape = "shape", list(b.shape)
        return pair
    if dtype_a != dtype_b:
        pair.other_dtype = dtype_b
        if not upcast:
            pair.status = "dtype"
            return pair
    if pair.numel == 0:
        return pair
    if dtype_a == dtype_b and ops.is_float(a) and _identical(pair, ops, a, b, tol, norms):
        return pair
    if ops.is_complex(a) or ops.is_complex(b):
        work = xp.complex128
    elif (dtype_a == dtype_b and dtype_a != "float64") or {dtype_a, dtype_b} <= _FLOAT32_EXACT:
        work = xp.float32  # a bfloat16 or float16 against a float32: each value exact there
    else:
        work = xp.float64
    x, y = ops.cast(a, work), ops.cast(b, work)
    buf = buffers or _Buffers()
    real = xp.float64 if work == xp.complex128 else work
    with ops.quiet():
        _metrics(pair, ops, x, y, tol, atol, real, buf, equal_nan, norms)
    pair.out_fraction = pair.out_count / pair.numel
    low_cosine = (
        tol.min_cosine is not None and pair.cosine is not None and pair.cosine < tol.min_cosine
    )
    if pair.out_count or low_cosine:
        pair.status = "differs"
    return pair


def _metrics(
    pair: Pair,
    ops: _Ops,
    x: Any,
    y: Any,
    tol: Tolerance,
    atol: float,
    real: Any,
    buf: _Buffers,
    equal_nan: bool,
    norms: tuple[float | None, float | None],
) -> None:
    """Fill `pair`'s errors and out-of-tolerance count (x, y already in the working dtype)."""
    xp = ops.xp
    diff = buf.get(ops, x, "diff", real)
    if real == x.dtype:
        xp.abs(xp.subtract(x, y, out=diff), out=diff)
    else:  # complex: |x - y| is real
        xp.abs(x - y, out=diff)
    scale = buf.get(ops, y, "scale", real)
    xp.abs(y, out=scale)
    total = float(diff.sum())
    if math.isfinite(total):
        absmax = float(scale.max())
        atol += tol.scaled_atol * absmax
        limit = buf.get(ops, y, "limit", real)
        xp.multiply(scale, tol.rtol, out=limit)
        xp.add(limit, atol, out=limit)
        out = buf.get(ops, x, "out", ops.boolean)
        pair.out_count = int(xp.count_nonzero(xp.greater(diff, limit, out=out)))
        pair.of_limit = _of_limit(ops, xp.divide(diff, limit, out=limit), pair.out_count)
        pair.max_abs = float(diff.max())
        pair.max_scaled = pair.max_abs / absmax if absmax else (0.0 if not pair.max_abs else None)
        pair.mean_abs = total / pair.numel
        flat = diff.reshape(-1)
        squared = float(xp.dot(flat, flat))
        pair.cosine = _cosine(ops, x, y, squared, norms)
        rel = xp.divide(diff, scale, out=limit)
        zeros = int(pair.numel - xp.count_nonzero(scale))
        if zeros:  # relative error is over positions where b != 0
            ops.zero_where(rel, ops.equal(scale, 0, out=out))
        if pair.numel > zeros:
            pair.max_rel = float(rel.max())
            pair.mean_rel = float(rel.sum()) / (pair.numel - zeros)
    else:
        # NaN or Inf somewhere: torch.isclose's semantics, metrics over positions finite on both.
        if tol.scaled_atol:
            finite_y = y[xp.isfinite(y)]
            atol += tol.scaled_atol * (float(abs(finite_y).max()) if ops.numel(finite_y) else 0.0)
        close = xp.isclose(x, y, rtol=tol.rtol, atol=atol, equal_nan=equal_nan)
        pair.out_count = int(xp.count_nonzero(~close))
        nan_x, nan_y = xp.isnan(x), xp.isnan(y)
        mismatch = nan_x ^ nan_y
        if not equal_nan:
            mismatch |= nan_x & nan_y
        pair.nan_mismatch = int(mismatch.sum())
        usable = xp.isfinite(x) & xp.isfinite(y)
        d, sc = ops.cast(diff[usable], xp.float64), ops.cast(scale[usable], xp.float64)
        finite_out = int(xp.count_nonzero(d > atol + tol.rtol * sc))
        if pair.out_count > finite_out:  # a NaN or Inf where the other side has none
            pair.of_limit = math.inf
        elif ops.numel(d):
            pair.of_limit = _of_limit(ops, d / (atol + tol.rtol * sc), pair.out_count)
        if ops.numel(d):
            pair.max_abs = float(d.max())
            pair.mean_abs = float(d.mean())
            nonzero = sc > 0
            if bool(nonzero.any()):
                rel = d[nonzero] / sc[nonzero]
                pair.max_rel, pair.mean_rel = float(rel.max()), float(rel.mean())
    pair.atol = atol  # the absolute tolerance in effect, scale-relative term included


def _of_limit(ops: _Ops, ratio: Any, out_count: int) -> float:
    """The largest |a - b| / limit; 0 / 0 (equal where the limit is 0: atol = 0) counts 0."""
    value = float(ratio.max())
    if math.isnan(value):
        value = float(ops.xp.nan_to_num(ratio, nan=0.0, posinf=math.inf).max())
    return value if value <= 1 or out_count else 1.0  # rounding at the limit: still within


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


def _identical(
    pair: Pair, ops: _Ops, a: Any, b: Any, tol: Tolerance, norms: tuple[Any, Any]
) -> bool:
    """Fill `pair` for two equal tensors with finite values (what the passes in `_metrics` would
    find, without them: most pairs of a same-dtype comparison are equal); False when not equal."""
    if not ops.equal_all(a, b):
        return False
    low, high = ops.extremes(b)
    if not (math.isfinite(low) and math.isfinite(high)):
        return False
    absmax = max(-low, high)
    pair.atol = tol.atol + tol.scaled_atol * absmax
    pair.out_count, pair.out_fraction = 0, 0.0
    pair.max_abs = pair.mean_abs = pair.max_scaled = pair.of_limit = 0.0
    if absmax:  # relative error is over positions where b != 0
        pair.max_rel = pair.mean_rel = 0.0
    known = [n for n in norms if n is not None]
    pair.cosine = _cosine(ops, a, b, 0.0, norms) if len(known) == 2 else 1.0
    return True


def _cosine(
    ops: _Ops, x: Any, y: Any, diff_squared: float, norms: tuple[float | None, float | None]
) -> float:
    """Cosine similarity from squared norms, |a-b|^2 = |a|^2 + |b|^2 - 2 a.b: no extra product
    pass, and the norms often come free from the dumps' statistics."""
    nx, ny = (n if n is not None else ops.norm(t) for n, t in zip(norms, (x, y), strict=True))
    if nx == 0 or ny == 0:
        return 1.0 if nx == ny else 0.0
    return max(-1.0, min(1.0, (nx * nx + ny * ny - diff_squared) / (2 * nx * ny)))


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


def failure_message(pair: Pair) -> str:
    if pair.status == "shape":
        return f"shape {pair.shape} vs {pair.other_shape}"
    if pair.status == "dtype":
        return f"dtype {pair.dtype} vs {pair.other_dtype} (--upcast compares them anyway)"
    parts = [
        f"{pair.out_count} of {pair.numel} elements out of tolerance "
        f"(atol={pair.atol:g}, rtol={pair.rtol:g})"
    ]
    if pair.max_abs is None:
        parts.append("no position is finite on both sides")
    else:
        parts.append(f"max abs {pair.max_abs:.3g}")
        if pair.max_rel is not None:
            parts.append(f"max rel {pair.max_rel:.3g}")
        if pair.cosine is not None:
            parts.append(f"cosine {pair.cosine:.9f}")
    note = nan_note(pair)
    return "; ".join(parts) + (f"; {note}" if note else "")


def nan_note(pair: Pair) -> str:
    """What NaN did to a pair, with the option that changes it ('' when NaN played no part)."""
    if not pair.nan_mismatch:
        return ""
    return f"{pair.nan_mismatch} NaN mismatches (--equal-nan counts NaN == NaN as equal)"

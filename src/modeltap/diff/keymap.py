"""Which key of B a key of A is compared with: renames (`--map` rules and files) and the
structural matches of one module's output kept by name on one side and by position on the other;
`sides` splits two lists of steps (or keys) into those in both and those on one side only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from modeltap.dump import Dump
from modeltap.errors import InputError

K = TypeVar("K", bound=Hashable)


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


def op_matches(keys_a: Sequence[str], keys_b: Sequence[str]) -> dict[str, str]:
    """Pairs of op keys (`dump --ops`: `m/op07.softmax`), A's to B's, by module call, position
    and op name: each module call's ops aligned as two sequences of names (difflib's longest
    matching blocks), so an op inserted or removed on one side shifts the numbers after it
    without unpairing them, and is left on its side alone."""
    from difflib import SequenceMatcher

    from modeltap.capture.keys import op_owner

    def by_owner(keys: Sequence[str]) -> dict[str, list[tuple[str, str]]]:
        groups: dict[str, list[tuple[str, str]]] = {}
        for key in keys:
            owner = op_owner(key)
            if owner is not None:  # the name after `opNN.`, with its `:part`
                name = key[len(owner) + 1 :].partition(".")[2]
                groups.setdefault(owner, []).append((name, key))
        return groups

    groups_b = by_owner(keys_b)
    found: dict[str, str] = {}
    for owner, ops_a in by_owner(keys_a).items():
        ops_b = groups_b.get(owner, [])
        names_a, names_b = [n for n, _ in ops_a], [n for n, _ in ops_b]
        matcher = SequenceMatcher(None, names_a, names_b, autojunk=False)
        for i, j, size in matcher.get_matching_blocks():
            found.update((ops_a[i + k][1], ops_b[j + k][1]) for k in range(size))
    return found


def sides(a: Sequence[K], b: Sequence[K]) -> tuple[list[K], list[K], list[K]]:
    """(in both, in A only, in B only), each in its side's order: the steps (or keys) two diffs
    pair by name."""
    set_a, set_b = set(a), set(b)
    return (
        [k for k in a if k in set_b],
        [k for k in a if k not in set_b],
        [k for k in b if k not in set_a],
    )

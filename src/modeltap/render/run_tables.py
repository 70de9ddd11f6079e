"""The tables of a run folder recorded with modeltap.record (`modeltap show DIR`) and of two
runs compared (`modeltap diff DIR DIR`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.text import Text

from modeltap.capture import split_key
from modeltap.dump import GRAD_PREFIX
from modeltap.render.tree import _aligned, _fit, _module_tree, _walk, fmt

if TYPE_CHECKING:
    from modeltap.diff.runs import RunDiff
    from modeltap.record.index import RankIndex, RunIndex

SPARKS = "▁▂▃▄▅▆▇█"
# Points in a trend: longer runs show evenly spaced recorded steps.
TREND_POINTS = 24


def sparkline(values: Sequence[float | None]) -> str:
    """One character per value on a log scale; `!` for NaN/Inf, space for a missing value."""
    logs = [math.log10(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    lo, hi = (min(logs), max(logs)) if logs else (0.0, 0.0)
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        elif not math.isfinite(v):
            out.append("!")
        elif v <= 0:
            out.append(SPARKS[0])
        else:
            level = 0 if hi == lo else (math.log10(v) - lo) / (hi - lo)
            out.append(SPARKS[min(len(SPARKS) - 1, int(level * len(SPARKS)))])
    return "".join(out)


def _trend_steps(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if len(steps) <= TREND_POINTS:
        return steps
    picks = {round(i * (len(steps) - 1) / (TREND_POINTS - 1)) for i in range(TREND_POINTS)}
    return [s for i, s in enumerate(steps) if i in picks]


def _series(steps: list[dict[str, Any]], key: str, field_: str = "norm") -> list[float | None]:
    out: list[float | None] = []
    for s in steps:
        entry = s["keys"].get(key)
        if entry is None:
            target = s.get("aliases", {}).get(key)
            entry = s["keys"].get(target) if target else None
        if entry is None:
            out.append(None)
        elif entry.get("nonfinite") and field_ == "norm":
            out.append(math.nan)
        else:
            out.append(entry.get(field_))
    return out


def run_heading(run: RunIndex, rank: int) -> Text:
    """What was recorded: ranks, settings, steps, rule hits and tripwire events."""
    index = run.ranks[rank]
    start = index.start
    steps = [s["step"] for s in index.steps]
    text = Text()
    text.append(str(run.folder), style="bold")
    text.append(
        f"  rank {rank} of {start.get('world_size', '?')} ({start.get('backend', '?')})"
        f", ranks with an index: {', '.join(map(str, run.ranks))}\n"
    )
    text.append(f"{len(steps)} recorded steps", style="bold")
    if steps:
        text.append(f" ({steps[0]}..{steps[-1]}, every {start.get('every', '?')})")
    if index.skipped:
        shown = ", ".join(map(str, index.skipped[:10]))
        more = " ..." if len(index.skipped) > 10 else ""
        # a GradScaler's skipped steps, and steps whose inf/NaN gradients no optimizer step took
        text.append(f"\nskipped (inf/NaN gradients, no optimizer step): steps {shown}{more}")
    if index.evals:
        text.append(f"\n{len(index.evals)} evaluations recorded (eval*.safetensors), after steps ")
        text.append(", ".join(str(e["step"]) for e in index.evals[:10]))
        text.append(" ..." if len(index.evals) > 10 else "")
    hits = [h for s in index.steps for h in s.get("hits", [])]
    if hits:
        counts: dict[str, int] = {}
        for h in hits:
            counts[h["rule"]] = counts.get(h["rule"], 0) + 1
        text.append(", rule hits: ")
        text.append(", ".join(f"{n} {r}" for r, n in counts.items()), style="yellow")
    for trip in index.trips:
        text.append("\ntripwire: ", style="bold red")
        if trip.get("unreproduced"):  # a lazily checked step that its re-run didn't trip
            text.append(f"step {trip['step']} {trip['phase']}: {trip['unreproduced']}", "red")
            continue
        text.append(
            f"step {trip['step']} {trip['phase']}: module '{trip['module']}' "
            f"({trip['module_class']}), tensor {trip['key']}"
            + (" (propagated)" if trip.get("propagated") else "")
            + (f"; full dump {trip['file']}" if trip.get("file") else ""),
            style="red",
        )
    for other, trips in ((r, i.trips) for r, i in run.ranks.items() if r != rank):
        if not trips:
            continue
        first = trips[0]
        where = f", module '{first['module']}'" if first.get("module") else ""
        more = f" (and {len(trips) - 1} more)" if len(trips) > 1 else ""
        text.append(f"\nrank {other} tripped: ", style="bold red")
        text.append(f"step {first['step']} {first['phase']}{where}{more}", style="red")
        text.append(f" (show --rank {other} shows it)")
    return text


def run_table(run: RunIndex, rank: int, *, width: int = 80) -> Text:
    """Per module: activation norm and gradient norm over the recorded steps, last dead share,
    and flags (rule hits, the tripwire). Parameter gradients follow, with update ratios.

    As for `show FILE`, no number is ever cut: the trend columns drop where the numbers would
    not fit (the gradient trend first), and names lose their start, kept apart where two would
    read the same.
    """
    rows, param_rows = _run_rows(run.ranks[rank])
    return _run_layout(rows, param_rows, width)


# A row of `show DIR`'s table: (label, norm trend, last, dead, grad trend, grad last, update,
# flags, style).
_Row = tuple[str, ...]


def _run_rows(index: RankIndex) -> tuple[list[_Row], list[_Row]]:
    """The rows of the module tree, then those of the parameters whose gradients were kept."""
    steps = sorted(index.steps, key=lambda s: s["step"])
    shown = _trend_steps(steps)
    keys: list[str] = []
    for s in steps:
        for k in [*s["keys"], *s.get("aliases", {})]:
            if k not in keys:
                keys.append(k)
    params = {k for s in steps for k in s.get("updates", {})}
    for s in steps:
        order = [k for k in s["keys"] if k.startswith(GRAD_PREFIX)]
        params |= {k[len(GRAD_PREFIX) :] for k in order if k[len(GRAD_PREFIX) :] not in keys}
    flags = _rule_flags(steps)
    trips: dict[str, list[str]] = {}
    for trip in index.trips:
        trips.setdefault(trip["module"], []).append(f"NaN@{trip['step']} {trip['phase']}")
    activations = [k for k in keys if not k.startswith(GRAD_PREFIX)]
    last = steps[-1] if steps else {"keys": {}}
    rows: list[_Row] = []
    for label, key in _walk(_module_tree(activations), None, ""):
        if key is None:
            rows.append((label, "", "", "", "", "", "", "", ""))
            continue
        grads = _series(shown, GRAD_PREFIX + key)
        dead = _series([last], key, "dead")[0]
        flag = ", ".join(trips.get(split_key(key)[0], []) + flags.get(key, []))
        rows.append(
            (
                label,
                sparkline(_series(shown, key)),
                fmt(_series([last], key)[0]),
                "-" if dead is None else f"{dead:.0%}",
                sparkline(grads) if any(g is not None for g in grads) else "",
                fmt(_series([last], GRAD_PREFIX + key)[0]),
                "",
                flag,
                "bold red" if "NaN@" in flag else "",
            )
        )
    param_keys = [k[len(GRAD_PREFIX) :] for k in keys if k[len(GRAD_PREFIX) :] in params]
    param_rows: list[_Row] = []
    for name in param_keys:
        ratio = last.get("updates", {}).get(name)
        param_rows.append(
            (
                name,
                "",
                "",
                "",
                sparkline(_series(shown, GRAD_PREFIX + name)),
                fmt(_series([last], GRAD_PREFIX + name)[0]),
                "" if ratio is None else fmt(ratio),
                ", ".join(flags.get(name, [])),
                "",
            )
        )
    return rows, param_rows


def _rule_flags(steps: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Per key (a gradient's under its tensor's key), the gist of each rule it hit."""
    flags: dict[str, list[str]] = {}
    for s in steps:
        for h in s.get("hits", []):
            key = h["key"].removeprefix(GRAD_PREFIX)
            flag = _FLAGS.get(h["rule"], h["rule"])
            if flag not in flags.setdefault(key, []):
                flags[key].append(flag)
    return flags


def _run_layout(rows: list[_Row], param_rows: list[_Row], width: int) -> Text:
    """The rows laid out in `width`: columns no row fills drop, then the trends where the
    numbers and 32 characters of names would not fit."""
    headers = ["module", "norm", "last", "dead", "grad norm", "last", "update", "flags"]
    justify = ["left", "left", "right", "right", "left", "right", "right", "left"]
    every = rows + param_rows
    widths = [max([len(h)] + [len(r[i]) for r in every]) for i, h in enumerate(headers)]
    keep = [i for i in range(1, len(headers)) if i == 7 or any(r[i] for r in every)]
    # The trends go, the gradient's first, before names are cut below 32 characters.
    for drop in [None, 4, 1]:
        if drop in keep:
            keep.remove(drop)
        room = width - sum(widths[i] + 1 for i in keep)
        if room >= min(widths[0], 32):
            break
    label_width = max(16, min(widths[0], room))
    labels = _fit_apart([r[0] for r in rows], label_width)
    names = _fit_apart([r[0] for r in param_rows], label_width)
    body: list[list[str | Text]] = []
    for label, row in zip(labels, rows, strict=True):
        style = row[8]
        cells: list[str | Text] = [Text(label, style=style)]
        for i in keep:
            cells.append(Text(row[i], style=style or "yellow") if i == 7 else row[i])
        body.append(cells)
    if param_rows:
        body.append([""])
        # The parameters' own header: their gradient trend, its last value, the update ratio.
        grad = "grad norm" if widths[5] >= len("grad norm") else "grad"
        names_of = {4: "grad norm", 5: "last" if 4 in keep else grad, 6: "update"}
        body.append(
            [Text("parameter", style="bold")]
            + [Text(names_of.get(i, ""), style="bold") for i in keep]
        )
    for name, row in zip(names, param_rows, strict=True):
        body.append([name, *(Text(row[i], style="yellow") if i == 7 else row[i] for i in keep)])
    columns = [0, *keep]
    label_column = max([len(headers[0]), *(len(x) for x in [*labels, *names, "parameter"])])
    return _aligned(
        [headers[i] for i in columns],
        [label_column, *(widths[i] for i in keep)],
        [justify[i] for i in columns],
        body,
    )


# The flags column names each rule by its gist (the heading and the index keep the full name).
_FLAGS = {
    "vanishing_gradient": "vanishing",
    "exploding_gradient": "exploding",
    "dead_units": "dead",
    "saturation": "saturated",
    "update_ratio": "update",
    "structural_zero_gradient": "structural",
}


def _fit_apart(labels: list[str], width: int) -> list[str]:
    """`_fit` each label; labels that then read the same are told apart: by the start of their
    names too (`enc…self.key`, `dec…self.key`) where that fits, else by the dotted names where
    they part, kept in the middle (`…layer.1…query.lora_A.default.weight`), so that no row can
    be read as another's."""
    fitted = [_fit(label, width) for label in labels]
    seen: dict[str, list[int]] = {}
    for i, text in enumerate(fitted):
        seen.setdefault(text, []).append(i)
    names = {_name(label) for label in labels}
    for at in seen.values():
        if len({labels[i] for i in at}) < 2:
            continue
        for i in at:
            label = labels[i]
            name = _name(label)
            guides, room = label[: len(label) - len(name)], width - len(label) + len(name)
            rivals = {_name(labels[j]) for j in at} - {name}
            shown = _apart(name, rivals, names - {name}, room)
            if shown is not None:
                fitted[i] = guides + shown
    return fitted


def _name(label: str) -> str:
    return label.lstrip("│├└─ ")


def _apart(name: str, rivals: set[str], others: set[str], room: int) -> str | None:
    """`name` in `room` characters such that none of `others` reads the same: its start and
    end, else its end and, in the middle, the dotted names where it parts from its `rivals`
    (names with the same end); None when neither fits."""
    for head in range(1, room // 2):  # the end, which tells tensors apart, keeps half
        start, end = name[:head], name[len(name) - (room - 1 - head) :]
        if not any(o.startswith(start) and o.endswith(end) for o in others):
            return start + "…" + end
    parts = name.split(".")
    bounds = [0]  # where each dotted name starts
    for part in parts[:-1]:
        bounds.append(bounds[-1] + len(part) + 1)
    # Where the name parts from the rival closest to it: the dotted name there, and the one
    # before it for context (`layer.1`), widened until no other name reads the same.
    split = min(max(_common_prefix(name, r) for r in rivals), len(name) - 1)
    at = max(k for k, b in enumerate(bounds) if b <= split)
    first, last = max(at - 1, 0), at
    while True:
        cut = "…" if first else ""
        middle = ".".join(parts[first : last + 1])
        tail = name[bounds[last] + len(parts[last]) :]
        keep = room - len(cut) - len(middle) - 1
        if keep >= len(tail):  # the middle reaches the end: one cut, at the start
            shown = cut + name[bounds[first] :]
            if len(shown) <= room and not (first and any(o.endswith(shown[1:]) for o in others)):
                return shown
        elif keep > 0:
            raw = tail[len(tail) - keep :]
            whole = raw[raw.find(".") + 1 :]  # the end from a dotted name's start, if unique
            for end in (whole, raw) if whole else (raw,):
                if not any(_reads_as(o, middle, end, cut=bool(first)) for o in others):
                    return cut + middle + "…" + end
        else:
            return None
        if last < len(parts) - 1 and keep < len(tail):
            last += 1
        elif first > 0:
            first -= 1
        else:
            return None


def _reads_as(name: str, middle: str, end: str, *, cut: bool) -> bool:
    """Whether `name` could be shown as `…middle…end` (`middle…end` without `cut`): it ends in
    `end` and holds `middle` as whole dotted names, something left out between the two."""
    if not name.endswith(end):
        return False
    head, wanted = "." + name[: len(name) - len(end)], "." + middle + "."
    at = head.find(wanted) if cut else (0 if head.startswith(wanted) else -1)
    while at >= 0:
        if head[at + len(wanted) :].strip("."):
            return True
        at = head.find(wanted, at + 1) if cut else -1
    return False


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run_diff_text(report: RunDiff, *, show_all: bool = False) -> Text:
    """Two runs: the verdict, the first (step, rank, key) where they part ways, and per step
    (those out of tolerance, or all) how many keys differ and the key nearest its limit (or past
    it the farthest): |a - b| over atol + rtol * |b|, above 1 out of tolerance."""
    text = Text()
    first = report.first
    verdict, style = ("PASS", "bold green") if report.passed else ("FAIL", "bold red")
    text.append(verdict, style=style)
    compared = len({s.step for s in report.steps})
    ranks = len({s.rank for s in report.steps})
    text.append(
        f"  {compared} common steps x {ranks} rank{'s' * (ranks > 1)} compared "
        f"({report.tolerance.describe()}; statistics from the indexes, tensors where both steps "
        "are full)\n"
    )
    if report.only_a or report.only_b:
        sides = f"A {_steps(report.only_a)}, B {_steps(report.only_b)}"
        text.append(f"steps recorded on one side only (step@rank): {sides}\n")
    if first is not None:
        a, b = report.first_values.get("a", {}), report.first_values.get("b", {})
        text.append("first divergence: ", style="bold")
        text.append(f"step {first.step}, rank {first.rank}, {first.first}", style="bold red")
        na, nb = a.get("norm"), b.get("norm")
        if na is not None and nb is not None and nb and math.isfinite(na) and math.isfinite(nb):
            rel = fmt(abs(na - nb) / abs(nb))
            text.append(f"  (norm {na:.7g} vs {nb:.7g}, rel. difference {rel})")
        text.append("\n")
    rows = [s for s in report.steps if show_all or s.failed]
    if rows:
        header = f"{'step':>8} {'rank':>4} {'differ':>9}  worst |a-b| / (atol + rtol*|b|), key\n"
        text.append(header, style="bold")
    for s in rows:
        worst = f"{fmt(s.worst_of_limit)} {s.worst}" if s.worst else "0"
        how = " (tensors)" if s.tensors else ""
        text.append(f"{s.step:>8} {s.rank:>4} {len(s.failed):>4}/{s.compared:<4}  {worst}{how}\n")
    if report.formats:
        text.append_text(_run_formats_lines(report))
    text.rstrip()
    return text


# Crossings listed at most (all in --json).
FORMAT_ROWS = 10


def _run_formats_lines(report: RunDiff) -> Text:
    """Per key and format, the first step its SQNR falls below a threshold in A that B's is
    above (record(..., formats=[...]) in both runs)."""
    from modeltap.diff.formats import thresholds
    from modeltap.render.tables import LEVEL_STYLE, db_text

    limits = thresholds()
    rule = f"(SQNR dB, red < {limits['bad']:g}, yellow < {limits['warn']:g})"
    text = Text(f"formats {', '.join(report.formats)} {rule}: ", style="bold")
    crossed = report.crossed
    if not crossed:
        text.append("no key falls below a threshold in A that B's is above at a common step\n")
    else:
        text.append(f"{len(crossed)} key/format pairs fall below a threshold in A that B's is ")
        text.append("above\n")
        rows = crossed[:FORMAT_ROWS]
        width = max(3, *(len(c.key) for c in rows))
        names = max(6, *(len(c.format) for c in rows))
        head = f"{'step':>8} {'rank':>4}  {'key':<{width}}  {'format':<{names}}  SQNR A vs B\n"
        text.append(head, style="bold")
        for c in rows:
            text.append(f"{c.step:>8} {c.rank:>4}  {c.key:<{width}}  {c.format:<{names}}  ")
            text.append(db_text(c.a_db), style=LEVEL_STYLE[c.level])
            text.append(f" vs {db_text(c.b_db)}\n")
        if len(crossed) > FORMAT_ROWS:
            text.append(f"  ... {len(crossed) - FORMAT_ROWS} more (--json)\n", style="dim")
    if report.recovered:
        text.append(f"{len(report.recovered)} rise above a threshold in A\n", style="dim")
    return text


def _steps(pairs: list[tuple[int, int]]) -> str:
    shown = ", ".join(f"{s}@{r}" for s, r in pairs[:6]) + (" ..." if len(pairs) > 6 else "")
    return shown or "none"


def run_json(run: RunIndex) -> dict[str, Any]:
    """The run's index as one JSON-ready object: per rank, its settings, steps and trips."""
    return {
        "folder": str(run.folder),
        "ranks": {
            str(r): {
                "start": i.start,
                "resumed": i.resumed,
                "truncated": i.truncated,
                "steps": i.steps,
                "evals": i.evals,
                "skipped": i.skipped,
                "trips": i.trips,
            }
            for r, i in run.ranks.items()
        },
    }

"""Tables of diffs, gradients, training runs, compares and placements."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from modeltap.capture import split_key
from modeltap.dump import GRAD_PREFIX
from modeltap.render.tree import (
    WIDE,
    _aligned,
    _fit,
    _module_tree,
    _plain_table,
    _walk,
    fmt,
    fmt_shape,
    grad_flag,
    grad_meta,
)
from modeltap.selection import ROOT

if TYPE_CHECKING:
    from torch import nn

    from modeltap.diff.dumps import DiffReport
    from modeltap.diff.pairs import Pair as DiffPair
    from modeltap.diff.runs import RunDiff
    from modeltap.dump import Dump
    from modeltap.record.index import RunIndex
    from modeltap.stats import TensorStats

DIFF_ROWS = 20


def diff_heading(report: DiffReport) -> Text:
    """Verdict, counts, metadata that differs, and the first diverging module."""
    text = Text()
    for change in report.metadata:
        style = {"warning": "yellow", "error": "bold red"}.get(change.level, "dim")
        text.append(f"{change.level}: {change.key} differs: {change.describe()}\n", style=style)
    verdict = "PASS" if report.passed else "FAIL"
    if report.inputs_differ:
        verdict = "FAIL: inputs differ"
    text.append(verdict, style="bold green" if report.passed else "bold red")
    text.append(
        f"  {len(report.pairs)} compared, {len(report.failed)} out of tolerance "
        f"({report.tolerance.describe()})"
    )
    if report.only_a or report.only_b:
        text.append(f", {len(report.only_a)} only in A, {len(report.only_b)} only in B")
        if report.strict:
            text.append(" (--strict)")
    differ = report.inputs_differ
    if differ:
        text.append("\ninputs differ: ", style="bold")
        text.append(differ[0].key, style="bold red")
        text.append(
            f"  ({_diff_summary(differ[0])}): the preprocessing changed before layer 0"
            + (f"; {len(differ) - 1} more input tensors differ" if len(differ) > 1 else "")
        )
    for side, keys in (("removed", report.only_a), ("inserted", report.only_b)):
        for key in (k for k in keys if k in report.sources):  # ops the other side pairs around
            text.append(f"\nop {side} in B: {key}  at {report.sources[key]}", style="yellow")
    mapped, structural = report.matched("mapped"), report.matched("structural")
    if mapped:
        text.append(f"\n{len(mapped)} keys paired by --map, e.g. {_arrow(mapped[0])}")
    if structural:
        text.append(
            f"\n{len(structural)} keys paired across named and positional outputs of the same "
            f"module (same shapes), e.g. {_arrow(structural[0])}",
            style="yellow",
        )
    first = report.first_divergence
    if first is not None:
        downstream = len(report.failed) - len(differ) - 1
        text.append("\nfirst divergence: ", style="bold")
        text.append(first.key, style="bold red")
        text.append(f"  ({_diff_summary(first)})")
        if first.key in report.sources:  # an op (`dump --ops`): the line that called it
            text.append(f"\n  at {report.sources[first.key]}")
        if downstream:
            text.append(f"\n{downstream} later tensors differ downstream of it")
    elif report.failed and not report.ordered:
        text.append("\nno execution order in A (not a modeltap dump): worst tensors first")
    with_nan = [p for p in report.failed if p.nan_mismatch]
    if with_nan:
        text.append(
            f"\n{len(with_nan)} tensors out of tolerance hold NaN "
            f"({sum(p.nan_mismatch for p in with_nan)} NaN mismatches); "
            "--equal-nan counts NaN == NaN as equal",
            style="yellow",
        )
    return text


def _arrow(match: tuple[str, str]) -> str:
    return f"{match[0]} → {match[1]}"


def _diff_summary(pair: DiffPair) -> str:
    if pair.status == "shape":
        return f"shape {fmt_shape(pair.shape)} vs {fmt_shape(pair.other_shape or [])}"
    if pair.status == "dtype":
        return f"dtype {pair.dtype} vs {pair.other_dtype}; --upcast compares the values"
    from modeltap.diff.pairs import nan_note

    if pair.max_abs is None:
        return f"no position finite on both sides, {pair.out_fraction:.1%} out; {nan_note(pair)}"
    text = f"max abs {fmt(pair.max_abs)}, max rel {fmt(pair.max_rel)}, {pair.out_fraction:.1%} out"
    note = nan_note(pair)
    return f"{text}; {note}" if note else text


def diff_table(report: DiffReport, *, show_all: bool = False, width: int = 80) -> Table:
    """Worst pairs first (or every pair in execution order with `show_all`), then missing keys.

    The key column takes what `width` leaves after the numbers, cut with an ellipsis.
    """
    first = report.first_divergence
    if show_all:
        rows = list(report.pairs)
    else:
        rows = sorted(
            report.failed,
            key=lambda p: (p is not first, -(p.out_fraction or 1.0), -(p.max_abs or math.inf)),
        )[:DIFF_ROWS]
    table = _plain_table()
    numbers = {"max abs": 8, "max rel": 8, "cosine": 8, "out": 6}
    key_width = max(16, width - 9 - sum(numbers.values()) - len(numbers) - 1)
    table.add_column("key", no_wrap=True, overflow="ellipsis", max_width=key_width)
    table.add_column("status", no_wrap=True, min_width=9)
    for name, min_width in numbers.items():
        table.add_column(name, justify="right", no_wrap=True, min_width=min_width)
    for pair in rows:
        style = "bold red" if pair is first else ("red" if not pair.ok else "")
        name = pair.key if pair.key == pair.other else f"{pair.key} → {pair.other}"
        status = pair.status if pair.ok or pair.status != "differs" else "DIFFERS"
        if pair is first:
            status = "FIRST"
        cosine = "-" if pair.cosine is None else f"{pair.cosine:.6f}"
        out = "-" if pair.out_fraction is None else f"{pair.out_fraction:.1%}"
        table.add_row(
            Text(name, style=style),
            Text(status, style=style),
            "NaN" if pair.max_abs is None and pair.nan_mismatch else fmt(pair.max_abs),
            fmt(pair.max_rel),
            cosine,
            out,
        )
    for side, keys in (("only in A", report.only_a), ("only in B", report.only_b)):
        for key in keys:
            table.add_row(Text(key, style="yellow"), Text(side, style="yellow"))
    if not show_all and len(report.failed) > len(rows):
        table.add_row(Text(f"... {len(report.failed) - len(rows)} more (--all)", style="dim"))
    return table


def grads_heading(dump: Dump) -> Text:
    """What was differentiated: the target or loss, the seed vector, and the flag counts."""
    grad = grad_meta(dump) or {}
    text = Text("gradients of ", style="bold")
    text.append(grad.get("target", "?"), style="bold cyan")
    info = grad.get("loss_info", {})
    if "value" in info:
        text.append(f" = {info['value']:.6g}")
    if grad.get("loss") == "sum":
        text.append("  (loss: sum of the main output)")
    if grad.get("grad_output") not in (None, "scalar"):
        text.append(f"  grad_output: {grad['grad_output']}")
    computed = [k for k in grad.get("keys", []) if k not in grad.get("no_path", {})]
    flags = [grad_flag(s, grad) for k in computed if (s := dump.stats_for(GRAD_PREFIX + k))]
    text.append(f"\n{len(computed)} gradients", style="bold")
    if grad.get("params"):
        text.append(f" ({len(grad['params'])} of parameters)")
    if grad.get("no_path"):
        text.append(f", {len(grad['no_path'])} with no path to the target")
    for flag in ("vanishing", "exploding", "nan/inf"):
        if flag in flags:
            style = "yellow" if flag == "vanishing" else "bold red"
            text.append(f", {flags.count(flag)} {flag}", style=style)
    text.append(f"  (vanishing < {grad.get('vanishing', 0):g}, exploding > ")
    text.append(f"{grad.get('exploding', 0):g})")
    return text


def grads_table(dump: Dump, *, width: int = 80) -> Table:
    """The tree of gradients: norm, mean, absmax, NaN/Inf, exact zeros, flags; `no path` rows.

    Below WIDE columns with Jacobian estimates, mean and zeros make room for them.
    """
    grad = grad_meta(dump) or {}
    no_path = grad.get("no_path", {})
    jacobian = grad.get("jacobian", {})
    keys = grad.get("keys", [])
    stats = {k: dump.stats_for(GRAD_PREFIX + k) for k in keys if k not in no_path}
    flags = {k: _grad_flag_or_target(k, s, grad) for k, s in stats.items() if s is not None}
    numbers = {"norm": 8, "mean": 9, "absmax": 8, "nan/inf": 7, "zeros": 5}
    if jacobian and width < WIDE:
        del numbers["mean"], numbers["zeros"]
    if jacobian:
        numbers["‖J‖F ± se"] = 17
    shape_width = max([5, *(len(fmt_shape(s.shape)) for s in stats.values() if s is not None)])
    flag_width = max([4, *(len(f) for f in flags.values())])
    used = shape_width + sum(numbers.values()) + flag_width + len(numbers) + 2
    table = _plain_table()
    table.add_column(
        "gradient w.r.t.", no_wrap=True, overflow="ellipsis", max_width=max(16, width - used)
    )
    table.add_column("shape", justify="right", no_wrap=True, min_width=shape_width)
    for name, min_width in numbers.items():
        table.add_column(name, justify="right", no_wrap=True, min_width=min_width)
    table.add_column("flag", no_wrap=True, min_width=flag_width)
    for label, key in _walk(_module_tree(keys), None, ""):
        if key is None:
            table.add_row(label)
            continue
        st = stats.get(key)
        if st is None:
            table.add_row(Text(label, style="dim"), "", Text(no_path.get(key, "?"), style="dim"))
            continue
        flag = flags[key]
        style = {"vanishing": "yellow", "": "", "target": "cyan"}.get(flag, "bold red")
        zeros = f"{st.zeros / st.numel:.0%}" if st.zeros is not None and st.numel else "-"
        est = jacobian.get(key)
        values = {
            "norm": fmt(st.norm),
            "mean": fmt(st.mean, st.absmax),
            "absmax": fmt(st.absmax),
            "nan/inf": f"{st.nan}/{st.inf}" if st.nan or st.inf else "0",
            "zeros": zeros,
            "‖J‖F ± se": "" if est is None else f"{fmt(est['norm'])} ± {fmt(est.get('norm_se'))}",
        }
        table.add_row(
            Text(label, style=style),
            fmt_shape(st.shape),
            *(values[name] for name in numbers),
            Text(flag, style=style),
        )
    return table


def _grad_flag_or_target(key: str, stats: TensorStats, grad: dict[str, Any]) -> str:
    return grad_flag(stats, grad) or ("target" if key == grad.get("target") else "")


# -- runs recorded with modeltap.record (`modeltap show DIR`) --------------------------------

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
        text.append(f"\nskipped by the GradScaler (inf/NaN gradients): steps {shown}{more}")
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
    index = run.ranks[rank]
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
    flags: dict[str, list[str]] = {}
    for s in steps:
        for h in s.get("hits", []):
            key = h["key"].removeprefix(GRAD_PREFIX)
            flag = _FLAGS.get(h["rule"], h["rule"])
            if flag not in flags.setdefault(key, []):
                flags[key].append(flag)
    trips: dict[str, list[str]] = {}
    for trip in index.trips:
        trips.setdefault(trip["module"], []).append(f"NaN@{trip['step']} {trip['phase']}")
    activations = [k for k in keys if not k.startswith(GRAD_PREFIX)]
    last = steps[-1] if steps else {"keys": {}}
    # Rows of (label, norm trend, last, dead, grad trend, grad last, update, flags, style).
    rows: list[tuple[str, ...]] = []
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
    param_rows = []
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
    text.rstrip()
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


# `modeltap compare`: verdict styles, and the rows shown without --all.
_VERDICT_STYLE = {
    "origin": "bold red",
    "via_child": "red",
    "inherited": "yellow",
    "replay_invalid": "bold magenta",
    "replay_error": "magenta",
}


def compare_heading(report: Any) -> Text:
    """What was compared with what, the verdict, then origins ranked by local error, the first
    divergence, and how many modules only inherited the error."""
    ref, cand = report.reference, report.candidate
    text = Text()
    verdict = ("PASS", "bold green") if report.passed else ("FAIL", "bold red")
    text.append(verdict[0], style=verdict[1])
    text.append(f"  reference {ref.get('model', '?')} ({ref.get('dtype', '?')}, ")
    text.append(f"{ref.get('device', '?')})\n      candidate ")
    name = cand.get("model", "?")
    label = cand.get("variant", "")
    if name != ref.get("model"):
        text.append(name, style="bold")
        text.append(" " if label != "same" else "")
    if label != "same":
        text.append(label, style="bold")
    engine = f", {cand['quantization']}" if cand.get("quantization") else ""  # emulated, torchao
    text.append(f" ({cand.get('dtype', '?')}, {cand.get('device', '?')}{engine})\n")
    local, cumulative = report.tolerance, report.cumulative.tolerance
    for warning in report.warnings:
        text.append(f"warning: {warning}\n", style="yellow")
    text.append(f"tolerance {report.preset or ''}: {local.describe()}\n")
    if cumulative != local:
        widened = f"scaled_atol={cumulative.scaled_atol:g}"
        text.append(f"  cumulative errors: {widened} too (rounding accumulated)\n")
    replayed = [m for m in report.modules if m.status == "replayed"]
    text.append(f"{len(replayed)} modules replayed")
    if report.replay_depth is not None:
        text.append(f" (at --depth {report.replay_depth} and above)")
    if report.replay_note:
        text.append(f"; {report.replay_note}")
    full = report.full_replays
    if full:
        text.append(f"; {len(full)} in full (children computed again, --json says why)")
    invalid = report.invalid
    if invalid:
        text.append(f"; {len(invalid)} not reproduced by their own replay: ", style="magenta")
        text.append(", ".join(m.name for m in invalid[:3]) + (" ..." if len(invalid) > 3 else ""))
    text.append("\n")
    origins = report.origins
    if origins:
        text.append(f"{len(origins)} origin{'s' if len(origins) > 1 else ''}", style="bold red")
        text.append(" (its own code's local error out of tolerance), worst first:\n")
        for rank, module in enumerate(origins[:DIFF_ROWS], 1):
            text.append(f"  {rank}. ")
            text.append(module.name, style="bold red")
            text.append(f"  local error {fmt(module.local_error)}\n")
        if len(origins) > DIFF_ROWS:
            text.append(f"  ... {len(origins) - DIFF_ROWS} more (--json lists all)\n")
    worst_op = None if report.op_blame is None else report.op_blame.worst
    if worst_op is not None:  # --ops: inside the worst origin, the op its error comes from
        text.append("op: ", style="bold")
        text.append(report.op_blame.path(), style="bold red")
        text.append(f"  relative error {fmt(worst_op.error)} at {worst_op.source}\n")
    first = report.first_divergence
    if not origins and not report.passed:
        text.append("no origin: every module's own error is within tolerance, yet the\n")
        text.append("cumulative error is beyond accumulated rounding: look at the modules not\n")
        text.append("compared or replay invalid, or at small errors adding up\n")
    if first is not None:
        text.append("first divergence: ", style="bold")
        text.append(first.other, style="bold red")
        text.append(f"\n  {_diff_summary(first)}\n")
    inherited = report.inherited
    if inherited:
        text.append(f"{len(inherited)} modules only inherited the error", style="yellow")
        text.append(" (cumulative out, local within; --all)\n")
    skipped: dict[str, int] = {}
    for module in report.not_compared:
        skipped[module.status] = skipped.get(module.status, 0) + 1
    if skipped:
        parts = ", ".join(f"{n} {status.replace('_', ' ')}" for status, n in skipped.items())
        text.append(f"not compared: {parts}\n", style="dim")
    for what in ("local", "cumulative"):
        errors = [
            (m.local_error if what == "local" else m.cumulative_error, m.name)
            for m in report.modules
        ]
        known = [(e, name) for e, name in errors if e is not None]
        if known and max(known)[0] == 0:
            text.append(f"no {what} error: every output equal bit for bit\n", style="dim")
        elif known:
            worst = max(known)
            text.append(f"largest {what} error {fmt(worst[0])} in {worst[1]}\n", style="dim")
    text.append("errors are max |candidate - reference| / max |reference|", style="dim")
    return text


def compare_table(report: Any, *, show_all: bool = False, width: int = 80) -> Table:
    """The module tree with local and cumulative errors and each module's verdict; without
    `show_all`, only origins, their parents and modules whose replay failed (with their tree
    guides): the heading counts the modules that only inherited the error."""
    shown = {k for k in _VERDICT_STYLE if k != "inherited"}
    rows = [m for m in report.modules if show_all or m.verdict in shown]
    by_name = {m.name: m for m in rows}
    table = _plain_table()
    numbers = {"local": 8, "cumul.": 8, "verdict": 14}
    key_width = max(16, width - sum(numbers.values()) - len(numbers) - 1)
    table.add_column("module", no_wrap=True, overflow="ellipsis", max_width=key_width)
    table.add_column("local", justify="right", no_wrap=True, min_width=8)
    table.add_column("cumul.", justify="right", no_wrap=True, min_width=8)
    table.add_column("verdict", no_wrap=True, min_width=14)
    for label, name in _walk(_module_tree(list(by_name)), None, ""):
        module = by_name.get(name or "")
        if module is None:
            table.add_row(label)
            continue
        verdict = module.verdict
        style = _VERDICT_STYLE.get(verdict, "dim" if module.status != "replayed" else "")
        table.add_row(
            Text(label, style=style),
            fmt(module.local_error),
            fmt(module.cumulative_error),
            Text(verdict.replace("_", " "), style=style),
        )
    return table


def placement_table(
    model: nn.Module, names: Sequence[str], devices: dict[str, str], sizes: dict[str, int]
) -> Table:
    """`modeltap ls --device-map`: the module tree with the device each module is planned on
    (`a+b` when split across devices) and its parameter and buffer bytes."""
    from modeltap.loading.placement import format_bytes

    by_name = {(n or ROOT): m for n, m in model.named_modules()}
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    table.add_column("module", no_wrap=True, overflow="ellipsis")
    table.add_column("class")
    table.add_column("params", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("device")
    for label, key in _walk(_module_tree(list(names)), None, ""):
        module = by_name[key] if key is not None else None
        if module is None or key is None:
            table.add_row(label)
            continue
        params = sum(p.numel() for p in module.parameters())
        device = devices.get(key, "?")
        style = "yellow" if device == "disk" else "cyan" if "+" in device else ""
        size = format_bytes(sizes.get(key, 0))
        table.add_row(label, type(module).__name__, f"{params:,}", size, Text(device, style=style))
    return table


def device_bytes_table(per_device: dict[str, int]) -> Table:
    """Parameter and buffer bytes planned on each device, with the total."""
    from modeltap.loading.placement import format_bytes

    table = _plain_table()
    table.add_column("device")
    table.add_column("bytes", justify="right")
    for device, size in per_device.items():
        table.add_row(Text(device, style="yellow" if device == "disk" else ""), format_bytes(size))
    table.add_row(Text("total", style="bold"), format_bytes(sum(per_device.values())))
    return table

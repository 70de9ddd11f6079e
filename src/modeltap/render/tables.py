"""Tables of dump diffs, gradients and placements; a run folder's are in run_tables.py,
compare's in compare_tables.py."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from modeltap.dump import GRAD_PREFIX
from modeltap.render.tree import (
    WIDE,
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
    from modeltap.dump import Dump
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
    if report.formats:
        text.append_text(_formats_lines(report))
    return text


# Keys crossing a format's threshold listed in the heading at most (all in --json).
FORMAT_ROWS = 10
LEVEL_STYLE = {"bad": "red", "warn": "yellow", "ok": "green"}
_A_STYLE = {**LEVEL_STYLE, "ok": ""}


def db_text(sqnr_db: float | None) -> str:
    """An SQNR in dB as the tree shows it: one decimal, `inf` where quantizing is exact."""
    return "inf" if sqnr_db is None else f"{sqnr_db:.1f}"


def _formats_lines(report: DiffReport) -> Text:
    """Which keys are below a --formats threshold in A, the candidate, that B's are above
    (SQNR A vs B)."""
    from modeltap.diff.formats import thresholds

    limits = thresholds()
    crossed, recovered = report.crossings(), report.crossings(recovered=True)
    rule = f"(SQNR dB, red < {limits['bad']:g}, yellow < {limits['warn']:g})"
    text = Text(f"\nformats {', '.join(report.formats)} {rule}: ", style="bold")
    keys = len({c.key for c in crossed})
    if not crossed:
        text.append("no key falls below a threshold in A that B's is above")
    else:
        text.append(f"{keys} {'key falls' if keys == 1 else 'keys fall'} below a threshold in A ")
        text.append("that B's is above, A vs B:")
        width = max(len(c.key) for c in crossed[:FORMAT_ROWS])
        names = max(len(c.format) for c in crossed[:FORMAT_ROWS])
        for c in crossed[:FORMAT_ROWS]:
            text.append(f"\n  {c.key:<{width}}  {c.format:<{names}}  ")
            text.append(db_text(c.a_db), style=LEVEL_STYLE[c.level])
            text.append(f" vs {db_text(c.b_db)}")
        if len(crossed) > FORMAT_ROWS:
            text.append(f"\n  ... {len(crossed) - FORMAT_ROWS} more (--json)", style="dim")
    if recovered:
        back = len({c.key for c in recovered})
        rise = "key rises" if back == 1 else "keys rise"
        text.append(f"\n{back} {rise} above a threshold in A that B's is below", style="dim")
    return text


def _format_cell(pair: DiffPair, name: str) -> Text:
    """`A/B` SQNR dB of one format (the candidate's, the reference's), coloured by A's
    level as the tree colours it; `-` where a side has none."""
    from modeltap.diff.formats import level

    sides = (pair.formats or {}).get(name)
    if sides is None or sides["a"] is None or sides["b"] is None:
        return Text("-")
    a_db, b_db = sides["a"].get("sqnr_db"), sides["b"].get("sqnr_db")
    return Text(f"{db_text(a_db)}/{db_text(b_db)}", style=_A_STYLE[level(a_db)])


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
    numbers |= {name: 9 for name in report.formats}  # SQNR dB, A/B (--formats)
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
            *(_format_cell(pair, name) for name in report.formats),
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

"""`modeltap compare`'s heading and module table."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from modeltap.render.tables import DIFF_ROWS, _diff_summary
from modeltap.render.tree import _module_tree, _plain_table, _walk, fmt

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
    text = Text()
    _compared_what(text, report)
    _replayed(text, report)
    _origins(text, report)
    _error_summary(text, report)
    text.append("errors are max |candidate - reference| / max |reference|", style="dim")
    return text


def _compared_what(text: Text, report: Any) -> None:
    """The verdict, the reference and the candidate, warnings and the tolerance."""
    ref, cand = report.reference, report.candidate
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


def _replayed(text: Text, report: Any) -> None:
    """How many modules were replayed, how deep, in full, and those not reproduced."""
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


def _origins(text: Text, report: Any) -> None:
    """The origins ranked by local error, the op (--ops), or why there is none."""
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
    if not origins and not report.passed:
        text.append("no origin: every module's own error is within tolerance, yet the\n")
        text.append("cumulative error is beyond accumulated rounding: look at the modules not\n")
        text.append("compared or replay invalid, or at small errors adding up\n")


def _error_summary(text: Text, report: Any) -> None:
    """The first divergence, the modules that only inherited the error or were not compared,
    and the largest local and cumulative errors."""
    first = report.first_divergence
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

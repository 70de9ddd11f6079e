"""The diff page: the verdict and metadata differences on top, then the divergence strip along
the execution order (errors on a log scale, the tolerance drawn, the first divergence marked,
both sides' statistics on hover) and the table of pairs."""

from __future__ import annotations

import math
from typing import Any

from modeltap.diff.dumps import DiffReport
from modeltap.diff.pairs import Pair
from modeltap.diff.tolerance import Tolerance, margin
from modeltap.dump import Dump, load_dump
from modeltap.render.report.key_figures import axis_ticks
from modeltap.render.report.page import OKABE_ITO, Page, Section, fmt, layout, positive
from modeltap.stats import TensorStats

PAIR_COLUMNS = ["key (A)", "key (B)", "status", "share of its limit", "max |a−b|", "max rel",
                "max |a−b| / max |b|", "cosine", "out of tolerance"]  # fmt: skip


def _side(name: str, stats: TensorStats | None) -> str:
    if stats is None:
        return f"{name}: no statistics"
    values = ", ".join(f"{n} {fmt(getattr(stats, n))}" for n in ("norm", "mean", "std", "absmax"))
    return f"{name}: {values}"


def cosine_text(cosine: float | None) -> str:
    """A cosine with the digits that tell 0.9999 from 0.999: three significant digits of
    1 - cosine."""
    if cosine is None or not math.isfinite(cosine):
        return fmt(cosine)
    lost = 1.0 - cosine
    digits = 4 if lost <= 0 else min(12, max(4, 2 - math.floor(math.log10(lost))))
    return f"{cosine:.{digits}f}"


def _hover(pair: Pair, a: Dump, b: Dump, tolerance: Tolerance) -> str:
    lines = [pair.key if pair.key == pair.other else f"{pair.key} ↔ {pair.other}",
             f"status {pair.status}; {fmt(margin(pair, tolerance))} of its limit",
             f"max |a−b| {fmt(pair.max_abs)}; max rel {fmt(pair.max_rel)}; "
             f"cosine {cosine_text(pair.cosine)}",
             _side("A", a.stats_for(pair.key)), _side("B", b.stats_for(pair.other))]  # fmt: skip
    return "<br>".join(lines)


def _vertical(at: int, text: str, y: float) -> tuple[dict[str, Any], dict[str, Any]]:
    line = {"type": "line", "xref": "x", "yref": "paper", "x0": at, "x1": at, "y0": 0, "y1": 1,
            "line": {"color": OKABE_ITO[3], "width": 2, "dash": "dot"}}  # fmt: skip
    note = {"x": at, "y": y, "xref": "x", "yref": "paper", "showarrow": False, "text": text,
            "xanchor": "left", "font": {"color": OKABE_ITO[3]}}  # fmt: skip
    return line, note


def rule_text(tolerance: Tolerance) -> str:
    """The whole rule a pair is held to, in words."""
    text = f"|a−b| ≤ {tolerance.atol:g}"
    if tolerance.scaled_atol:
        text += f" + {tolerance.scaled_atol:g}·max|b|"
    text += f" + {tolerance.rtol:g}·|b|"
    if tolerance.min_cosine is not None:
        text += f" and cosine ≥ {tolerance.min_cosine:g}"
    return text


def strip_figures(report: DiffReport, a: Dump, b: Dump, prefix: str = "diff") -> dict[str, Any]:
    """Per pair in execution order: its margin to its own limit (the verdict's chart: above 1 is
    out of tolerance, whatever part of the rule it breaks), its errors, and the share of its
    elements out of tolerance."""
    pairs = report.pairs
    tol = report.tolerance
    x = list(range(len(pairs)))
    hover = [_hover(p, a, b, tol) for p in pairs]
    keys = [p.key for p in pairs]
    marks, notes = _divergence_marks(report, keys)
    limit = {"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": 1, "y1": 1,
             "line": {"color": OKABE_ITO[7], "width": 1.5, "dash": "dash"}}  # fmt: skip
    limit_note = {"x": 1, "y": 0, "xref": "paper", "yref": "y", "showarrow": False,
                  "text": f"limit: {rule_text(tol)}", "xanchor": "right",
                  "yanchor": "bottom"}  # fmt: skip (y: log10 of 1)
    series = [("elementwise: max |a−b| / (its allowed difference)",
               [positive(p.of_limit) for p in pairs])]  # fmt: skip
    if tol.min_cosine is not None:
        room = 1.0 - tol.min_cosine
        series.append((
            f"cosine: (1 − cosine) / (1 − {tol.min_cosine:g})",
            [positive(None if p.cosine is None or room <= 0 else (1 - p.cosine) / room)
             for p in pairs],
        ))  # fmt: skip
    data = [
        {"type": "scatter", "mode": "lines+markers", "name": name, "x": x, "y": y,
         "hovertext": hover, "hoverinfo": "text+name", "marker": {"size": 5},
         "line": {"width": 1.5}}
        for name, y in series
    ]  # fmt: skip
    failed = [i for i, p in enumerate(pairs) if not p.ok]
    if failed:
        drawn = [positive(margin(pairs[i], tol)) for i in failed]
        top = max([1.0, *(v for v in drawn if v is not None)]) * 3
        data.append({"type": "scatter", "mode": "markers", "name": "out of tolerance",
                     "x": failed, "y": [top if v is None else v for v in drawn],
                     "hovertext": [hover[i] for i in failed], "hoverinfo": "text+name",
                     "marker": {"symbol": "x", "size": 10, "color": OKABE_ITO[3]}})  # fmt: skip
    errors = [
        ("max |a−b| / max |b|", [positive(p.max_scaled) for p in pairs]),
        ("max relative error", [positive(p.max_rel) for p in pairs]),
        ("1 − cosine", [positive(None if p.cosine is None else 1 - p.cosine) for p in pairs]),
    ]
    share = [None if p.out_fraction is None else 100.0 * p.out_fraction for p in pairs]
    ticks = _module_ticks(keys)
    # Above the plot: below it, the legend would sit on the rotated module names.
    legend = {"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 1, "xanchor": "right"}
    return {
        f"{prefix}-strip": {"data": data, "layout": layout(
            "Each pair against its own limit (A against B, B the reference): above 1 fails",
            "module (execution order; hover for the key and both sides' statistics)",
            "share of its limit (log scale)", log_y=True, shapes=[*marks, limit],
            annotations=[*notes, limit_note], height=400, xaxis=ticks, legend=legend)},
        f"{prefix}-errors": {"data": [
            {"type": "scatter", "mode": "lines+markers", "name": name, "x": x, "y": y,
             "hovertext": hover, "hoverinfo": "text+name", "marker": {"size": 4},
             "line": {"width": 1.2}} for name, y in errors],
            "layout": layout("Errors per pair (for diagnosis; the verdict is the chart above)",
                             "module (execution order)", "error (dimensionless, log scale)",
                             log_y=True, shapes=marks, height=340, xaxis=ticks,
                             legend=legend)},
        f"{prefix}-share": {"data": [{
            "type": "bar", "name": "share out of tolerance", "x": x, "y": share, "hovertext": hover,
            "hoverinfo": "text+y", "marker": {"color": OKABE_ITO[1]}}],
            "layout": layout("Elements out of tolerance per pair", "module (execution order)",
                             "elements out of tolerance (%)", shapes=marks, height=260,
                             xaxis=ticks)},
    }  # fmt: skip


def _divergence_marks(
    report: DiffReport, keys: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Vertical lines, with their notes, where the inputs differ and at the first divergence."""
    marks: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    differ = report.inputs_differ
    if differ:
        line, note = _vertical(keys.index(differ[0].key), f"inputs differ: {differ[0].key}", 1)
        marks.append(line)
        notes.append(note)
    first = report.first_divergence
    if first is not None:
        after = " (downstream of the inputs)" if differ else ""
        line, note = _vertical(
            keys.index(first.key), f"first divergence: {first.key}{after}", 0.9 if differ else 1
        )
        marks.append(line)
        notes.append(note)
    return marks, notes


def _module_ticks(keys: list[str]) -> dict[str, Any]:
    """An x axis (pair index) labelled with module names: every block's first key, or every
    key when they are few."""
    return axis_ticks(keys, "module (execution order; hover for the key)")


def pair_rows(report: DiffReport) -> list[dict[str, Any]]:
    return [
        {"class": "" if p.ok else "bad", "cells": [
            p.key, p.other if p.other != p.key else "", p.status,
            fmt(margin(p, report.tolerance)), fmt(p.max_abs), fmt(p.max_rel), fmt(p.max_scaled),
            cosine_text(p.cosine),
            "" if p.out_fraction is None else f"{100 * p.out_fraction:.3g}%",
            *(_sqnr_pair(p, name) for name in report.formats)]}
        for p in report.pairs
    ]  # fmt: skip


def _sqnr_pair(pair: Pair, name: str) -> str:
    """`A vs B` SQNR dB of one format (--formats), as the text table shows it."""
    from modeltap.render.tables import db_text

    sides = (pair.formats or {}).get(name) or {}
    a, b = sides.get("a"), sides.get("b")
    return "" if a is None or b is None else f"{db_text(a['sqnr_db'])} vs {db_text(b['sqnr_db'])}"


def _formats_section(report: DiffReport) -> Section:
    """The keys whose SQNR in a format is below a threshold in A that B's is above (--formats)."""
    from modeltap.diff.formats import thresholds
    from modeltap.render.tables import db_text

    limits = thresholds()
    rows = [{"class": "bad" if c.level == "bad" else "warn", "cells": [
        c.key, c.format, db_text(c.a_db), db_text(c.b_db), c.level]}
        for c in report.crossings()]  # fmt: skip
    rows += [{"class": "", "cells": [c.key, c.format, db_text(c.a_db), db_text(c.b_db),
                                     "recovered"]}
             for c in report.crossings(recovered=True)]  # fmt: skip
    return Section(
        "table", "Low-precision formats: thresholds crossed",
        columns=["key (A)", "format", "SQNR dB in A", "SQNR dB in B", "level in A"], rows=rows,
        note=f"What quantizing each tensor would cost (`--formats`), SQNR in dB: bad below "
        f"{limits['bad']:g}, warn below {limits['warn']:g}. Listed: the keys whose figure falls "
        "to a worse level in A (the candidate) than in B, then those at a better one. The Pairs "
        "table has every key's SQNR, A vs B.",
    )


def diff_summary(report: DiffReport) -> list[tuple[str, str, str]]:
    """The verdict and counts, as the text report's heading says them: differing inputs first
    (the preprocessing changed before layer 0; every module follows them)."""
    first = report.first_divergence
    failed = len(report.failed)
    differ = report.inputs_differ
    verdict = "PASS" if report.passed else ("FAIL: inputs differ" if differ else "FAIL")
    summary = [
        ("verdict", verdict, "ok" if report.passed else "bad"),
        ("A", str(report.a), ""),
        ("B (reference)", str(report.b), ""),
        ("tolerance", report.tolerance.describe(), ""),
        ("compared", f"{len(report.pairs)} pairs, {failed} out of tolerance",
         "bad" if failed else "ok"),
    ]  # fmt: skip
    if differ:
        more = f"; {len(differ) - 1} more input tensors differ" if len(differ) > 1 else ""
        summary.append(("inputs differ", f"{differ[0].key}: the preprocessing changed before "
                        f"layer 0{more}", "bad"))  # fmt: skip
    first_text = "none"
    if first is not None:
        first_text = first.key + (" (downstream of the differing inputs)" if differ else "")
    summary.append(("first divergence", first_text, "bad" if first else ""))
    summary += [
        (f"{m.key} differs", m.describe(), "bad" if m.level != "info" else "")
        for m in report.metadata if m.level != "info"
    ]  # fmt: skip
    summary.append(("only in A / only in B", f"{len(report.only_a)} / {len(report.only_b)}",
                    "warn" if report.only_a or report.only_b else ""))  # fmt: skip
    if report.formats:
        crossed = len({c.key for c in report.crossings()})
        summary.append((f"formats ({', '.join(report.formats)})",
                        f"{crossed} keys fall below an SQNR threshold in A that B's is above",
                        "warn" if crossed else "ok"))  # fmt: skip
    return summary


def diff_page(report: DiffReport, *, command: str = "") -> Page:
    """The page of `modeltap diff A B` (or `modeltap report A B`)."""
    a, b = load_dump(report.a), load_dump(report.b)
    page = Page(f"modeltap diff: {report.a.name} against {report.b.name}", "diff", command=command)
    page.summary = diff_summary(report)
    if report.metadata:
        page.sections.append(Section(
            "table", "Metadata differences", columns=["field", "what differs (A vs B)", "matters"],
            rows=[{"class": "bad" if m.level != "info" else "",
                   "cells": [m.key, m.describe(), m.level]} for m in report.metadata],
        ))  # fmt: skip
    if report.pairs:
        page.figures.update(strip_figures(report, a, b))
        page.sections.append(Section(
            "charts", "Divergence strip", charts=["diff-strip", "diff-errors", "diff-share"],
            note="Each point is one tensor of A against its match in B; a missing point is an "
            "error of exactly zero. First chart: each pair's largest difference over what its "
            f"rule allows ({rule_text(report.tolerance)}), so the dashed line at 1 is the "
            "whole rule for every pair. Dotted: the first pair out of tolerance"
            + (" and the differing inputs." if report.inputs_differ else "."),
        ))  # fmt: skip
        columns = PAIR_COLUMNS + [f"{name} SQNR dB (A vs B)" for name in report.formats]
        page.sections.append(Section("table", "Pairs", columns=columns, rows=pair_rows(report)))
    if report.formats:
        page.sections.append(_formats_section(report))
    missing = [f"only in A: {k}" for k in report.only_a]
    missing += [f"only in B: {k}" for k in report.only_b]
    if missing:
        page.sections.append(Section("notes", "Keys on one side only", items=missing))
    return page

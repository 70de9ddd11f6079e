"""The diff page: the verdict and metadata differences on top, then the divergence strip along
the execution order (errors on a log scale, the tolerance drawn, the first divergence marked,
both sides' statistics on hover) and the table of pairs."""

from __future__ import annotations

from typing import Any

from modeltap.diff import DiffReport, Pair
from modeltap.dump import Dump, load_dump
from modeltap.render.report.page import OKABE_ITO, Page, Section, fmt, layout, positive
from modeltap.stats import TensorStats

PAIR_COLUMNS = ["key (A)", "key (B)", "status", "max |a−b|", "max rel", "max |a−b| / max |b|",
                "cosine", "out of tolerance"]  # fmt: skip


def _side(name: str, stats: TensorStats | None) -> str:
    if stats is None:
        return f"{name}: no statistics"
    values = ", ".join(f"{n} {fmt(getattr(stats, n))}" for n in ("norm", "mean", "std", "absmax"))
    return f"{name}: {values}"


def _hover(pair: Pair, a: Dump, b: Dump) -> str:
    lines = [pair.key if pair.key == pair.other else f"{pair.key} ↔ {pair.other}",
             f"status {pair.status}; max rel {fmt(pair.max_rel)}; cosine {fmt(pair.cosine)}",
             _side("A", a.stats_for(pair.key)), _side("B", b.stats_for(pair.other))]  # fmt: skip
    return "<br>".join(lines)


def strip_figures(report: DiffReport, a: Dump, b: Dump, prefix: str = "diff") -> dict[str, Any]:
    """Errors per pair in execution order: the divergence strip and the share out of tolerance."""
    pairs = report.pairs
    x = list(range(len(pairs)))
    hover = [_hover(p, a, b) for p in pairs]
    first = report.first_divergence
    marks: list[dict[str, Any]] = []
    notes: list[dict[str, Any]] = []
    if first is not None:
        at = pairs.index(first)
        marks.append(
            {
                "type": "line",
                "xref": "x",
                "yref": "paper",
                "x0": at,
                "x1": at,
                "y0": 0,
                "y1": 1,
                "line": {"color": OKABE_ITO[3], "width": 2, "dash": "dot"},
            }
        )
        notes.append({"x": at, "y": 1, "xref": "x", "yref": "paper", "showarrow": False,
                      "text": f"first divergence: {first.key}", "xanchor": "left",
                      "font": {"color": OKABE_ITO[3]}})  # fmt: skip
    rtol = report.tolerance.rtol
    marks.append(
        {
            "type": "line",
            "xref": "paper",
            "yref": "y",
            "x0": 0,
            "x1": 1,
            "y0": rtol,
            "y1": rtol,
            "line": {"color": OKABE_ITO[7], "width": 1, "dash": "dash"},
        }
    )
    notes.append(
        {
            "x": 1,
            "y": rtol,
            "xref": "paper",
            "yref": "y",
            "showarrow": False,
            "text": f"rtol = {rtol:g}",
            "xanchor": "right",
            "yanchor": "bottom",
        }
    )
    series = [
        ("max |a−b| / max |b|", [positive(p.max_scaled) for p in pairs], "lines+markers"),
        ("max relative error", [positive(p.max_rel) for p in pairs], "lines+markers"),
        ("1 − cosine", [positive(None if p.cosine is None else 1 - p.cosine) for p in pairs],
         "lines+markers"),
    ]  # fmt: skip
    data = [
        {"type": "scatter", "mode": mode, "name": name, "x": x, "y": y, "hovertext": hover,
         "hoverinfo": "text+name", "marker": {"size": 5}, "line": {"width": 1.5}}
        for name, y, mode in series
    ]  # fmt: skip
    failed = [i for i, p in enumerate(pairs) if not p.ok]
    if failed:
        data.append({"type": "scatter", "mode": "markers", "name": "out of tolerance",
                     "x": failed, "y": [series[0][1][i] for i in failed],
                     "hovertext": [hover[i] for i in failed], "hoverinfo": "text+name",
                     "marker": {"symbol": "x", "size": 10, "color": OKABE_ITO[3]}})  # fmt: skip
    share = [None if p.out_fraction is None else 100.0 * p.out_fraction for p in pairs]
    return {
        f"{prefix}-strip": {"data": data, "layout": layout(
            "Divergence along the execution order (A against B, B the reference)",
            "execution order (index of the pair; hover for keys and both sides' statistics)",
            "error (dimensionless, log scale)", log_y=True, shapes=marks, annotations=notes,
            height=380)},
        f"{prefix}-share": {"data": [{
            "type": "bar", "name": "share out of tolerance", "x": x, "y": share, "hovertext": hover,
            "hoverinfo": "text+y", "marker": {"color": OKABE_ITO[1]}}],
            "layout": layout("Elements out of tolerance per pair", "execution order",
                             "elements out of tolerance (%)", shapes=marks[:1], height=260)},
    }  # fmt: skip


def pair_rows(report: DiffReport) -> list[dict[str, Any]]:
    return [
        {"class": "" if p.ok else "bad", "cells": [
            p.key, p.other if p.other != p.key else "", p.status, fmt(p.max_abs), fmt(p.max_rel),
            fmt(p.max_scaled), fmt(p.cosine),
            "" if p.out_fraction is None else f"{100 * p.out_fraction:.3g}%"]}
        for p in report.pairs
    ]  # fmt: skip


def diff_summary(report: DiffReport) -> list[tuple[str, str, str]]:
    first = report.first_divergence
    failed = len(report.failed)
    return [
        ("verdict", "PASS" if report.passed else "FAIL", "ok" if report.passed else "bad"),
        ("A", str(report.a), ""),
        ("B (reference)", str(report.b), ""),
        ("tolerance", report.tolerance.describe(), ""),
        ("compared", f"{len(report.pairs)} pairs, {failed} out of tolerance",
         "bad" if failed else "ok"),
        ("first divergence", first.key if first else "none", "bad" if first else ""),
        ("only in A / only in B", f"{len(report.only_a)} / {len(report.only_b)}",
         "warn" if report.only_a or report.only_b else ""),
    ]  # fmt: skip


def diff_page(report: DiffReport, *, command: str = "") -> Page:
    """The page of `modeltap diff A B` (or `modeltap report A B`)."""
    a, b = load_dump(report.a), load_dump(report.b)
    page = Page(f"modeltap diff: {report.a.name} against {report.b.name}", "diff", command=command)
    page.summary = diff_summary(report)
    if report.metadata:
        page.sections.append(Section(
            "table", "Metadata differences", columns=["field", "A", "B", "matters"],
            rows=[{"class": "bad" if m.level != "info" else "",
                   "cells": [m.key, m.a or "", m.b or "", m.level]} for m in report.metadata],
        ))  # fmt: skip
    if report.pairs:
        page.figures.update(strip_figures(report, a, b))
        page.sections.append(Section(
            "charts", "Divergence strip", charts=["diff-strip", "diff-share"],
            note="Each point is one tensor of A against its match in B; a missing point is an "
            "error of exactly zero. Dashed: rtol; dotted: the first pair out of tolerance.",
        ))  # fmt: skip
        page.sections.append(
            Section("table", "Pairs", columns=PAIR_COLUMNS, rows=pair_rows(report))
        )
    missing = [f"only in A: {k}" for k in report.only_a]
    missing += [f"only in B: {k}" for k in report.only_b]
    if missing:
        page.sections.append(Section("notes", "Keys on one side only", items=missing))
    return page

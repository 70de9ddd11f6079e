"""The run page: heatmaps of step x module (output norm, gradient norm, dead share; log colour
scales), a rank selector, rank x module for one step (which rank drifts), rule hits and tripwire
events on the time axis, and update-ratio curves per parameter. What does not fit is reduced
(the largest value of each group of steps or modules) and the page says so."""

from __future__ import annotations

import math
from typing import Any

from modeltap.dump import GRAD_PREFIX
from modeltap.record.index import RunIndex, step_formats
from modeltap.render.report.format_figures import first_crossings, sqnr_heatmap
from modeltap.render.report.page import (
    HEATMAP_SCALE,
    OKABE_ITO,
    Page,
    Section,
    finite,
    fmt,
    layout,
    positive,
)

# Columns (steps) and rows (modules) a heatmap shows at most; more are reduced to the largest
# value of each group, so that no spike disappears.
MAX_STEPS = 250
MAX_MODULES = 200
# Update-ratio curves drawn at most (the parameters with the largest ratios).
MAX_CURVES = 30
# Steps offered in the rank x module view (the last, those with events, then evenly spaced).
MAX_RANK_STEPS = 40
# Blue-white-orange, readable with every common colour-vision deficiency.
DIVERGING = [[0.0, "#0072B2"], [0.5, "#f7f7f7"], [1.0, "#E69F00"]]

_HEATMAPS = [
    ("norm", "Output norm", "log₁₀ ‖output‖₂", False, True),
    ("norm", "Gradient norm", "log₁₀ ‖gradient‖₂", True, True),
    ("dead", "Dead units", "dead units (%)", False, False),
]


def _groups(count: int, limit: int) -> list[tuple[int, int]]:
    """[start, end) groups of consecutive indices, at most `limit` of them."""
    size = max(1, math.ceil(count / limit))
    return [(i, min(count, i + size)) for i in range(0, count, size)]


def _largest(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _keys(steps: list[dict[str, Any]], gradients: bool) -> list[str]:
    seen: dict[str, None] = {}
    for step in steps:
        for key in step.get("keys", {}):
            if key.startswith(GRAD_PREFIX) == gradients:
                seen.setdefault(key, None)
    return list(seen)


def _matrix(steps: list[dict[str, Any]], keys: list[str], field: str, log: bool) -> Any:
    """[key, step] values of `field` as float64, NaN where missing or not finite (log10 of the
    positive ones when `log`; dead shares in percent)."""
    import numpy as np

    row = {k: i for i, k in enumerate(keys)}
    values = np.full((len(keys), len(steps)), np.nan)
    for column, step in enumerate(steps):
        for key, entry in step.get("keys", {}).items():
            i = row.get(key)
            value = entry.get(field) if i is not None else None
            if value is not None:
                values[i, column] = value
    with np.errstate(all="ignore"):
        if field == "dead":
            values *= 100.0
        if log:
            values = np.log10(np.where(values > 0, values, np.nan))
    values[~np.isfinite(values)] = np.nan
    return values


def _reduced(values: Any, rows: list[tuple[int, int]], columns: list[tuple[int, int]]) -> list:
    """The largest value of each [row group, column group] (NaN ignored), rounded to 5 decimals
    (enough for a colour and a hover; half the bytes), None where a group holds none."""
    import numpy as np

    if not values.size:
        return []
    out = np.fmax.reduceat(values, [r0 for r0, _ in rows], axis=0)
    out = np.fmax.reduceat(out, [c0 for c0, _ in columns], axis=1)
    return np.where(np.isnan(out), None, np.round(out, 5)).tolist()


def _log_colorbar(title: str, z: list[list[float | None]]) -> dict[str, Any]:
    """A colour bar over log10 values, ticked in the values themselves: every decade in the
    data's range, or 1-2-5 (then every digit) within it when that gives fewer than three."""
    present = [v for row in z for v in row if v is not None]
    bar: dict[str, Any] = {"title": {"text": title}}
    if not present:
        return bar
    low, high = min(present), max(present)
    ticks: list[float] = []
    for mantissas in ((1,), (1, 2, 5), tuple(range(1, 10))):
        ticks = [
            math.log10(m) + e
            for e in range(math.floor(low), math.ceil(high) + 1)
            for m in mantissas
            if low - 1e-9 <= math.log10(m) + e <= high + 1e-9
        ]
        if len(ticks) >= 3 or mantissas[-1] == 9:
            break
    if len(ticks) > 12:
        ticks = [t for t in ticks if abs(t - round(t)) < 1e-9]  # decades only
        ticks = ticks[:: max(1, math.ceil(len(ticks) / 12))]
    if len(ticks) < 2:  # all within one digit: the ends of the range
        ticks = sorted({low, high})
    bar.update(tickvals=ticks, ticktext=[f"{10**t:.3g}" for t in ticks])
    return bar


def _step_axis(steps: list[int], *, cells: bool) -> dict[str, Any]:
    """The training-step axis: only the recorded range (a heatmap's cells half a step beyond),
    each recorded step ticked when they are few."""
    axis: dict[str, Any] = {"title": {"text": "training step"}, "automargin": True}
    if not steps:
        return axis
    half = (steps[1] - steps[0]) / 2 if cells and len(steps) > 1 else (0.5 if cells else 0)
    if len(steps) > 1 or cells:
        axis["range"] = [steps[0] - half, steps[-1] + half]
    if len(steps) <= 20:
        axis.update(tickmode="array", tickvals=steps, ticktext=[str(s) for s in steps])
    return axis


def _heatmap(run: RunIndex, rank: int, spec: tuple, events: dict[str, Any]) -> dict[str, Any]:
    field, title, unit, gradients, log = spec
    steps = sorted(run.ranks[rank].steps, key=lambda s: s["step"])
    keys = events["keys"][gradients]
    columns = _groups(len(steps), MAX_STEPS)
    rows = _groups(len(keys), MAX_MODULES)
    z = _reduced(_matrix(steps, keys, field, log), rows, columns)
    x = [steps[c0]["step"] for c0, _ in columns]
    y = [keys[r0] if r1 - r0 == 1 else f"{keys[r0]} … (+{r1 - r0 - 1})" for r0, r1 in rows]
    data: list[dict[str, Any]] = [{
        "type": "heatmap", "x": x, "y": y, "z": z, "colorscale": HEATMAP_SCALE,
        "colorbar": _log_colorbar(unit.replace("log₁₀ ", "") + " (log scale)", z) if log
        else {"title": {"text": unit}},
        "hovertemplate": "step %{x}<br>%{y}<br>" + unit + " %{z:.3g}<extra></extra>",
        "hoverongaps": False,
    }]  # fmt: skip
    hits = [h for h in events["hits"] if h.get("rank") == rank and h.get("key") in keys]
    if hits:
        row_of = {keys[r]: y[i] for i, (r0, r1) in enumerate(rows) for r in range(r0, r1)}
        data.append({
            "type": "scatter", "mode": "markers", "name": "rule hit",
            "x": [h["step"] for h in hits], "y": [row_of[h["key"]] for h in hits],
            "hovertext": [f"{h.get('rule')}: {h.get('message', '')}" for h in hits],
            "hoverinfo": "text", "marker": {"symbol": "x", "size": 9, "color": OKABE_ITO[3]},
        })  # fmt: skip
    shapes = [{"type": "line", "xref": "x", "yref": "paper", "x0": t["step"], "x1": t["step"],
               "y0": 0, "y1": 1, "line": {"color": OKABE_ITO[3], "width": 2, "dash": "dot"}}
              for t in run.ranks[rank].trips]  # fmt: skip
    height = max(320, min(1100, 14 * len(y) + 120))
    return {"data": data, "layout": layout(
        f"{title} per step and module, rank {rank}", "training step", "module (execution order)",
        height=height, shapes=shapes, showlegend=False, xaxis=_step_axis(x, cells=True),
        yaxis={"autorange": "reversed", "automargin": True, "type": "category",
               "title": {"text": "module (execution order)"}},
    )}  # fmt: skip


def _updates(run: RunIndex, rank: int) -> tuple[dict[str, Any], str]:
    steps = sorted(run.ranks[rank].steps, key=lambda s: s["step"])
    columns = _groups(len(steps), MAX_STEPS)
    names: dict[str, float] = {}
    for step in steps:
        for name, value in (step.get("updates") or {}).items():
            v = finite(value)
            if v is not None:
                names[name] = max(names.get(name, 0.0), v)
    chosen = sorted(names, key=lambda n: -names[n])[:MAX_CURVES]
    data = []
    for i, name in enumerate(chosen):
        y = [positive(_largest([finite((steps[c].get("updates") or {}).get(name))
                                for c in range(c0, c1)])) for c0, c1 in columns]  # fmt: skip
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": name,
                "x": [steps[c0]["step"] for c0, _ in columns],
                "y": y,
                "line": {"width": 1.2, "color": OKABE_ITO[i % len(OKABE_ITO)]},
            }
        )
    note = ""
    if len(names) > len(chosen):
        note = f"{len(chosen)} of {len(names)} parameters shown: those with the largest ratios."
    figure = {"data": data, "layout": layout(
        f"Update ratio per parameter, rank {rank}", "training step",
        "‖Δw‖ / ‖w‖ per step (log scale)", log_y=True, height=380,
        legend={"font": {"size": 10}},
        xaxis=_step_axis([steps[c0]["step"] for c0, _ in columns], cells=False))}  # fmt: skip
    return figure, note


def _rank_figure(run: RunIndex, step: int, keys: list[str]) -> dict[str, Any]:
    """Each rank's output norm at one step relative to the mean over ranks, in percent."""
    ranks = list(run.ranks)
    rows = _groups(len(keys), MAX_MODULES)
    norms = {}
    for rank in ranks:
        entry = run.ranks[rank].step(step) or {}
        norms[rank] = [finite((entry.get("keys", {}).get(k) or {}).get("norm")) for k in keys]
    z = []
    for rank in ranks:
        line = []
        for r0, r1 in rows:
            drift = []
            for k in range(r0, r1):
                values = [norms[q][k] for q in ranks if norms[q][k] is not None]
                mean = sum(values) / len(values) if values else None
                own = norms[rank][k]
                if own is not None and mean:
                    drift.append(100.0 * (own - mean) / mean)
            line.append(max(drift, key=abs) if drift else None)
        z.append(line)
    present = [abs(v) for row in z for v in row if v is not None]
    bound = max(present, default=1.0) or 1.0
    x = [keys[r0] if r1 - r0 == 1 else f"{keys[r0]} … (+{r1 - r0 - 1})" for r0, r1 in rows]
    return {"data": [{
        "type": "heatmap", "x": x, "y": [f"rank {r}" for r in ranks], "z": z,
        "colorscale": DIVERGING, "zmin": -bound, "zmax": bound,
        "colorbar": {"title": {"text": "norm vs mean over ranks (%)"}},
        "hovertemplate": "%{y}<br>%{x}<br>%{z:.3g}% from the mean<extra></extra>",
    }], "layout": layout(
        f"Which rank drifts: output norm against the mean over ranks, step {step}",
        "module (execution order)", "rank", height=max(260, 40 * len(ranks) + 160),
        xaxis={"type": "category", "tickangle": -45, "automargin": True,
               "title": {"text": "module (execution order)"}},
    )}  # fmt: skip


def _trip_text(trip: dict[str, Any]) -> str:
    """One line for a tripwire event of the index (which stores its fields, not its message)."""
    how = "came in from outside" if trip.get("propagated") else "appeared"
    return (
        f"step {trip['step']} rank {trip.get('rank', 0)}: non-finite {trip.get('phase', '')} "
        f"{how} at {trip.get('module', '?')} ({trip.get('key', '?')})"
    )


def run_page(run: RunIndex, *, command: str = "") -> Page:
    """The page of a run folder written by `modeltap.record`."""
    page = Page(f"modeltap run: {run.folder}", "run", command=command)
    ranks = list(run.ranks)
    all_steps = sorted({s["step"] for r in run.ranks.values() for s in r.steps})
    first = run.ranks[ranks[0]]
    events = {
        "hits": run.hits,
        "keys": {g: _keys([s for r in run.ranks.values() for s in r.steps], g)
                 for g in (False, True)},
    }  # fmt: skip
    trips = [t for r in run.ranks.values() for t in r.trips]
    page.summary = [
        ("folder", str(run.folder), ""),
        ("ranks", ", ".join(map(str, ranks)), ""),
        ("recorded steps", f"{len(all_steps)} ({all_steps[0]} to {all_steps[-1]})"
         if all_steps else "none", ""),
        ("modules", str(len(events["keys"][False])), ""),
        ("every", str(first.start.get("every", "?")), ""),
        ("rule hits", str(len(run.hits)), "warn" if run.hits else "ok"),
        ("tripwire", "; ".join(_trip_text(t) for t in trips)
         or "none", "bad" if trips else "ok"),
    ]  # fmt: skip
    if not all_steps:
        page.sections.append(
            Section("notes", "Nothing recorded yet", items=["The index holds no recorded step."])
        )
        return page
    update_note = _step_module_section(page, run, events)
    _formats_section(page, run)
    if len(ranks) > 1 and events["keys"][False]:
        _rank_section(page, run, all_steps, trips, events["keys"][False])
    if update_note is not None:
        page.sections.append(
            Section("charts", "Update ratios", charts=["run-updates"], note=update_note)
        )
    if run.hits or trips:
        _events_section(page, run, trips)
    return page


def _reduced_notes(run: RunIndex, events: dict[str, Any]) -> list[str]:
    """What the heatmaps reduce to fit: steps into columns, modules or gradient keys into rows."""
    reduced = []
    longest = max(len(r.steps) for r in run.ranks.values())
    if longest > MAX_STEPS:
        size = math.ceil(longest / MAX_STEPS)
        reduced.append(f"{longest} steps shown as {math.ceil(longest / size)} columns: each the "
                       f"largest value of {size} consecutive recorded steps")  # fmt: skip
    for gradients in (False, True):
        count = len(events["keys"][gradients])
        if count > MAX_MODULES:
            size = math.ceil(count / MAX_MODULES)
            what = "gradient keys" if gradients else "modules"
            reduced.append(
                f"{count} {what} shown as {math.ceil(count / size)} rows: each the "
                f"largest value of {size} neighbours in execution order"
            )
    return reduced


def _step_module_section(page: Page, run: RunIndex, events: dict[str, Any]) -> str | None:
    """The step × module heatmaps of the first rank, the update ratios' figure, and each other
    rank's as variants to choose from; returns the update ratios' note, None without them."""
    ranks = list(run.ranks)
    first = run.ranks[ranks[0]]
    reduced = _reduced_notes(run, events)
    charts = []
    options: dict[str, dict[str, Any]] = {str(r): {} for r in ranks}
    for spec in _HEATMAPS:
        gradients = spec[3]
        if not events["keys"][gradients]:
            continue
        if spec[0] == "dead" and not any("dead" in v for s in first.steps
                                         for v in s.get("keys", {}).values()):  # fmt: skip
            continue
        chart = f"run-{spec[0]}-{'grad' if gradients else 'out'}"
        page.figures[chart] = _heatmap(run, ranks[0], spec, events)
        for rank in ranks[1:]:
            options[str(rank)][chart] = _heatmap(run, rank, spec, events)
        charts.append(chart)
    update, update_note = _updates(run, ranks[0])
    if update["data"]:
        page.figures["run-updates"] = update
        for rank in ranks[1:]:
            options[str(rank)]["run-updates"] = _updates(run, rank)[0]
    # The first rank's figures are the page's own (null: draw them again), not a second copy.
    options[str(ranks[0])] = dict.fromkeys([*charts, *(["run-updates"] if update["data"] else [])])
    if len(ranks) > 1:
        page.variants["rank"] = options
    select = None
    if len(ranks) > 1:
        select = {
            "id": "rank-select",
            "label": "Rank: ",
            "variants": "rank",
            "options": [(str(r), f"rank {r}") for r in ranks],
            "selected": str(ranks[0]),
        }
    page.sections.append(Section(
        "charts", "Step × module", charts=charts, select=select,
        note=" ".join([
            "Colour: cividis on a log₁₀ scale for norms; empty cells were not recorded or not "
            "finite. × marks a rule hit, a dotted line a tripwire event.",
            *(f"Reduced to fit: {r}." for r in reduced)]),
    ))  # fmt: skip
    return update_note if update["data"] else None


def _rank_section(
    page: Page, run: RunIndex, all_steps: list[int], trips: list[dict[str, Any]], keys: list[str]
) -> None:
    """Rank × module at one step, for the last step, those with events and evenly spaced ones."""
    marked = {h["step"] for h in run.hits} | {t["step"] for t in trips}
    chosen = [all_steps[-1], *sorted(marked)]
    for s in all_steps[:: max(1, len(all_steps) // MAX_RANK_STEPS)]:
        chosen.append(s)
    chosen = list(dict.fromkeys(chosen))[:MAX_RANK_STEPS]
    page.variants["rank-step"] = {str(s): {"run-ranks": _rank_figure(run, s, keys)}
                                  for s in chosen}  # fmt: skip
    page.figures["run-ranks"] = page.variants["rank-step"][str(chosen[0])]["run-ranks"]
    page.sections.append(Section(
        "charts", "Rank × module at one step", charts=["run-ranks"],
        select={"id": "step-select", "label": "Step: ", "variants": "rank-step",
                "options": [(str(s), f"step {s}") for s in chosen],
                "selected": str(chosen[0])},
        note="Blue: below the mean over ranks; orange: above. Steps offered: the last, those "
        "with rule hits or tripwire events, and evenly spaced ones.",
    ))  # fmt: skip


def _events_section(page: Page, run: RunIndex, trips: list[dict[str, Any]]) -> None:
    """The tripwire events and rule hits, one row each."""
    rows = [{"class": "bad", "cells": ["tripwire", t["step"], "", t.get("module", ""),
                                       t.get("phase", ""), _trip_text(t)]}
            for t in trips]  # fmt: skip
    rows += [{"class": "", "cells": [h.get("rule", ""), h.get("step", ""), h.get("rank", ""),
                                     h.get("key", ""), fmt(h.get("value")),
                                     h.get("message", "")]}
             for h in run.hits]  # fmt: skip
    page.sections.append(Section("table", "Events", rows=rows,
                                 columns=["event", "step", "rank", "key", "value",
                                          "message"]))  # fmt: skip


def _formats_section(page: Page, run: RunIndex) -> None:
    """With `record(..., formats=[...])`: per format a step x key heatmap of SQNR (the first
    rank's), and per rank the first step each key falls below each threshold."""
    from modeltap.diff.formats import thresholds
    from modeltap.render.tables import db_text

    read = {rank: step_formats(run, rank) for rank in run.ranks}
    first_rank = next(iter(run.ranks))
    formats, steps = read[first_rank]
    if not formats:
        return
    limits = thresholds()
    keys = list(dict.fromkeys(k for _, by_key in steps for k in by_key))
    columns, rows = _groups(len(steps), MAX_STEPS), _groups(len(keys), MAX_MODULES)
    x = [steps[c0][0] for c0, _ in columns]
    y = [keys[r0] if r1 - r0 == 1 else f"{keys[r0]} … (+{r1 - r0 - 1})" for r0, r1 in rows]
    charts = []
    for name in formats:
        chart = f"run-formats-{name}"
        cells = [[_lowest(steps, keys, name, r, c) for c in columns] for r in rows]
        page.figures[chart] = sqnr_heatmap(
            x, y, cells, title=f"{name}: SQNR per step and key, rank {first_rank}",
            x_title="training step", y_title="key (recorded order)",
            x_axis=_step_axis(x, cells=True),
        )  # fmt: skip
        charts.append(chart)
    reduced = len(columns) < len(steps) or len(rows) < len(keys)
    page.sections.append(Section(
        "charts", "Low-precision formats per step", charts=charts,
        note=f"SQNR in dB of quantizing each recorded tensor (activations, gradients `grad/...`) "
        f"in each format: vermillion below {limits['bad']:g} dB, yellow below "
        f"{limits['warn']:g} dB, blue above, as the dump tree colours them."
        + (" Reduced to fit: each cell the lowest of its group." if reduced else ""),
    ))  # fmt: skip
    table = []
    for rank, (names, rank_steps) in read.items():
        for row in first_crossings(names, rank_steps):
            warn, bad = row["warn"], row["bad"]
            table.append({"class": "bad" if bad else "warn", "cells": [
                rank, row["key"], row["format"], warn["step"], db_text(warn["sqnr_db"]),
                "" if bad is None else bad["step"],
                "" if bad is None else db_text(bad["sqnr_db"]),
                db_text(row["first_db"]), db_text(row["last_db"])]})  # fmt: skip
    page.summary.append((
        "formats", f"{', '.join(formats)}: {len(table)} key/format pairs fall below "
        f"{limits['warn']:g} dB SQNR" + (f", first at step {min(r['cells'][3] for r in table)}"
                                         if table else ""),
        "warn" if table else "ok",
    ))  # fmt: skip
    page.sections.append(Section(
        "table", "First step below a threshold", rows=table,
        columns=["rank", "key", "format", f"first step < {limits['warn']:g} dB", "SQNR then",
                 f"first step < {limits['bad']:g} dB", "SQNR then", "SQNR, first step",
                 "SQNR, last step"],
        note="Each key and format whose SQNR falls below a threshold at some recorded step, "
        "in the order they first do.",
    ))  # fmt: skip


def _lowest(
    steps: list[tuple[int, dict[str, Any]]], keys: list[str], name: str,
    rows: tuple[int, int], columns: tuple[int, int],
) -> float | None | str:
    """The lowest SQNR of `name` over a group of keys and steps: None when every one is exact,
    "" when none has a figure."""
    found = [f for c in range(*columns) for r in range(*rows)
             if (f := steps[c][1].get(keys[r], {}).get(name)) is not None]  # fmt: skip
    if not found:
        return ""
    values = [f["sqnr_db"] for f in found if f.get("sqnr_db") is not None]
    return min(values) if values else None

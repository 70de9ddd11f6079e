"""The compare page: per module the local error (introduced by its own code, from the replay)
beside the cumulative error (inherited from upstream, from the diff), origins highlighted, the
module tree coloured by local error, and the replay notes. Built from the report's JSON form, so
`compare --html` and `modeltap report compare.json` draw the same page."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from modeltap.compare.report import REPORT_SCHEMA as COMPARE_SCHEMA  # the one this page reads
from modeltap.errors import InputError, first_line
from modeltap.render.report.page import OKABE_ITO, Page, Section, cividis, fmt, layout, positive
from modeltap.render.tree import _module_tree, _Node, _relative

TREE_COLUMNS = ["module", "verdict", "local error", "cumulative error", "replay", "note"]
# What `compare --generate N --json` prints (compare/generate.py): a page of its own.
GENERATE_SCHEMA = "modeltap.compare-generate/1"


def read_compare_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The report that `modeltap compare --json` printed, checked for its schema version."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(
            f"'{p}' is not a readable JSON file ({first_line(exc)}); give the output of "
            "`modeltap compare --json`"
        ) from None
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema not in (COMPARE_SCHEMA, GENERATE_SCHEMA):
        raise InputError(
            f"'{p}' has report schema {schema!r}, not {COMPARE_SCHEMA!r} or {GENERATE_SCHEMA!r} "
            "that this modeltap reads; write it again with this modeltap's `compare --json`"
        )
    return data


def _tokens(ids: Any, row: int) -> list[Any]:
    """Row `row` of a batch of new ids (a list of lists), or the list itself."""
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return ids[row] if row < len(ids) else []
    return ids if isinstance(ids, list) else []


def compare_generate_page(data: dict[str, Any], *, command: str = "") -> Page:
    """The page of `compare --generate N --json`: the verdict and both texts, a table of every
    step (both sides' tokens, the step's diff, flips and near ties), and, where a step was
    attributed, that step's compare page below."""
    passed = bool(data.get("passed"))
    steps = (data.get("steps") or {}).get("steps", [])
    departures = {(d["step"], d["row"]): d for d in data.get("departures", [])}
    ties = {(t["step"], t["row"]) for t in data.get("ties", [])}
    attribution = data.get("attribution")
    reference = data.get("reference") or (attribution or {}).get("reference", {})
    candidate = data.get("candidate") or (attribution or {}).get("candidate", {})
    page = Page(f"modeltap compare --generate: {reference.get('model', '?')}", "compare",
                command=command)  # fmt: skip
    first = (data.get("steps") or {}).get("first_divergence")
    failed_flip = next((d for d in data.get("departures", []) if not d.get("within_precision")),
                       None)  # fmt: skip

    def joined(value: Any) -> str:
        return " | ".join(map(str, value)) if isinstance(value, list) else str(value or "")

    page.summary = [
        ("verdict", "PASS" if passed else "FAIL", "ok" if passed else "bad"),
        ("reference", ", ".join(f"{k} {v}" for k, v in reference.items()), ""),
        ("candidate", ", ".join(f"{k} {v}" for k, v in candidate.items()), ""),
        ("reference text", joined(data.get("reference_text")), ""),
        ("candidate text", joined(data.get("candidate_text")), ""),
        ("steps compared", str(len(steps)), ""),
        ("first step out of tolerance",
         "none" if not first else f"step {first['step']}, {first.get('key')}",
         "bad" if first else "ok"),
        ("token flip", "none" if failed_flip is None else
         f"step {failed_flip['step']}, row {failed_flip['row']}", "bad" if failed_flip else "ok"),
        ("near ties (within precision)", str(len(ties)), "warn" if ties else ""),
    ]  # fmt: skip
    rows = []
    for step in steps:
        for row, (ta, tb) in enumerate(zip(step.get("token_a") or [None],
                                           step.get("token_b") or [None], strict=False)):
            flip = departures.get((step["step"], row))
            what = ""
            if flip is not None:
                what = ("near tie, within precision" if (step["step"], row) in ties
                        else "flip beyond the preset")  # fmt: skip
                what += (f": reference {flip.get('reference')} {flip.get('reference_text')!r} "
                         f"p {fmt(flip.get('p_reference'))}, candidate {flip.get('candidate')} "
                         f"{flip.get('candidate_text')!r} p {fmt(flip.get('p_candidate'))}")
            bad = step.get("failed") or (flip is not None and (step["step"], row) not in ties)
            rows.append({"class": "bad" if bad else "", "cells": [
                step["step"], row, "" if ta is None else ta, "" if tb is None else tb,
                f"{step.get('failed', 0)} / {step.get('compared', 0)}", fmt(step.get("max_abs")),
                step.get("first") or "", what,
            ]})  # fmt: skip
    page.sections.append(Section(
        "table", "Steps and tokens", rows=rows,
        columns=["step", "row", "reference token", "candidate token",
                 "out of tolerance / compared", "max |a−b|", "first key out", "flip"],
        note="The candidate is forced to the reference's tokens, so both sides run the same "
        "sequence; a flip is a step where the candidate's likeliest token differs.",
    ))  # fmt: skip
    if isinstance(attribution, dict) and attribution.get("modules"):
        inner = compare_page(attribution, command=command)
        step = data.get("attributed_step")
        page.figures.update(inner.figures)
        for section in inner.sections:
            section.title = f"Step {step}: {section.title}"
        page.sections += inner.sections
    return page


def _error(value: Any) -> float | None:
    return None if value is None else float(value)


def _tree_rows(modules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_name = {m["module"]: m for m in modules}
    errors = [positive(m.get("local_error")) for m in modules]
    logs = [math.log10(e) for e in errors if e is not None]
    low, high = (min(logs), max(logs)) if logs else (0.0, 0.0)
    rows: list[dict[str, Any]] = []

    def walk(nodes: list[_Node], parent: str | None, parent_id: str, depth: int) -> None:
        for node in nodes:
            m = by_name.get(node.module, {})
            local = _error(m.get("local_error"))
            style = ""
            if local is not None and local > 0 and math.isfinite(local):
                share = (math.log10(local) - low) / (high - low) if high > low else 1.0
                text = "#000" if share > 0.5 else "#fff"
                style = f"background: {cividis(share)}; color: {text}"
            elif local is not None and math.isinf(local):
                style = f"background: {cividis(1.0)}; color: #000"
            verdict = m.get("verdict", "")
            row_id = f"r{len(rows)}"
            rows.append({
                "id": row_id, "parent": parent_id, "depth": depth, "name": node.module,
                "label": _relative(node.module, parent) if parent is not None else node.module,
                "children": bool(node.children), "hist": None,
                "class": "origin" if verdict == "origin" else "",
                "cells": [verdict, fmt(local), fmt(_error(m.get("cumulative_error"))),
                          m.get("replay") or "", m.get("replay_note") or m.get("note") or ""],
                "styles": ["", style, "", "", ""],
            })  # fmt: skip
            walk(node.children, node.module, row_id, depth + 1)

    walk(_module_tree([m["module"] for m in modules]), None, "", 0)
    return rows


def _few(names: list[str], shown: int = 5) -> str:
    """The first names (largest local error first), and how many more the tree marks."""
    if not names:
        return "none"
    more = f" (+{len(names) - shown} more, bold in the tree)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def compare_page(data: dict[str, Any], *, command: str = "") -> Page:
    """The page of a compare report (`CompareReport.to_json()` or `compare --json` output)."""
    modules = data.get("modules", [])
    reference = data.get("reference", {})
    candidate = data.get("candidate", {})
    title = f"modeltap compare: {reference.get('model', '?')}"
    page = Page(title, "compare", command=command)
    origins = data.get("origins", [])
    passed = bool(data.get("passed"))
    page.summary = [
        ("verdict", "PASS" if passed else "FAIL", "ok" if passed else "bad"),
        ("reference", ", ".join(f"{k} {v}" for k, v in reference.items()), ""),
        ("candidate", ", ".join(f"{k} {v}" for k, v in candidate.items()), ""),
        ("preset", str(data.get("preset")), ""),
        ("origins", _few([o["module"] for o in origins]), "bad" if origins else "ok"),
        ("first divergence", str(data.get("first_divergence") or "none"), ""),
        ("modules", str(len(modules)), ""),
    ]
    worst_op = (data.get("ops") or {}).get("op")
    if worst_op:  # --ops: the op inside the worst origin
        page.summary.insert(5, ("op", f"{data['ops']['path']} at {worst_op['source']}", "bad"))
    x = [m["module"] for m in modules]
    local = [positive(m.get("local_error")) for m in modules]
    cumulative = [positive(m.get("cumulative_error")) for m in modules]
    hover = [f"{m['module']}<br>verdict {m.get('verdict')}<br>local {fmt(m.get('local_error'))}"
             f"<br>cumulative {fmt(m.get('cumulative_error'))}" for m in modules]  # fmt: skip
    origin_at = [i for i, m in enumerate(modules) if m.get("verdict") == "origin"]
    common = {"type": "bar", "x": x, "hovertext": hover, "hoverinfo": "text"}
    data_traces = [
        {**common, "name": "local error (introduced by the module's own code)", "y": local,
         "marker": {"color": OKABE_ITO[0]}},
        {**common, "name": "cumulative error (with what it inherited)", "y": cumulative,
         "marker": {"color": OKABE_ITO[1]}},
    ]  # fmt: skip
    if origin_at:
        data_traces.append({
            "type": "scatter", "mode": "markers", "name": "origin", "x": [x[i] for i in origin_at],
            "y": [local[i] for i in origin_at], "hoverinfo": "x+name",
            "marker": {"symbol": "star", "size": 14, "color": OKABE_ITO[3]},
        })  # fmt: skip
    page.figures["compare-errors"] = {"data": data_traces, "layout": layout(
        "Local against cumulative error per module (in the reference's order)",
        "module", "max |a−b| / max |b| (log scale)", log_y=True, barmode="group", height=420,
        xaxis={"type": "category", "automargin": True, "tickangle": -60,
               "tickfont": {"size": 9}, "title": {"text": "module"}},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right"},
    )}  # fmt: skip
    page.sections.append(Section(
        "charts", "Introduced or inherited", charts=["compare-errors"],
        note="Local error: the module replayed on the reference's inputs, each selected child "
        "returning the reference child's output on what the replay hands it. Cumulative error: "
        "its output in the full candidate run. A star marks an origin (local error out of "
        "tolerance).",
    ))  # fmt: skip
    page.sections.append(Section(
        "tree", "Module tree, coloured by local error", columns=TREE_COLUMNS,
        rows=_tree_rows(modules),
        note="The local-error cell is coloured on a log scale (cividis: dark = smallest, yellow "
        "= largest); origins are bold.",
    ))  # fmt: skip
    if data.get("bisect"):
        _bisect_sections(page, data["bisect"])
    if data.get("ops"):
        _ops_section(page, data["ops"])
    notes = []
    replay = data.get("replay", {})
    if replay.get("note"):
        notes.append(f"replay: {replay['note']}")
    notes += [f"{name}: replayed in full ({why})" for name, why in
              data.get("full_replay", {}).items()]  # fmt: skip
    notes += [f"{name}: not compared ({why})" for name, why in
              data.get("not_compared", {}).items()]  # fmt: skip
    notes += [f"warning: {w}" for w in data.get("warnings", [])]
    notes += [f"{m['module']}: {m['note']}" for m in modules if m.get("note")]
    if notes:
        page.sections.append(Section("notes", "Replay notes", items=notes))
    return page


def _ops_section(page: Page, found: dict[str, Any]) -> None:
    """`compare --ops`: every op of the worst origin with the error it introduces, worst marked."""
    worst = (found.get("op") or {}).get("key")
    rows = [{"class": "bad" if op["key"] == worst else "", "cells": [
        op["key"].rpartition("/")[2], op["op"], op.get("source") or "", fmt(op.get("error")),
        op.get("note") or "",
    ]} for op in found.get("ops", [])]  # fmt: skip
    page.sections.append(Section(
        "table", f"Ops inside {found.get('module')}", rows=rows,
        columns=["op", "torch function", "source line", "relative error", "note"],
        note="Each op run alone in the candidate's dtype and device from the reference's inputs "
        "to it: its error (L2, |candidate − reference| / |reference|) is its own.",
    ))  # fmt: skip


def _bisect_sections(page: Page, found: dict[str, Any]) -> None:
    """`compare --bisect`: the curve of output error against modules kept, and the set."""
    curve = found.get("curve", [])
    page.figures["compare-bisect"] = {"data": [{
        "type": "scatter", "mode": "lines+markers", "name": "output error",
        "x": [step["kept"] for step in curve],
        "y": [positive(step["output_error"]) for step in curve],
        "marker": {"color": [OKABE_ITO[2] if s["passed"] else OKABE_ITO[5] for s in curve]},
    }], "layout": layout(
        "Output error with the first k modules kept in high precision",
        "modules kept (largest local error first)",
        f"{found.get('output_error_measure', 'max |a - b| / max |b|')} (log scale)",
        log_y=True, height=340,
    )}  # fmt: skip
    kept = found.get("modules_to_not_convert", [])
    verdict = "passes" if found.get("passed") else "does not pass"
    page.sections.append(Section(
        "charts", "Fewest modules to keep in high precision", charts=["compare-bisect"],
        note=f"{len(kept)} module(s), {found.get('kept_share', 0):.2%} of the weights "
        f"{found.get('variant')} quantizes ({found.get('engine')}); the output {verdict} with "
        f"them kept, error {fmt(found.get('output_error'))}. Green: within "
        f"{'--target ' + found['target'] if found.get('target') else 'tolerance'}.",
    ))  # fmt: skip
    page.sections.append(Section(
        "notes", "modules_to_not_convert", items=kept or ["nothing needs keeping"]
    ))

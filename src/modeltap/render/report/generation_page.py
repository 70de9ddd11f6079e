"""The page of a generation dump (`modeltap generate`): the prompt and text, a table of every
step's chosen token with its probability and the runner-up, and the statistics along the
execution order of any step (a selector), stats-only steps included."""

from __future__ import annotations

from typing import Any

from modeltap.dump import GRAD_PREFIX, Dump
from modeltap.render.report.key_figures import line_figures
from modeltap.render.report.page import Page, Section, fmt

TOKEN_COLUMNS = ["step", "row", "token", "text", "p", "runner-up", "its text", "its p", "stored"]
# Steps offered in the selector at most (those with tensors first, then evenly spaced ones).
MAX_STEP_VIEWS = 64


def token_rows(gen: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per step and batch row (or beam): the token generate chose there and the
    runner-up; a field a step does not hold (a finished beam's padding) is left blank."""
    full = set(gen.get("full_steps", []))
    rows = []
    for step in gen.get("steps", []):

        def at(name: str, row: int, step: dict[str, Any] = step) -> Any:
            values = step.get(name) or []
            value = values[row] if row < len(values) else None
            return "" if value is None else value

        for row in range(len(step.get("token") or [])):
            rows.append({"class": "", "cells": [
                step["step"], row, at("token", row), at("text", row), fmt(at("p", row)),
                at("second", row), at("second_text", row), fmt(at("p_second", row)),
                "tensors" if step["step"] in full else "statistics",
            ]})  # fmt: skip
    return rows


def _offered(steps: list[int], full: set[int]) -> list[int]:
    if len(steps) <= MAX_STEP_VIEWS:
        return steps
    chosen = [s for s in steps if s in full][: MAX_STEP_VIEWS // 2]
    spaced = steps[:: max(1, len(steps) // (MAX_STEP_VIEWS - len(chosen)))]
    return sorted(set(chosen + spaced))[:MAX_STEP_VIEWS]


def generation_page(dump: Dump, gen: dict[str, Any], *, command: str = "") -> Page:
    from modeltap.generate import step_view, steps_of

    meta = dump.metadata
    page = Page(f"modeltap generate: {meta.get('model', dump.path.name)}", "dump", command=command)
    page.produced_with = {n: meta[v] for n, v in
                          (("modeltap", "modeltap_version"), ("torch", "torch"),
                           ("transformers", "transformers")) if v in meta}  # fmt: skip
    steps = steps_of(dump)
    full = set(gen.get("full_steps", []))
    prompt = gen.get("prompt")
    text = gen.get("text")
    page.summary = [
        ("file", str(dump.path), ""),
        ("model", meta.get("model", "?"), ""),
        ("prompt", " | ".join(prompt) if isinstance(prompt, list) else str(prompt or ""), ""),
        ("generated", " | ".join(text) if isinstance(text, list) else str(text or ""), ""),
        ("steps", f"{len(steps)} (0: the prompt's forward); tensors of "
         f"{', '.join(map(str, sorted(full))) or 'none'}, statistics of every step", ""),
        ("stopped", str(gen.get("stop", "?")), ""),
    ]  # fmt: skip
    page.sections.append(Section(
        "table", "Tokens", columns=TOKEN_COLUMNS, rows=token_rows(gen),
        note="Step k's forward chooses new token k + 1 (step 0: the prompt's); p is its "
        "probability, the runner-up the next likeliest token.",
    ))  # fmt: skip
    offered = _offered(steps, full)
    if not offered:
        return page
    options: dict[str, dict[str, Any]] = {}
    charts: list[str] = []
    for step in offered:
        view = step_view(dump, step)
        keys = [k for k in view.keys() if not k.startswith(GRAD_PREFIX)]
        figures = line_figures(view, keys, "gen", f"outputs, step {step}")
        if not charts:
            charts = list(figures)
            page.figures.update(figures)
            options[str(step)] = dict.fromkeys(charts)
            continue
        empty = {"data": [], "layout": {"title": {"text": f"not recorded at step {step}"}}}
        options[str(step)] = {c: figures.get(c, empty) for c in charts}
    page.variants["gen-step"] = options
    more = f" ({len(offered)} of {len(steps)} offered)" if len(offered) < len(steps) else ""
    page.sections.append(Section(
        "charts", "Statistics along the execution order, per step", charts=charts,
        select={"id": "step-select", "label": "Step: ", "variants": "gen-step",
                "options": [(str(s), f"step {s}" + (" (tensors)" if s in full else ""))
                            for s in offered], "selected": str(offered[0])},
        note=f"Every step has statistics; choose one{more}. `modeltap show FILE --step K` "
        "prints step K's tree.",
    ))  # fmt: skip
    return page

"""The dump page: the module tree with every statistic as a column, the statistics along the
execution order with blocks marked, NaN/Inf highlighted, and per-tensor value histograms."""

from __future__ import annotations

import json
from typing import Any

from modeltap.diff.formats import metadata_formats
from modeltap.dump import GRAD_PREFIX, Dump
from modeltap.render.report.format_figures import dump_formats_section
from modeltap.render.report.generation_page import generation_page
from modeltap.render.report.key_figures import axis_ticks, line_figures
from modeltap.render.report.page import (
    HEATMAP_SCALE,
    OKABE_ITO,
    Page,
    Section,
    fmt,
    layout,
)
from modeltap.render.tree import _module_tree, _Node, _relative
from modeltap.stats import HIST_EDGES, TensorStats

COLUMNS = ["module / key", "shape", "dtype", "norm", "mean", "std", "min", "max", "absmax",
           "dead units", "NaN", "Inf"]  # fmt: skip


def hist_labels() -> list[str]:
    """One label per bin of stats.HIST_EDGES, e.g. '[1e-06, 3.2e-06)'."""
    edges = [f"{e:.2g}" for e in HIST_EDGES]
    return [f"< {edges[0]}", *(f"[{a}, {b})" for a, b in zip(edges, edges[1:], strict=False)),
            f"≥ {edges[-1]}"]  # fmt: skip


def stats_cells(stats: TensorStats | None) -> list[str]:
    if stats is None:
        return [""] * (len(COLUMNS) - 1)
    dead = "" if stats.dead is None else f"{stats.dead}/{stats.units}"
    return [
        "×".join(map(str, stats.shape)) or "scalar",
        stats.dtype,
        *(fmt(getattr(stats, name)) for name in ("norm", "mean", "std", "min", "max", "absmax")),
        dead,
        fmt(stats.nan) if stats.nan else "",
        fmt(stats.inf) if stats.inf else "",
    ]


def tree_rows(dump: Dump, keys: list[str], hist_index: dict[str, int]) -> list[dict[str, Any]]:
    """Rows in tree order: each module under its nearest listed ancestor, a module's extra keys
    (parts, repeated calls) as its children."""
    rows: list[dict[str, Any]] = []

    def add(name: str, label: str, parent: str, depth: int, key: str | None, kids: bool) -> str:
        stats = dump.stats_for(key) if key is not None else None
        row_id = f"r{len(rows)}"
        bad = stats is not None and (stats.nan or stats.inf)
        rows.append({
            "id": row_id, "parent": parent, "depth": depth, "name": name, "label": label,
            "children": kids, "cells": stats_cells(stats), "class": "nonfinite" if bad else "",
            "hist": hist_index.get(key) if key is not None else None,
        })  # fmt: skip
        return row_id

    def walk(nodes: list[_Node], parent_name: str | None, parent_id: str, depth: int) -> None:
        for node in nodes:
            own = node.module if node.module in node.keys else None
            extra = [k for k in node.keys if k != node.module]
            label = _relative(node.module, parent_name) if parent_name is not None else node.module
            row_id = add(node.module, label, parent_id, depth, own, bool(extra or node.children))
            for key in extra:
                add(key, key[len(node.module) :], row_id, depth + 1, key, False)
            walk(node.children, node.module, row_id, depth + 1)

    walk(_module_tree(keys), None, "", 0)
    return rows


def _hist_trace(key: str, stats: TensorStats, labels: list[str]) -> dict[str, Any]:
    return {
        "type": "bar", "x": labels, "y": stats.hist, "name": key,
        "marker": {"color": OKABE_ITO[0]},
        "hovertemplate": "%{x}: %{y} values<extra></extra>",
    }  # fmt: skip


def hist_parts(dump: Dump, keys: list[str]) -> tuple[dict, dict, dict, dict[str, int]]:
    """(figures, variants, select, key -> option) for the histograms of `keys` that have one."""
    with_hist = [k for k in keys if (s := dump.stats_for(k)) is not None and s.hist is not None]
    if not with_hist:
        return {}, {}, {}, {}
    labels = hist_labels()
    index = {k: i for i, k in enumerate(with_hist)}
    options: dict[str, Any] = {}
    for key, i in index.items():
        stats = dump.stats_for(key)
        assert stats is not None and stats.hist is not None
        options[str(i)] = {"hist-one": {  # only what differs from the first (report.js)
            "data": [{"y": stats.hist, "name": key}],
            "layout": {"title": {"text": f"Values of {key}", "x": 0.01}},
        }}  # fmt: skip
    first = with_hist[0]
    first_stats = dump.stats_for(first)
    assert first_stats is not None
    one = layout(f"Values of {first}", "value bin (signed, log-spaced)", "values in the bin (log)",
                 log_y=True, height=360)  # fmt: skip
    counts = []
    for key in with_hist:
        stats = dump.stats_for(key)
        assert stats is not None and stats.hist is not None
        total = sum(stats.hist) or 1
        counts.append([100.0 * c / total if c else None for c in stats.hist])
    overview = {
        "data": [{
            "type": "heatmap", "x": labels, "y": with_hist, "z": counts,
            "colorscale": HEATMAP_SCALE, "colorbar": {"title": {"text": "% of values"}},
            "hovertemplate": "%{y}<br>%{x}: %{z:.3g}% of values<extra></extra>",
        }],
        "layout": layout(
            "Where the values lie, every tensor (row = key in execution order)",
            "value bin (signed, log-spaced)", "key (execution order; hover for its name)",
            height=max(360, min(900, 12 * len(with_hist))),
            yaxis={**axis_ticks(with_hist, "key (execution order; hover for its name)",
                                categories=True), "autorange": "reversed", "tickangle": 0},
        ),
    }  # fmt: skip
    figures = {
        "hist-one": {"data": [_hist_trace(first, first_stats, labels)], "layout": one},
        "hist-all": overview,
    }
    select = {
        "id": "hist-select", "label": "Tensor: ", "variants": "hist",
        "options": [(str(i), k) for k, i in index.items()], "selected": "0",
    }  # fmt: skip
    return figures, {"hist": options}, select, index


def dump_page(dump: Dump, *, command: str = "") -> Page:
    """The page of one dump (activations, gradients or both)."""
    from modeltap.errors import DumpFormatError

    if not dump.is_modeltap:
        raise DumpFormatError(
            f"'{dump.path}' is a safetensors file without modeltap's metadata; "
            "report a file written by `modeltap dump` (or `modeltap.record`)"
        )
    from modeltap.generate import generation_meta

    gen = generation_meta(dump)
    if gen is not None:
        return generation_page(dump, gen, command=command)
    keys = dump.keys()
    meta = dump.metadata
    page = Page(f"modeltap dump: {meta.get('model', dump.path.name)}", "dump", command=command)
    page.produced_with = {n: meta[v] for n, v in
                          (("modeltap", "modeltap_version"), ("torch", "torch"),
                           ("transformers", "transformers")) if v in meta}  # fmt: skip
    stats = [dump.stats_for(k) for k in keys]
    bad = [k for k, s in zip(keys, stats, strict=True) if s is not None and (s.nan or s.inf)]
    inputs = json.loads(meta.get("inputs", "{}") or "{}")
    shapes = inputs.get("shapes") if isinstance(inputs, dict) else None
    page.summary = [
        ("file", str(dump.path), ""),
        ("model", meta.get("model", "?"), ""),
        ("class", meta.get("model_class", "?"), ""),
        ("kind", meta.get("kind", "activations"), ""),
        ("keys", str(len(keys)), ""),
        ("dtype / device", f"{meta.get('dtype', '?')} / {meta.get('device', '?')}", ""),
        ("backend", meta.get("backend", "eager"), ""),
        ("stored", "statistics only" if dump.stats_only else "tensors and statistics", ""),
    ]
    if shapes:
        page.summary.append(("inputs", json.dumps(shapes), ""))
    page.summary.append(
        ("NaN/Inf", f"{len(bad)} keys, first: {bad[0]}" if bad else "none", "bad" if bad else "ok")
    )
    hist_index: dict[str, int] = {}
    figures, variants, select, hist_index = hist_parts(dump, keys)
    rows = tree_rows(dump, keys, hist_index)
    activations = [k for k in keys if not k.startswith(GRAD_PREFIX)]
    gradients = [k for k in keys if k.startswith(GRAD_PREFIX)]
    for group, prefix, what in ((activations, "act", "outputs"), (gradients, "grad", "gradients")):
        if not group:
            continue
        lines = line_figures(dump, group, prefix, what)
        page.figures.update(lines)
        page.sections.append(Section(
            "charts", f"Statistics along the execution order: {what}", charts=list(lines),
            note="Hover a point for the key and its statistics; zoom with the mouse, "
            "double-click to reset. A missing point is zero or not finite.",
        ))  # fmt: skip
    page.sections.insert(0, Section(
        "tree", "Module tree", columns=COLUMNS, rows=rows,
        note="Click ▾ (or Tab to it and press Enter) to collapse a module; the filter keeps "
        "matching rows and their parents. Rows with NaN/Inf are red."
        + (" Click a row to see its histogram below." if hist_index else ""),
    ))  # fmt: skip
    formats = metadata_formats(meta)
    if formats:
        stats_of = {k: s.formats for k, s in zip(keys, stats, strict=True) if s and s.formats}
        figure, section = dump_formats_section(formats, keys, stats_of)
        page.figures["formats-sqnr"] = figure
        page.sections.append(section)
    if figures:
        page.figures.update(figures)
        page.variants.update(variants)
        page.sections.append(Section(
            "charts", "Value histograms", charts=["hist-one", "hist-all"], select=select,
            note="43 fixed bins: signed magnitudes two a decade from 1e-6 to 1e4, the middle bin "
            "holding |x| < 1e-6 (zeros); NaN are counted apart. Written by `dump --hist`.",
        ))  # fmt: skip
    else:
        page.sections.append(Section(
            "notes", "Value histograms",
            items=["This dump has no histograms: write it with `modeltap dump --hist`."],
        ))  # fmt: skip
    return page

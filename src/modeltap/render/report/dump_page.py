"""The dump page: the module tree with every statistic as a column, the statistics along the
execution order with blocks marked, NaN/Inf highlighted, and per-tensor value histograms."""

from __future__ import annotations

import json
import re
from typing import Any

from modeltap.dump import GRAD_PREFIX, Dump
from modeltap.render.report.page import (
    HEATMAP_SCALE,
    OKABE_ITO,
    Page,
    Section,
    fmt,
    layout,
    positive,
)
from modeltap.render.tree import _module_tree, _Node, _relative
from modeltap.stats import HIST_EDGES, TensorStats

COLUMNS = ["module / key", "shape", "dtype", "norm", "mean", "std", "min", "max", "absmax",
           "dead units", "NaN", "Inf"]  # fmt: skip
# A block: the part of a module name up to its first numbered child (encoder.layer.3).
_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def block_of(key: str) -> str | None:
    from modeltap.capture.keys import split_key

    match = _BLOCK.match(split_key(key.removeprefix(GRAD_PREFIX))[0])
    return match.group(1) if match else None


# Tick labels an axis shows at most: beyond, every other segment's (then every third...).
MAX_TICKS = 48


def _module(key: str) -> str:
    from modeltap.capture.keys import split_key

    return split_key(key.removeprefix(GRAD_PREFIX))[0]


def _segments(keys: list[str]) -> list[tuple[int, str]]:
    """(index, label) where each run of keys begins: a block (`encoder.layer.3`) or, between
    blocks, a module (`embeddings`, `pooler`); every key when they are few."""
    if len(keys) <= 24:
        return list(enumerate(keys))
    out: list[tuple[int, str]] = []
    current: str | None = None
    for i, key in enumerate(keys):
        segment = block_of(key) or _module(key).split(".")[0]
        if segment != current:
            out.append((i, segment))
            current = segment
    return out


def _short(label: str, width: int = 28) -> str:
    return label if len(label) <= width else "…" + label[len(label) - width + 1 :]


def axis_ticks(keys: list[str], title: str, *, categories: bool = False) -> dict[str, Any]:
    """An axis over keys in execution order, labelled with module names where each block (or
    module between blocks) begins, instead of bare indices. `categories`: the axis holds the
    keys themselves (a heatmap's), not their indices."""
    segments = _segments(keys)
    step = max(1, -(-len(segments) // MAX_TICKS))
    chosen = segments[::step]
    return {
        "title": {"text": title},
        "automargin": True,
        "tickmode": "array",
        "tickvals": [keys[i] if categories else i for i, _ in chosen],
        "ticktext": [_short(label) for _, label in chosen],
        "tickangle": -40,
        "zeroline": False,  # x = 0 is the first key, not a value
        **({"type": "category"} if categories else {}),
    }


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


def _block_marks(keys: list[str]) -> list[dict[str, Any]]:
    """Shaded bands for every other block along the x axis (one block = one numbered child)."""
    shapes: list[dict[str, Any]] = []
    start = 0
    current = block_of(keys[0]) if keys else None
    blocks = 0
    for i in range(1, len(keys) + 1):
        block = block_of(keys[i]) if i < len(keys) else None
        if block != current:
            if current is not None:
                if blocks % 2 == 0:
                    shapes.append({
                        "type": "rect", "xref": "x", "yref": "paper", "x0": start - 0.5,
                        "x1": i - 0.5, "y0": 0, "y1": 1, "fillcolor": "#888", "opacity": 0.12,
                        "line": {"width": 0}, "layer": "below", "name": current,
                    })  # fmt: skip
                blocks += 1
            start, current = i, block
    return shapes


_STATISTICS = [
    ("norm", "L2 norm of the output", "‖x‖₂ (log scale)", True),
    ("absmax", "Largest magnitude", "max |x| (log scale)", True),
    ("std", "Standard deviation", "std (log scale)", True),
    ("dead", "Dead units", "share of dead units (%)", False),
]


def _value(stats: TensorStats | None, name: str) -> float | None:
    if stats is None:
        return None
    if name == "dead":
        fraction = stats.dead_fraction
        return None if fraction is None else 100.0 * fraction
    return positive(getattr(stats, name))


def _hover(key: str, stats: TensorStats | None) -> str:
    if stats is None:
        return key
    parts = [key, f"shape {'×'.join(map(str, stats.shape))} {stats.dtype}"]
    for name in ("norm", "mean", "std", "absmax"):
        parts.append(f"{name} {fmt(getattr(stats, name))}")
    if stats.dead is not None:
        parts.append(f"dead {stats.dead}/{stats.units}")
    if stats.nan or stats.inf:
        parts.append(f"NaN {stats.nan}, Inf {stats.inf}")
    return "<br>".join(parts)


def line_figures(dump: Dump, keys: list[str], prefix: str, what: str) -> dict[str, Any]:
    """One chart per statistic along the execution order; NaN/Inf keys marked on each."""
    figures = {}
    stats = [dump.stats_for(k) for k in keys]
    hover = [_hover(k, s) for k, s in zip(keys, stats, strict=True)]
    x = list(range(len(keys)))
    bad = [i for i, s in enumerate(stats) if s is not None and (s.nan or s.inf)]
    shapes = _block_marks(keys)
    for name, title, y_title, log in _STATISTICS:
        y = [_value(s, name) for s in stats]
        if all(v is None for v in y):
            continue
        data = [{
            "type": "scatter", "mode": "lines+markers", "name": name, "x": x, "y": y,
            "hovertext": hover, "hoverinfo": "text", "marker": {"size": 4}, "line": {"width": 1.5},
            "connectgaps": False,
        }]  # fmt: skip
        if bad:
            data.append({
                "type": "scatter", "mode": "markers", "name": "NaN/Inf in the output",
                "x": bad, "y": [y[i] if y[i] is not None else None for i in bad],
                "hovertext": [hover[i] for i in bad], "hoverinfo": "text",
                "marker": {"symbol": "x", "size": 11, "color": OKABE_ITO[3]},
            })  # fmt: skip
        figures[f"{prefix}-{name}"] = {
            "data": data,
            "layout": layout(
                f"{title} ({what}); shaded: every other block",
                "module (execution order; hover for the key)",
                y_title,
                log_y=log,
                shapes=shapes,
                showlegend=bool(bad),
                xaxis=axis_ticks(keys, "module (execution order; hover for the key)"),
            ),
        }
    return figures


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
        from modeltap.render.report.generation_page import generation_page

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

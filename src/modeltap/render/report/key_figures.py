"""Charts along the execution order that the dump, diff and generation pages share: the axis
labelled by block, the shaded blocks, and one line chart per statistic."""

from __future__ import annotations

import re
from typing import Any

from modeltap.dump import GRAD_PREFIX, Dump
from modeltap.render.report.page import OKABE_ITO, fmt, layout, positive
from modeltap.stats import TensorStats

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

"""The `--formats` figures (stats/formats.py) on the report pages: a key x format heatmap of SQNR
(the dump page), a step x key heatmap per format and the first step each key falls below a
threshold (the run page). Colours follow the thresholds of the dump tree (render/tree.py, read
through diff.formats.thresholds): below the `bad` one in vermillion, below `warn` in yellow,
above both in blues that darken with the SQNR, as red / yellow / plain do in the terminal."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from modeltap.diff.formats import level, thresholds
from modeltap.render.report.page import OKABE_ITO, Section, layout
from modeltap.render.tables import db_text

# A heatmap's colour range at least this high (dB), so the blues of "ok" take room to shade.
SQNR_TOP = 60.0
# Cells labelled with their value at most (rows); above, the hover says it.
LABELLED_ROWS = 60
_BLUES = ("#c6dbef", "#0072B2")  # light to Okabe-Ito blue, above the `warn` threshold


def sqnr_scale(zmax: float) -> tuple[list[list[Any]], float]:
    """(plotly colourscale over [0, zmax] dB with hard steps at the thresholds, zmax)."""
    limits = thresholds()
    top = max(zmax, SQNR_TOP, limits["warn"] + 1.0)
    bad, warn = limits["bad"] / top, limits["warn"] / top
    scale = [[0.0, OKABE_ITO[3]], [bad, OKABE_ITO[3]], [bad, OKABE_ITO[6]], [warn, OKABE_ITO[6]],
             [warn, _BLUES[0]], [1.0, _BLUES[1]]]  # fmt: skip
    return scale, top


def _colorbar() -> dict[str, Any]:
    limits = thresholds()
    ticks = [0.0, limits["bad"], limits["warn"]]
    return {"title": {"text": "SQNR (dB)"}, "tickvals": ticks,
            "ticktext": [f"{t:g}" for t in ticks]}  # fmt: skip


def sqnr_heatmap(
    x: Sequence[Any], y: Sequence[str], cells: list[list[float | None | str]], *, title: str,
    x_title: str, y_title: str, x_axis: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A heatmap of SQNR dB: `cells[row][column]` a number, None where quantizing is exact
    (drawn at the top of the scale, labelled inf) or "" where the tensor has no figure (empty)."""
    present = [v for row in cells for v in row if isinstance(v, float) and math.isfinite(v)]
    scale, top = sqnr_scale(max(present, default=0.0))
    z = [[None if v == "" else top if v is None else v for v in row] for row in cells]
    text = [["" if v == "" else db_text(v) for v in row] for row in cells]  # type: ignore[arg-type]
    trace: dict[str, Any] = {
        "type": "heatmap", "x": list(x), "y": list(y), "z": z, "text": text,
        "colorscale": scale, "zmin": 0.0, "zmax": top, "colorbar": _colorbar(),
        "hovertemplate": "%{y}<br>%{x}: SQNR %{text} dB<extra></extra>", "hoverongaps": False,
        "xgap": 1, "ygap": 1,
    }  # fmt: skip
    if len(y) <= LABELLED_ROWS:
        trace["texttemplate"] = "%{text}"
    return {"data": [trace], "layout": layout(
        title, x_title, y_title, height=max(320, min(1100, 16 * len(y) + 140)),
        xaxis=x_axis or {"type": "category", "title": {"text": x_title}, "automargin": True},
        yaxis={"autorange": "reversed", "automargin": True, "type": "category",
               "title": {"text": y_title}},
    )}  # fmt: skip


def dump_formats_section(
    formats: Sequence[str], keys: Sequence[str], figures: dict[str, dict[str, Any]]
) -> tuple[dict[str, Any], Section]:
    """The dump page's key x format heatmap (`figures`: key -> format -> its figures)."""
    shown = [k for k in keys if figures.get(k)]
    cells = [[_sqnr(figures[k].get(name)) for name in formats] for k in shown]
    figure = sqnr_heatmap(formats, shown, cells, title="What each format would cost: SQNR per "
                          "key (row = key in execution order)", x_title="format",
                          y_title="key (execution order)")  # fmt: skip
    limits = thresholds()
    worst = _worst(formats, shown, figures)
    section = Section(
        "charts", "Low-precision formats", charts=["formats-sqnr"],
        note=f"SQNR in dB of quantizing each tensor in each format (`--formats`; the recipes are "
        f"on the dump page of the docs): vermillion below {limits['bad']:g} dB (a relative RMS "
        f"error above 10%), yellow below {limits['warn']:g} dB, blue above, darker the better; "
        f"as the tree colours them. {worst}",
    )
    return figure, section


def _sqnr(figures: dict[str, Any] | None) -> float | None | str:
    return "" if figures is None else figures.get("sqnr_db")


def _worst(formats: Sequence[str], keys: Sequence[str], figures: dict[str, dict[str, Any]]) -> str:
    parts = []
    for name in formats:
        values = [(f["sqnr_db"], k) for k in keys if (f := figures[k].get(name))
                  and f.get("sqnr_db") is not None]  # fmt: skip
        if values:
            db, key = min(values)
            parts.append(f"{name} {key} ({db_text(db)} dB)")
    return "Worst per format: " + "; ".join(parts) + "." if parts else ""


def first_crossings(
    formats: Sequence[str], steps: Sequence[tuple[int, dict[str, dict[str, Any]]]]
) -> list[dict[str, Any]]:
    """Per key and format that ever falls below a threshold: the first step below `warn` and
    below `bad`, with the SQNR then, at the first recorded step and at the last. `steps`: (step,
    key -> format -> figures) in step order."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for step, keys in steps:
        for key, by_format in keys.items():
            for name in formats:
                figures = by_format.get(name)
                if figures is None:
                    continue
                db = figures.get("sqnr_db")
                row = found.setdefault((key, name), {"key": key, "format": name, "first_db": db,
                                                     "warn": None, "bad": None})  # fmt: skip
                row["last_db"] = db
                reached = level(db)
                for which in ("warn", "bad"):
                    if row[which] is None and reached in ("bad", which):
                        row[which] = {"step": step, "sqnr_db": db}
    rows = [r for r in found.values() if r["warn"] is not None]
    return sorted(rows, key=lambda r: (r["warn"]["step"], formats.index(r["format"])))

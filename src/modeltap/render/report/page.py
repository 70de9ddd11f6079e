"""What every report page shares: the Jinja2 template, plotly.js inlined once, the data embedded
as JSON, colour-blind-safe colours, the footer, and the atomic write."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

# Okabe & Ito's eight colours, distinguishable with every common colour-vision deficiency.
OKABE_ITO = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]
# Cividis: a sequential scale designed to read the same with deuteranopia and protanopia.
HEATMAP_SCALE = "Cividis"
# For a <td> background by value: cividis at a few stops (dark blue -> yellow).
CIVIDIS_STOPS = ["#00224e", "#123570", "#3b496c", "#575d6d", "#707173", "#8a8779", "#a69d75",
                 "#c4b56c", "#e4cf5b", "#fee838"]  # fmt: skip


@dataclass
class Section:
    """One part of a page: `kind` picks its template block (charts, tree, table, notes)."""

    kind: str
    title: str
    note: str = ""
    charts: list[str] = field(default_factory=list)  # ids of figures in the page's `figures`
    columns: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    items: list[str] = field(default_factory=list)
    select: dict[str, Any] | None = None  # a <select> that swaps a chart's data (see report.js)


@dataclass
class Page:
    title: str
    kind: str  # dump | diff | compare | run
    summary: list[tuple[str, str, str]] = field(default_factory=list)  # (label, value, level)
    sections: list[Section] = field(default_factory=list)
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    command: str = ""
    produced_with: dict[str, str] = field(default_factory=dict)  # versions that wrote the inputs


def finite(value: Any) -> float | None:
    """A number plotly and JSON can take: None for missing, NaN and infinities."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def positive(value: Any) -> float | None:
    """A number a log axis can show: None for missing, non-finite and <= 0."""
    value = finite(value)
    return value if value is not None and value > 0 else None


def fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    return str(value)


def cividis(fraction: float) -> str:
    """A background colour for a fraction in [0, 1] of a cell's scale."""
    index = round(min(1.0, max(0.0, fraction)) * (len(CIVIDIS_STOPS) - 1))
    return CIVIDIS_STOPS[index]


def versions() -> dict[str, str]:
    """modeltap's version and the installed torch's and transformers' (read without importing)."""
    from modeltap._version import __version__

    found = {"modeltap": __version__}
    for name in ("torch", "transformers", "plotly"):
        try:
            found[name] = importlib_metadata.version(name)
        except importlib_metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def layout(title: str, x_title: str, y_title: str, *, log_y: bool = False, **extra: Any) -> dict:
    """A plotly layout with labelled axes (units in the titles) and a compact margin."""
    return {
        "title": {"text": title, "x": 0.01, "font": {"size": 15}},
        "xaxis": {"title": {"text": x_title}, "automargin": True},
        # A log axis spanning less than a decade labels its minor ticks: in full (0.02, 0.05),
        # not as bare digits (2, 5) that read as values.
        "yaxis": {"title": {"text": y_title}, "type": "log" if log_y else "-",
                  "automargin": True,
                  **({"minorloglabels": "complete", "exponentformat": "power"} if log_y else {})},
        "margin": {"l": 60, "r": 20, "t": 40, "b": 50},
        "height": 320,
        "hovermode": "closest",
        "colorway": OKABE_ITO,
        "legend": {"orientation": "h", "y": -0.25},
        **extra,
    }  # fmt: skip


def _json_for_script(value: Any) -> str:
    """JSON safe inside <script>: no `</` can close the element early."""
    text = json.dumps(value, allow_nan=False, separators=(",", ":"))
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def _environment() -> Any:
    from jinja2 import Environment, PackageLoader, select_autoescape

    return Environment(
        loader=PackageLoader("modeltap.render.report", "templates"),
        autoescape=select_autoescape(["html", "j2"]),
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(page: Page) -> str:
    """The page as one self-contained HTML document (plotly.js, styles and data inline)."""
    from plotly.offline import get_plotlyjs

    env = _environment()
    template = env.get_template("page.html.j2")
    return template.render(
        page=page,
        versions=versions(),
        plotly_js=get_plotlyjs(),
        report_js=env.loader.get_source(env, "report.js")[0],
        report_css=env.loader.get_source(env, "report.css")[0],
        figures_json=_json_for_script(page.figures),
        variants_json=_json_for_script(page.variants),
    )


def write_page(path: str | os.PathLike[str], html: str) -> Path:
    """Write the page whole or not at all (a temporary file beside it, then a rename)."""
    from modeltap.dump import temp_path, write_target

    target = write_target(Path(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(target)
    try:
        tmp.write_text(html, encoding="utf-8")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target

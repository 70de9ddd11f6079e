"""The dump as a tree: the module hierarchy with each output's statistics, and the shared look."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from modeltap.capture import split_key
from modeltap.capture.keys import op_owner
from modeltap.dump import GRAD_PREFIX
from modeltap.selection import ROOT

if TYPE_CHECKING:
    from torch import nn

    from modeltap.dump import Dump
    from modeltap.loading.tree_cache import ModuleInfo
    from modeltap.stats import TensorStats

# A unit share at or above this many dead units is shown in the warning colour.
DEAD_WARN = 0.5
# Terminals at least this wide get the extra columns (dtype, std, min, max, aliases).
WIDE = 120
# A --formats column shows SQNR in dB: below FORMAT_BAD_DB (a relative RMS error above 10%) in
# red, below FORMAT_WARN_DB (above about 3%) in yellow.
FORMAT_BAD_DB = 20.0
FORMAT_WARN_DB = 30.0


def _plain_table() -> Table:
    """No borders, one space between columns: the look of every modeltap table."""
    return Table(
        box=None,
        pad_edge=False,
        show_edge=False,
        header_style="bold",
        padding=(0, 1),
        collapse_padding=True,
    )


# A value this small next to its tensor's scale (absmax) is float rounding, shown as `~0`.
NEGLIGIBLE = 1e-6


def fmt(value: float | None, scale: float | None = None) -> str:
    """Four significant digits in at most 8 characters: 0.007522, 886.7, -1.79e-4, 3.4e+38.

    With `scale` (the tensor's absmax), a nonzero value below NEGLIGIBLE x scale shows as `~0`:
    a LayerNorm output's mean of 6e-9 is rounding noise whose digits differ between CPUs.
    """
    if value is None:
        return "-"
    if scale and value and math.isfinite(scale) and abs(value) < NEGLIGIBLE * scale:
        return "~0"
    if value == 0 or (math.isfinite(value) and 1e-3 <= abs(value) < 1e4):
        return f"{value:.4g}"
    if not math.isfinite(value):
        return str(value)
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def fmt_shape(shape: Sequence[int]) -> str:
    return "×".join(str(s) for s in shape) if shape else "scalar"


@dataclass
class _Node:
    module: str
    keys: list[str] = field(default_factory=list)
    children: list[_Node] = field(default_factory=list)
    first: int = 0


def _module_tree(keys: Sequence[str]) -> list[_Node]:
    """Modules of `keys` as a forest: each under its nearest listed ancestor, in first-use order."""
    nodes: dict[str, _Node] = {}
    for index, key in enumerate(keys):
        module = split_key(op_owner(key) or key)[0]  # an op (`m/op07.softmax`): under `m`
        node = nodes.setdefault(module, _Node(module, first=index))
        node.keys.append(key)
    roots: list[_Node] = []
    for name in nodes:
        parent = _nearest_ancestor(name, nodes)
        (roots if parent is None else nodes[parent].children).append(nodes[name])

    def first_use(node: _Node) -> int:
        node.children.sort(key=first_use)
        return min([node.first, *(first_use(c) for c in node.children)])

    roots.sort(key=first_use)
    return roots


def _nearest_ancestor(name: str, nodes: dict[str, _Node]) -> str | None:
    if name == ROOT:
        return None
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        candidate = ".".join(parts[:cut])
        if candidate in nodes:
            return candidate
    return ROOT if ROOT in nodes else None


def _relative(name: str, parent: str | None) -> str:
    if parent is None or parent == ROOT:
        return name
    return name[len(parent) + 1 :]


def _walk(nodes: list[_Node], parent: str | None, prefix: str) -> Iterable[tuple[str, str | None]]:
    """(tree-guided label, key or None for a branch without its own row) in display order."""
    for i, node in enumerate(nodes):
        last = i == len(nodes) - 1
        guide = prefix + ("└─ " if last else "├─ ") if parent is not None else prefix
        inner = prefix + ("   " if last else "│  ") if parent is not None else prefix
        label = _relative(node.module, parent)
        plain = [k for k in node.keys if k == node.module]
        extra = [k for k in node.keys if k != node.module]
        yield guide + label, plain[0] if plain else None
        sub = [(k[len(node.module) :], k) for k in extra]
        for j, (suffix, key) in enumerate(sub):
            end = j == len(sub) - 1 and not node.children
            yield inner + ("└─ " if end else "├─ ") + suffix, key
        yield from _walk(node.children, node.module, inner)


def dump_table(dump: Dump, *, width: int = 80) -> Table | Text:
    """The tree of captured tensors with their statistics, as wide as `width` allows.

    Numbers are never cut: the module column takes what they leave, and a name too long for it
    loses its start (`…self.query.weight`), keeping the end that tells tensors apart.
    """
    walked = list(_walk(_module_tree(activation_keys(dump)), None, ""))
    formats = dump_formats(dump)
    # The wide columns where they fit, else the narrow ones: Rich's table, which shares out what
    # width there is, is the last resort (it measures every cell: 0.16 s for 114 rows).
    for wide in [True, False] if width >= WIDE else [False]:
        rows = []
        for label, key in walked:
            if key is None:
                rows.append((label, []))
                continue
            stats = dump.stats_for(key)
            cells = _stats_cells("", stats, wide=wide, alias_of=dump.aliases.get(key))
            if formats and stats is not None:  # before the alias column
                at = len(cells) - 1 if wide else len(cells)
                cells[at:at] = format_cells(stats, formats)
            rows.append((label, cells[1:]))
        headers = ["shape", "norm", "mean", "absmax", "nan/inf", "dead", *formats]
        if wide:
            headers = ["shape", "dtype", "norm", "mean", "std", "min", "max", "nan/inf", "dead"]
            headers += formats
            if dump.aliases:
                headers.append("same tensor as")
        widths = [len(h) for h in headers]
        for _, cells in rows:
            for i, cell in enumerate(cells[: len(headers)]):
                widths[i] = max(widths[i], len(cell))
        if wide and dump.aliases:
            widths[-1] = min(widths[-1], 36)
        key_width = max(16, width - sum(widths) - len(widths))
        labels = [_fit(label, key_width) for label, _ in rows]
        columns = max(len(label) for label in ["module", *labels])
        if columns + sum(widths) + len(widths) <= width:
            justify = ["left" if h in ("dtype", "same tensor as") else "right" for h in headers]
            body = [
                [label, *cells[: len(headers)]]
                for label, (_, cells) in zip(labels, rows, strict=True)
            ]
            return _aligned(["module", *headers], [columns, *widths], ["left", *justify], body)
    # Too narrow for every number: Rich's table shares out what there is.
    table = _plain_table()
    table.add_column("module", no_wrap=True, overflow="ellipsis", max_width=key_width)
    for header, min_width in zip(headers, widths, strict=True):
        justify = "left" if header in ("dtype", "same tensor as") else "right"
        overflow = "ellipsis" if header == "same tensor as" else "fold"
        table.add_column(
            header,
            justify=justify,
            no_wrap=True,
            min_width=min_width,
            overflow=overflow,
            max_width=36 if header == "same tensor as" else None,
        )
    for label, cells in rows:
        table.add_row(_fit(label, key_width), *cells[: len(headers)])
    return table


def _aligned(
    headers: Sequence[str],
    widths: Sequence[int],
    justify: Sequence[str],
    rows: Iterable[Sequence[str | Text]],
) -> Text:
    """What `_plain_table` prints for columns of known widths, laid out directly: Rich measures
    every cell of a table, which took most of `modeltap show`'s time on a model of 100 modules.

    A cell longer than its column ends in `…`. Lines are padded to the table's width, as Rich
    pads them.
    """
    out = Text(no_wrap=True, overflow="ignore", end="\n")
    lines: list[Sequence[str | Text]] = [headers, *rows]
    for n, cells in enumerate(lines):
        if n:
            out.append("\n")
        line = Text(style="bold") if n == 0 else out
        for i, (cell, size, side) in enumerate(zip(cells, widths, justify, strict=False)):
            text = cell if isinstance(cell, Text) else Text(cell)
            if text.cell_len > size:
                text = text[: size - 1] + "…"
            gap = " " * (size - text.cell_len)
            if i:
                line.append(" ")
            if side == "right":
                line.append(gap)
            line.append_text(text)
            if side != "right":
                line.append(gap)
        missing = sum(w + 1 for w in widths[len(cells) :])
        if missing:
            line.append(" " * missing)
        if n == 0:
            out.append_text(line)
    return out


def _fit(label: str, width: int) -> str:
    """Cut a tree label from the start of its name, after the tree guides, to `width`."""
    if len(label) <= width:
        return label
    name_at = len(label) - len(label.lstrip("│├└─ "))
    keep = width - name_at - 1
    return label[:name_at] + "…" + label[len(label) - keep :] if keep > 0 else label[:width]


def _stats_cells(
    label: str, stats: TensorStats | None, *, wide: bool, alias_of: str | None
) -> list[Any]:
    style = "dim" if alias_of else ""
    if stats is None:
        return [Text(label, style=style), "?"]
    bad = stats.nan + stats.inf
    name = Text(label, style="bold red" if bad else style)
    cells: list[Any] = [name, Text(fmt_shape(stats.shape), style=style)]
    if wide:
        cells.append(Text(stats.dtype, style=style))
    scale = stats.absmax
    cells += [Text(fmt(stats.norm), style=style), Text(fmt(stats.mean, scale), style=style)]
    if wide:
        cells += [Text(fmt(v), style=style) for v in (stats.std, stats.min, stats.max)]
    else:
        cells.append(Text(fmt(stats.absmax), style=style))
    cells.append(
        Text(f"{stats.nan}/{stats.inf}" if bad else "0", style="bold red" if bad else style)
    )
    cells.append(_dead_cell(stats, wide=wide, style=style))
    if wide:
        cells.append(Text(alias_of or "", style="dim"))
    return cells


def dump_formats(dump: Dump) -> list[str]:
    """The formats a dump written with --formats holds figures of (metadata `formats`)."""
    return list(json.loads(dump.metadata.get("formats", "[]")))


def format_cells(stats: TensorStats, formats: Sequence[str]) -> list[Text]:
    """SQNR in dB per format, coloured by FORMAT_BAD_DB / FORMAT_WARN_DB; `-` for none (not a
    float tensor), `inf` where quantizing changes nothing."""
    cells = []
    for name in formats:
        figures = (stats.formats or {}).get(name)
        if figures is None:
            cells.append(Text("-"))
            continue
        db = figures.get("sqnr_db")
        if db is None:
            cells.append(Text("inf"))
            continue
        style = "red" if db < FORMAT_BAD_DB else "yellow" if db < FORMAT_WARN_DB else ""
        cells.append(Text(f"{db:.1f}", style=style))
    return cells


def _dead_cell(stats: TensorStats, *, wide: bool, style: str) -> Text:
    fraction = stats.dead_fraction
    if fraction is None:
        return Text("-", style=style)
    text = f"{stats.dead}/{stats.units}" if wide else f"{fraction:.0%}"
    return Text(text, style="yellow" if fraction >= DEAD_WARN else style)


def dump_heading(dump: Dump) -> Text:
    """A line or two above the table: what ran on what, and what the file holds."""
    meta = dump.metadata
    text = Text()
    if dump.is_modeltap:
        text.append(meta.get("model", "?"), style="bold")
        text.append(f" ({meta.get('model_class', '?')}, {meta.get('dtype', '?')}, ")
        text.append(f"{meta.get('device', '?')})")
        inputs = json.loads(meta.get("inputs", "{}"))
        if inputs.get("files"):  # images / audio through the model's processor
            shown = [f["file"] for f in inputs["files"]]
            shown += [repr(t) for t in inputs.get("texts", [])]
            text.append(f"  inputs: {' | '.join(shown)} via {inputs.get('processor', '?')}")
        elif "texts" in inputs:
            text.append("  inputs: " + " | ".join(repr(t) for t in inputs["texts"]))
        elif "file" in inputs:
            text.append(f"  inputs: {inputs['file']}")
        text.append("\n")
    else:
        text.append(f"{dump.path.name}: plain safetensors file, no modeltap metadata\n")
    n_aliases = len([k for k in dump.aliases if not k.startswith(GRAD_PREFIX)])
    n_tensors = len([k for k in dump.stats if not k.startswith(GRAD_PREFIX)])
    if not n_tensors and "grad" in meta:
        text.append("gradients only (no activations)", style="bold")
        return text
    text.append(f"{n_tensors} tensors", style="bold")
    text.append(f", {n_aliases} aliases" if n_aliases else "")
    skipped = len(json.loads(meta.get("skipped", "{}"))) + int(meta.get("skipped_none", "0") or 0)
    text.append(f", {skipped} non-tensor outputs skipped" if skipped else "")
    if meta.get("stats_only") == "true":
        text.append("  (statistics only, no tensor data)", style="italic")
    return text


def dump_json(dump: Dump) -> dict[str, Any]:
    """The same statistics as the table, as one JSON-ready object."""
    meta = dump.metadata
    ops = json.loads(meta.get("ops", "{}"))  # dump --ops: each op key's metadata
    tensors = []
    for key in activation_keys(dump):
        module, call, part = split_key(key)
        stats = dump.stats_for(key)
        entry: dict[str, Any] = {"key": key, "module": module, "call": call, "part": part}
        if key.partition(":")[0] in ops:
            entry["op"] = ops[key.partition(":")[0]]
        if key in dump.aliases:
            entry["alias_of"] = dump.aliases[key]
        if stats is not None:
            entry.update(stats.to_json())
        tensors.append(entry)
    header = {
        k: meta[k] for k in ("model", "model_class", "revision", "dtype", "device") if k in meta
    }
    for k in ("inputs", "selection", "skipped"):
        if k in meta:
            header[k] = json.loads(meta[k])
    out: dict[str, Any] = {"file": str(dump.path), **header, "tensors": tensors}
    grad = grad_meta(dump)
    if grad is not None:
        entries = []
        for key in grad["keys"]:
            entry = {"key": key, "param": key in grad["params"]}
            stats = dump.stats_for(GRAD_PREFIX + key)
            if key in grad["no_path"]:
                entry["no_path"] = grad["no_path"][key]
            elif stats is not None:
                entry.update(stats.to_json())
                entry["flag"] = grad_flag(stats, grad)
            if key in grad.get("jacobian", {}):
                entry["jacobian"] = grad["jacobian"][key]
            entries.append(entry)
        summary = {k: v for k, v in grad.items() if k not in ("keys", "jacobian")}
        out["gradients"] = {**summary, "tensors": entries}
    return out


def module_table(modules: nn.Module | Sequence[ModuleInfo], names: Sequence[str]) -> Table:
    """`modeltap ls`: the selected modules as a tree, with class and parameter count; of a
    model, or of its modules as `loading.tree_cache` keeps them."""
    if not isinstance(modules, Sequence):
        from modeltap.loading.tree_cache import module_infos

        modules = module_infos(modules)
    by_name = {m.name: m for m in modules}
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    table.add_column("module", no_wrap=True, overflow="ellipsis")
    table.add_column("class")
    table.add_column("params", justify="right")
    for label, key in _walk(_module_tree(list(names)), None, ""):
        info = by_name[key] if key is not None else None
        if info is None:
            table.add_row(label)
            continue
        table.add_row(label, info.cls, f"{info.params:,}")
    return table


# Rows shown by `modeltap diff` without --all.


def activation_keys(dump: Dump) -> list[str]:
    return [k for k in dump.keys() if not k.startswith(GRAD_PREFIX)]


def grad_meta(dump: Dump) -> dict[str, Any] | None:
    """The `grad` metadata of a dump written with gradients, or None."""
    raw = dump.metadata.get("grad")
    return json.loads(raw) if raw else None


def grad_flag(stats: TensorStats, grad: dict[str, Any]) -> str:
    """`nan/inf`, `exploding` (norm above the threshold), `vanishing` (below), or ``."""
    if stats.nan or stats.inf:
        return "nan/inf"
    if stats.norm is not None and stats.norm > grad["exploding"]:
        return "exploding"
    if stats.norm is not None and stats.norm < grad["vanishing"]:
        return "vanishing"
    return ""

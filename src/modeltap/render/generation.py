"""Pure builders for generation dumps: the prompt, what was generated, and one row per step."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from modeltap.dump import Dump


def _token(text: str | None, token: int) -> str:
    return repr(text) if text is not None else str(token)


def generation_heading(dump: Dump, gen: dict[str, Any]) -> Text:
    """What ran, the prompt and the generated text of each row, and why decoding stopped."""
    meta = dump.metadata
    text = Text()
    text.append(meta.get("model", "?"), style="bold")
    text.append(f" ({meta.get('model_class', '?')}, {meta.get('dtype', '?')}, ")
    text.append(f"{meta.get('device', '?')})\n")
    prompts = gen.get("prompt") or [None] * len(gen["new_ids"])
    texts = gen.get("text") or [None] * len(gen["new_ids"])
    for row, (prompt, generated) in enumerate(zip(prompts, texts, strict=True)):
        label = f"[{row}] " if len(prompts) > 1 else ""
        text.append(f"{label}prompt: {prompt!r}\n" if prompt is not None else "")
        n = len(gen["new_ids"][row])
        shown = repr(generated) if generated is not None else str(gen["new_ids"][row])
        text.append(f"{label}generated ({n} tokens): ", style="bold")
        text.append(f"{shown}\n")
    decoding = gen.get("decoding", {})
    how = (
        "sampled (seed " + str(decoding.get("seed")) + ")"
        if decoding.get("do_sample")
        else "greedy"
    )
    text.append(
        f"{gen['forwards']} steps, {how}, stopped by {gen['stop']}; tensors of step(s) "
        f"{_ranges(gen.get('full_steps', []))}, statistics of the others"
    )
    return text


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "none"
    parts, start, prev = [], steps[0], steps[0]
    for s in [*steps[1:], None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if s is not None:
            start = prev = s
    return ",".join(parts)


def generation_table(gen: dict[str, Any], row: int = 0) -> Table:
    """One row per step of batch row `row`: the token it chose, its probability, the runner-up."""
    table = Table(box=None, pad_edge=False, show_edge=False)
    for name, justify in (
        ("step", "right"),
        ("token", "left"),
        ("p", "right"),
        ("runner-up", "left"),
        ("p", "right"),
        ("tensors", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    full = set(gen.get("full_steps", []))
    for step in gen["steps"]:
        texts = step.get("text") or [None] * len(step["token"])
        seconds = step.get("second_text") or [None] * len(step["token"])
        table.add_row(
            str(step["step"]),
            _token(texts[row], step["token"][row]),
            f"{step['p'][row]:.3g}",
            _token(seconds[row], step["second"][row]),
            f"{step['p_second'][row]:.3g}",
            "yes" if step["step"] in full else "stats",
        )
    return table


def generation_json(dump: Dump, gen: dict[str, Any]) -> dict[str, Any]:
    meta = dump.metadata
    return {
        "file": str(dump.path),
        "model": meta.get("model"),
        "model_class": meta.get("model_class"),
        "inputs": json.loads(meta.get("inputs", "{}")),
        "generate": gen,
        "keys": len(dump.order or []),
    }

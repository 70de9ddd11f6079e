"""Pure builders for generation dumps: the prompt, what was generated, and one row per step."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from modeltap.dump import Dump


def _token(text: str | None, token: int | None) -> str:
    """`340 'quick'`: the id, and the text when a tokenizer gave one (a byte of a longer
    character decodes to '' or '�' alone)."""
    if token is None:
        return ""
    return f"{token} {text!r}" if text is not None else str(token)


def _p(p: float | None) -> str:
    """A probability; none past the end of a beam-search sequence (its token is padding)."""
    return "" if p is None else f"{p:.3g}"


def generation_heading(dump: Dump, gen: dict[str, Any]) -> Text:
    """What ran, the prompt and the generated text of each row, and why decoding stopped."""
    meta = dump.metadata
    text = Text()
    text.append(meta.get("model", "?"), style="bold")
    text.append(f" ({meta.get('model_class', '?')}, {meta.get('dtype', '?')}, ")
    text.append(f"{meta.get('device', '?')})\n")
    prompts = gen.get("prompt") or [None] * len(gen["new_ids"])
    texts = gen.get("text") or [None] * len(gen["new_ids"])
    files = [f["file"] for f in json.loads(meta.get("inputs", "{}")).get("files", [])]
    if files:
        text.append(f"inputs: {', '.join(files)}\n")
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
    beams = decoding.get("num_beams") or 1
    if beams > 1:
        sampled = f", sampled (seed {decoding.get('seed')})" if decoding.get("do_sample") else ""
        how = f"beam search ({beams} beams, each step's forward holds them all{sampled})"
    unstored = gen.get("unstored_forwards", 0)
    # Whisper's language detection: a forward before the decoding loop, run but not stored
    outside = (
        f" (and {unstored} forward{'s' if unstored > 1 else ''} outside the decoding loop, "
        "not stored)"
        if unstored
        else ""
    )
    text.append(
        f"{gen['forwards']} steps{outside}, {how}, stopped by {gen['stop']}; tensors: steps "
        f"{_ranges(gen.get('full_steps', []))} (others: statistics)"
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
    # beam search: the forward's row (beam) that chose the returned sequence's token
    beams = any("beam" in step for step in gen["steps"])
    columns = [("step", "right"), ("token", "left"), ("p", "right")]
    columns += [("beam", "right")] if beams else []
    columns += [("runner-up", "left"), ("p", "right"), ("tensors", "left")]
    for name, justify in columns:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    full = set(gen.get("full_steps", []))
    for step in gen["steps"]:
        texts = step.get("text") or [None] * len(step["token"])
        seconds = step.get("second_text") or [None] * len(step["token"])
        cells = [
            str(step["step"]),
            _token(texts[row], step["token"][row]),
            _p(step["p"][row]),
        ]
        if beams:
            cells.append("" if step["beam"][row] < 0 else str(step["beam"][row]))
        cells += [
            _token(seconds[row], step["second"][row]),
            _p(step["p_second"][row]),
            "yes" if step["step"] in full else "stats",
        ]
        table.add_row(*cells)
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


def generation_diff_heading(report: Any) -> Text:
    """Verdict, the first step whose token differs, and the first diverging step x module."""
    text = Text()
    verdict = "PASS" if report.passed else "FAIL"
    text.append(f"{verdict}", style="bold green" if report.passed else "bold red")
    steps = report.steps
    text.append(
        f"  {len(steps)} common steps compared ({report.tolerance.describe()})"
        + (f"; steps only in A: {_ranges(report.only_a)}" if report.only_a else "")
        + (f"; steps only in B: {_ranges(report.only_b)}" if report.only_b else "")
        + "\n"
    )
    split = report.split
    if split is None:
        text.append("tokens agree at every common step\n")
    else:
        row = f" (row {split.row})" if split.row else ""
        text.append(f"tokens agree up to step {split.step}{row}; at step {split.step} ")
        text.append(
            f"A chose {_token(split.text_a, split.token_a)} (p={_p(split.p_a)}), "
            f"B {_token(split.text_b, split.token_b)} (p={_p(split.p_b)})\n"
        )
    first = report.first_divergence
    if first is None:
        text.append("every compared step within tolerance")
    else:
        text.append(f"first divergence: step {first.step}, {first.first}", style="bold")
        text.append(f" (by {first.by})")
    return text


def generation_diff_table(report: Any, *, show_all: bool = False) -> Table:
    """Per step: how it was compared, how many keys are out of tolerance, the largest error."""
    table = Table(box=None, pad_edge=False, show_edge=False)
    for name, justify in (
        ("step", "right"),
        ("by", "left"),
        ("out", "right"),
        ("first out of tolerance", "left"),
        ("max abs", "right"),
        ("on", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for s in report.steps:
        if s.ok and not show_all and s.step != 0:
            continue
        table.add_row(
            str(s.step),
            s.by,
            f"{s.failed}/{s.compared}",
            s.first or "",
            "" if s.max_abs is None else f"{s.max_abs:.3g}",
            s.worst or "",
        )
    return table


def compare_generation_heading(result: Any) -> Text:
    """compare --generate: verdict, where the tokens part, the origin, and both texts."""
    text = Text()
    text.append(
        "PASS" if result.passed else "FAIL", style="bold green" if result.passed else "bold red"
    )
    cand = result.meta.get("candidate", {})
    steps = result.steps.steps
    label = cand.get("variant", "candidate")
    label = cand.get("model", "candidate") if label == "same" else label
    text.append(
        f"  {label} against the reference: {len(steps)} steps with "
        f"the reference's tokens forced ({result.steps.tolerance.describe()})\n"
    )
    leaving = result.departure
    if leaving is None:
        text.append(
            "tokens agree at every step (the candidate's likeliest token is the reference's)\n"
        )
    else:
        text.append(
            f"tokens agree up to step {leaving.step}; at step {leaving.step} ", style="bold"
        )
        text.append(
            f"the reference says {_token(leaving.reference_text, leaving.reference)} "
            f"(p={leaving.p_reference:.3g}), the candidate "
            f"{_token(leaving.candidate_text, leaving.candidate)} (p={leaving.p_candidate:.3g}, "
            f"margin {leaving.margin:.3g} over the reference's token)\n"
        )
    for tie in result.ties:
        row = f" (row {tie.row})" if tie.row else ""
        text.append(f"warning: step {tie.step}{row} is a near tie", style="yellow")
        text.append(
            f": the reference's logits part {tie.reference} and {tie.candidate} by "
            f"{tie.logit_margin:.3g}, the candidate moved that by {tie.shift:.3g}, within the "
            f"{tie.allowance:.3g} the preset allows two logits: not a defect\n"
        )
    beyond = result.failed_flip
    if beyond is not None and beyond.shift is not None:
        row = f" (row {beyond.row})" if beyond.row else ""
        text.append(
            f"at step {beyond.step}{row} the flip moved the two tokens' logit difference by "
            f"{beyond.shift:.3g} (the reference's margin {beyond.logit_margin:.3g}), beyond "
            f"the {beyond.allowance:.3g} the preset allows two logits\n"
        )
    first = result.steps.first_divergence
    if first is not None:
        text.append(f"first divergence: step {first.step}, {first.first}\n")
    if result.attribution is not None:
        origins = result.attribution.origins
        names = ", ".join(m.name for m in origins[:3]) or "no single module (see --json)"
        text.append(f"origin at step {result.attributed_step}: ", style="bold")
        text.append(f"{names} (replayed with the reference's tokens forced)\n")
    if result.meta.get("note"):
        text.append(f"note: {result.meta['note']}\n", style="dim")
    text.append(f"reference text: {_texts(result.reference.texts)}\n")
    text.append(f"candidate text (free-running): {_texts(result.free.texts)}")
    return text


def _texts(texts: list[str]) -> str:
    return " | ".join(repr(t) for t in texts) if texts else "(no tokenizer)"

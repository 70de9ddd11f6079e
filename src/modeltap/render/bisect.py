"""`compare --bisect`'s result as text: the set kept, then the output error against modules kept."""

from __future__ import annotations

from typing import Any

from rich.text import Text

CURVE_ROWS = 12  # the text shows this many points of the curve at most; --json has them all


def bisect_text(result: Any) -> Text:
    """The modules to keep in high precision, their share of the quantized weights, the output
    error with them kept, and the greedy curve (output error with the first k kept)."""
    text = Text()
    first = result.curve[0] if result.curve else None
    if first is not None and first.passed:
        text.append("bisect: nothing needs keeping", style="bold green")
        text.append(
            f": with every Linear {result.variant} ({result.engine}),\nthe output is within "
            f"{result.goal} (error {first.error:.3g})"
        )
        return text
    if not result.passed:
        text.append("bisect: no set passes", style="bold red")
        text.append(
            f": even with every Linear kept the output error is {result.error:.3g}; the error "
            "is not the quantized Linears' (see the origins above)\n"
        )
    else:
        text.append(f"bisect: keep {len(result.kept)} module(s)", style="bold")
        text.append(
            f" in high precision, {result.share:.2%} of the quantized weights;\noutput error "
            f"{result.error:.3g} with them kept, {result.variant} ({result.engine}) elsewhere:\n"
        )
        for name in result.kept:
            text.append(f"  {name}\n")
    text.append(
        f"output error ({result.measure}) with the first k modules kept (largest local "
        "error first):\n"
    )
    steps = result.curve
    if len(steps) > CURVE_ROWS:  # evenly spaced, the last one always
        every = -(-len(steps) // CURVE_ROWS)
        steps = [*steps[:-1:every], steps[-1]]
    for step in steps:
        mark = "pass" if step.passed else "fail"
        text.append(f"  k={step.kept:<3} {step.error:.3g}  {mark}\n")
    text.rstrip()
    return text

"""`modeltap.generate(model, tokenizer, prompt, path)`: what `modeltap generate` writes, from
Python."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from modeltap.generate.decode import Generated


def generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: str | Sequence[str],
    path: str | os.PathLike[str],
    *,
    max_new_tokens: int | None = None,
    num_beams: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    depth: int | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    steps: str | None = None,
    stats_only: bool = False,
    kv: bool = False,
    ops: bool = False,
    formats: Sequence[str] = (),
    chat: bool = False,
    metadata: dict[str, str] | None = None,
) -> Generated:
    """Run `model.generate()` on `prompt` (one or a batch) with the selected modules hooked and
    write every decoding step's outputs to `path` (keys `gen/step{k}/...`); returns what was
    generated (`.new_ids`, `.texts`, `.steps`, `.path`).

    A decoding option left None is the model's generation config's (greedy unless it says
    otherwise). Each step keeps statistics; the prefill and the last step keep tensors too, or the
    `steps` listed (`"0,5-9"`), or none with `stats_only`. `depth`, `include`, `exclude`: which
    modules, as `modeltap.dump`'s; `kv`: also each step's new K/V positions; `ops`: also every
    op of the selected modules' own code at each step (`gen/step{k}/module/opNN.name`), as
    `--ops`; `formats`: what quantizing each float tensor would cost, as `--formats`; `chat`:
    each prompt through the tokenizer's chat template."""
    from modeltap.generate.decode import generate_model
    from modeltap.generate.options import Decoding, StepPlan, prompt_inputs
    from modeltap.selection import Selection

    options = Decoding(max_new_tokens, do_sample, seed, temperature, top_k, top_p, num_beams)
    options.check()
    plan = StepPlan("none") if stats_only else StepPlan.parse(steps) if steps else StepPlan()
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    return generate_model(
        model,
        prompt_inputs(model, tokenizer, prompts, chat=chat),
        path,
        tokenizer=tokenizer,
        decoding=options,
        plan=plan,
        selection=Selection(depth=depth, include=tuple(include), exclude=tuple(exclude)),
        kv=kv,
        metadata=metadata,
        ops=ops,
        formats=formats,
    )
